"""Differentially private training (DP-SGD) for :func:`ember.train.fit`, through Opacus.

``fit(..., privacy=PrivacyConfig(epsilon=3.0, delta=1e-5, max_grad_norm=1.0))`` trains with
Opacus's ``PrivacyEngine(secure_mode=True)``: per-example gradients clipped to ``max_grad_norm``,
Gaussian noise and Poisson-sampled batches drawn from an ember.csprng generator keyed from the OS,
and the privacy budget tracked by Opacus's accountant. Opacus is imported only when used
(``pip install ember[dp]``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ember.train.errors import ConfigError

__all__ = ["PrivacyConfig", "PrivateTraining", "check_combination", "check_model", "make_private"]

ACCOUNTANTS = ("rdp", "prv", "gdp")


@dataclass
class PrivacyConfig:
    """What DP-SGD guarantee to train for.

    - ``max_grad_norm``: per-example clipping bound C (required).
    - ``epsilon``, ``delta``: the target budget; the noise multiplier is then found by Opacus
      (``get_noise_multiplier``) so that ``epochs`` epochs spend exactly it. Or give
      ``noise_multiplier`` directly (``delta`` is still needed to report epsilon).
    - ``accountant``: Opacus's accountant, ``"rdp"``, ``"prv"`` or ``"gdp"``.
    - ``replace_batchnorm``: replace BatchNorm layers by GroupNorm in place (Opacus's
      ``ModuleValidator.fix``; the existing affine parameters are kept, so the optimizer still
      holds them); otherwise a model with BatchNorm is refused.
    - ``noise_seed``: for tests only, key the noise and sampling generator from this seed (anyone
      who knows it can remove the noise: no privacy). None (default) keys it from the OS.
    """

    max_grad_norm: float | None = None
    epsilon: float | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    accountant: str = "rdp"
    replace_batchnorm: bool = False
    noise_seed: int | None = None

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid option."""
        def number(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if self.max_grad_norm is None:
            raise ConfigError("privacy needs max_grad_norm (the per-example clipping bound C)")
        if not number(self.max_grad_norm) or not self.max_grad_norm > 0:
            raise ConfigError(f"privacy max_grad_norm must be > 0, got {self.max_grad_norm!r}")
        if self.delta is None:
            raise ConfigError("privacy needs delta (e.g. 1e-5, below 1/dataset size)")
        if not number(self.delta) or not 0 < self.delta < 1:
            raise ConfigError(f"privacy delta must be in (0, 1), got {self.delta!r}")
        if self.epsilon is None and self.noise_multiplier is None:
            raise ConfigError("privacy needs a target epsilon or a noise_multiplier")
        if self.epsilon is not None and self.noise_multiplier is not None:
            raise ConfigError("privacy: give epsilon (noise found for it) or noise_multiplier, "
                              "not both")
        if self.epsilon is not None and (not number(self.epsilon) or not self.epsilon > 0):
            raise ConfigError(f"privacy epsilon must be > 0, got {self.epsilon!r}")
        if self.noise_multiplier is not None and (not number(self.noise_multiplier)
                                                  or not self.noise_multiplier > 0):
            raise ConfigError(f"privacy noise_multiplier must be > 0, got {self.noise_multiplier!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ConfigError(f"unknown privacy accountant {self.accountant!r}; expected one of "
                              f"{', '.join(ACCOUNTANTS)}")
        if self.noise_seed is not None and (isinstance(self.noise_seed, bool)
                                            or not isinstance(self.noise_seed, int)
                                            or self.noise_seed < 0):
            raise ConfigError(f"privacy noise_seed must be a non-negative int or None, "
                              f"got {self.noise_seed!r}")


def _opacus():
    try:
        import opacus
    except ImportError as e:  # pragma: no cover - opacus is in the dev extra
        raise ConfigError("privacy= needs Opacus: pip install 'ember[dp]'") from e
    return opacus


def check_model(model: nn.Module, *, replace_batchnorm: bool = False) -> nn.Module:
    """Make ``model`` acceptable to Opacus or raise :class:`ConfigError` naming the layer.

    With ``replace_batchnorm`` every BatchNorm is replaced in place by the GroupNorm Opacus's
    ``ModuleValidator.fix`` chooses, reusing the BatchNorm's weight and bias parameters.
    """
    _opacus()
    from opacus.validators import ModuleValidator

    bn = (nn.modules.batchnorm._BatchNorm,)
    if replace_batchnorm:
        for name, module in list(model.named_modules()):
            if isinstance(module, bn):
                fixed = ModuleValidator.fix(nn.Sequential(module))[0]
                if module.affine:
                    fixed.weight, fixed.bias = module.weight, module.bias
                parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
                setattr(parent, name.rpartition(".")[2], fixed)
    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        first = errors[0]
        hint = (" (set PrivacyConfig(replace_batchnorm=True) to use GroupNorm instead)"
                if "BatchNorm" in str(first) else "")
        raise ConfigError(f"the model cannot be trained with DP-SGD: {first}{hint}")
    return model


class PrivateTraining:
    """The Opacus objects of one private run: ``module`` (per-example gradients), ``optimizer``
    (clip + noise), ``loader`` (Poisson sampling), ``engine`` and the ember ``generator``."""

    def __init__(self, engine: Any, module: nn.Module, optimizer: Any, loader: Any,
                 generator: Any, config: PrivacyConfig, noise_multiplier: float,
                 sample_rate: float) -> None:
        self.engine, self.module, self.optimizer, self.loader = engine, module, optimizer, loader
        self.generator, self.config = generator, config
        self.noise_multiplier, self.sample_rate = noise_multiplier, sample_rate

    def epsilon(self) -> float:
        """The budget spent so far at the configured delta (Opacus's accountant)."""
        return float(self.engine.accountant.get_epsilon(self.config.delta))

    def state_dict(self) -> dict[str, Any]:
        """Accountant history and generator state (the generator state is secret: it holds the
        noise key)."""
        history = [[float(s), float(q), int(n)] for s, q, n in self.engine.accountant.history]
        return {"history": history, "generator": self.generator.get_state(),
                "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
                "accountant": self.config.accountant}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["accountant"] != self.config.accountant:
            raise ConfigError(f"checkpoint used the {state['accountant']!r} accountant, this run "
                              f"{self.config.accountant!r}")
        if state["noise_multiplier"] != self.noise_multiplier \
                or state["sample_rate"] != self.sample_rate:
            raise ConfigError("checkpoint was trained with another noise multiplier or sample rate "
                              f"({state['noise_multiplier']}, {state['sample_rate']}) than this run "
                              f"({self.noise_multiplier}, {self.sample_rate})")
        self.engine.accountant.history = [(s, q, int(n)) for s, q, n in state["history"]]
        self.generator.set_state(state["generator"])


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any,
                 config: PrivacyConfig, epochs: int) -> PrivateTraining:
    """Wrap model, optimizer and loader for DP-SGD with Opacus in secure mode on ember."""
    config.check()
    if not isinstance(loader, torch.utils.data.DataLoader) or \
            isinstance(loader.dataset, torch.utils.data.IterableDataset):
        raise ConfigError("privacy needs a torch.utils.data.DataLoader over a map-style dataset: "
                          f"Poisson sampling picks examples by index (got {type(loader).__name__})")
    check_model(model, replace_batchnorm=config.replace_batchnorm)
    _opacus()
    from opacus import PrivacyEngine
    from opacus.accountants.utils import get_noise_multiplier

    import ember.csprng as csprng

    csprng.provide_torchcsprng()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant=config.accountant, secure_mode=True)
    if config.noise_seed is not None:
        engine.secure_rng = csprng.create_generator(config.noise_seed)
    sample_rate = 1 / len(loader)
    sigma = config.noise_multiplier
    if sigma is None:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sigma = float(get_noise_multiplier(
                    target_epsilon=config.epsilon, target_delta=config.delta,
                    sample_rate=sample_rate, epochs=epochs, accountant=config.accountant))
            for w in caught:  # passed on only when a multiplier was found (else: the error)
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        except ValueError as exc:  # Opacus: "The privacy budget is too low."
            raise ConfigError(f"no noise multiplier reaches epsilon={config.epsilon} at "
                              f"delta={config.delta} over {epochs} epochs of sample rate "
                              f"{sample_rate:.3g} ({exc}); raise epsilon or lower the "
                              "epochs") from None
    module, dp_optimizer, dp_loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma,
        max_grad_norm=config.max_grad_norm, poisson_sampling=True)
    return PrivateTraining(engine, module, dp_optimizer, dp_loader, engine.secure_rng, config,
                           sigma, sample_rate)


def check_combination(config: Any, world: Any) -> None:
    """Refuse the :class:`~ember.train.TrainConfig` options DP-SGD through Opacus cannot honour."""
    if config.precision != "fp32":
        raise ConfigError(f"privacy supports precision='fp32' only, got {config.precision!r}")
    if config.accumulate != 1:
        raise ConfigError("privacy does not support accumulate > 1: Poisson-sampled batches are "
                          "the unit the accountant counts")
    if config.max_grad_norm is not None:
        raise ConfigError("with privacy, clipping is per example: set PrivacyConfig.max_grad_norm "
                          "and leave TrainConfig.max_grad_norm None")
    if config.checkpoint_every is not None:
        raise ConfigError("privacy checkpoints at epoch ends only (checkpoint_every is not "
                          "supported: the Poisson sampler cannot resume mid-epoch)")
    if world.distributed:
        raise ConfigError("privacy does not support several processes (DDP) yet")
