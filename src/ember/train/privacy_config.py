"""``PrivacyConfig``: what DP-SGD guarantee :func:`ember.train.fit` trains for (no torch import,
so that ``ember train --help`` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass

from ember.train.errors import ConfigError
from ember.train.options import Rule, check_fields, option

__all__ = ["ACCOUNTANTS", "MAX_EPSILON", "PrivacyConfig"]

ACCOUNTANTS = ("rdp", "prv")
MAX_EPSILON = 100.0


@dataclass
class PrivacyConfig:
    """What DP-SGD guarantee to train for.

    - ``max_grad_norm``: per-example clipping bound C (required).
    - ``epsilon``, ``delta``: the target budget; the noise multiplier is then found by Opacus
      (``get_noise_multiplier``) for exactly the steps ``fit`` will take (``epochs *
      len(train_loader)``). Or give ``noise_multiplier`` directly (``delta`` is still needed to
      report epsilon). A ``delta`` of 1/N or more (N examples) warns: it allows leaking a record.
    - ``accountant``: Opacus's accountant, ``"rdp"`` or ``"prv"``. (``"gdp"`` is refused: its
      central-limit approximation under-reports epsilon at the sample rates used in practice.)
    - ``max_physical_batch_size``: split each Poisson (logical) batch into physical batches of at
      most this many examples; clipping stays per example and the accountant counts logical
      steps (Opacus's ``BatchMemoryManager``). None: one physical batch per logical one.
    - ``max_epsilon``: the budget stop: training ends right after the last step whose spent
      epsilon stays within this bound (``fit`` returns normally, ``stopped_early``).
    - ``replace_batchnorm``: replace every BatchNorm layer (trainable or not) by the GroupNorm
      Opacus's ``ModuleValidator.fix`` chooses, in place (the existing affine parameters are
      kept, so the optimizer still holds them); otherwise a model with BatchNorm is refused.
    - ``noise_seed``: for tests only, key the noise and sampling generator from this seed (anyone
      who knows it can remove the noise: **not private**; ``fit`` warns and marks the result and
      its records ``private: false``). None (default) keys it from the OS.
    """

    max_grad_norm: float | None = option(None, Rule.POSITIVE, "per-example gradient clipping "
                                         "bound C of DP-SGD", flag="--max-grad-norm")
    epsilon: float | None = option(None, Rule.POSITIVE, "train with DP-SGD for the budget "
                                   "(epsilon, delta) over the epochs: the noise multiplier is "
                                   "found for it", flag="--dp-epsilon", maximum=MAX_EPSILON)
    delta: float | None = option(None, Rule.OPEN_UNIT, "delta of the DP guarantee (below "
                                 "1/dataset size, e.g. 1e-5)", flag="--dp-delta")
    noise_multiplier: float | None = option(None, Rule.POSITIVE, "the noise multiplier, instead "
                                            "of one found for epsilon", cli=False)
    accountant: str = option("rdp", Rule.CHOICE, "privacy accountant", choices=ACCOUNTANTS,
                             flag="--dp-accountant")
    replace_batchnorm: bool = option(False, Rule.BOOL, "replace BatchNorm by GroupNorm",
                                     cli=False)
    noise_seed: int | None = option(None, Rule.INT_NONNEGATIVE, "tests only: key the noise "
                                    "from this seed (not private)", cli=False)
    max_physical_batch_size: int | None = option(None, Rule.INT_POSITIVE, "split each Poisson "
                                                 "batch into physical batches of at most this "
                                                 "many examples",
                                                 flag="--dp-max-physical-batch-size")
    max_epsilon: float | None = option(None, Rule.POSITIVE, "stop right after the last step "
                                       "whose spent epsilon stays within this bound",
                                       flag="--dp-max-epsilon")

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid option."""
        if self.max_grad_norm is None:
            raise ConfigError("privacy needs max_grad_norm (the per-example clipping bound C)")
        if self.delta is None:
            raise ConfigError("privacy needs delta (e.g. 1e-5, below 1/dataset size)")
        if self.epsilon is None and self.noise_multiplier is None:
            raise ConfigError("privacy needs a target epsilon or a noise_multiplier")
        if self.epsilon is not None and self.noise_multiplier is not None:
            raise ConfigError("privacy: give epsilon (noise found for it) or noise_multiplier, "
                              "not both")
        if self.accountant == "gdp":
            raise ConfigError("privacy accountant 'gdp' is not supported: its Gaussian (CLT) "
                              "approximation can underestimate epsilon (sigma 0.8, 47 steps at "
                              "q = 1/47: 1.06 by gdp, 2.27 by prv); use 'prv' or 'rdp'")
        if self.epsilon is not None and isinstance(self.epsilon, (int, float)) \
                and self.epsilon > MAX_EPSILON:
            # the guarantee is a factor of e**epsilon; Opacus's search for a noise multiplier
            # does not end for targets like 1e20
            raise ConfigError(f"privacy epsilon must be at most {MAX_EPSILON:g}, got "
                              f"{self.epsilon!r} (the guarantee, a factor of e**epsilon, says "
                              "nothing above that)")
        check_fields(self, label="privacy ")
