"""DP-SGD in the loop: the model checked for it, Opacus's wrapping, Poisson batches, the
accountant, and the budget stop (``max_epsilon``), on :mod:`ember.train.privacy`'s pieces."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from ember.train.components.base import Component, Run
from ember.train.components.stepping import Stepping
from ember.train.distributed import all_gather_objects
from ember.train.errors import ConfigError
from ember.train.privacy import PrivacyConfig

__all__ = ["Privacy"]


class _PoissonBatching:
    """Which physical batch closes a logical step, and what happens between (Opacus clips and
    adds up; no noise, no step)."""

    def __init__(self, private: Any) -> None:
        self.private = private

    def closes_step(self, run: Run) -> bool:
        return self.private.closes_step()

    def context(self, run: Run, closes: bool) -> contextlib.AbstractContextManager:
        return self.private.quiet_hooks()

    def between_steps(self, run: Run) -> None:
        self.private.accumulate()


class Privacy(Component):
    """Owns a private run: its checks, Opacus's module/optimizer/loader, the noise generator and
    the accountant (saved in checkpoints, composed on resume, never restarted)."""

    key = "privacy"

    def __init__(self, config: PrivacyConfig, epochs: int, stepping: Stepping) -> None:
        self.config, self.epochs, self.stepping = config, epochs, stepping
        self.private: Any = None

    def setup(self, run: Run) -> None:
        from ember.train.privacy import check_combination, check_loader, check_model

        self.config.check()
        check_combination(run.config, run.world)
        check_loader(run.loader, run.world)  # before check_model may replace BatchNorm layers
        check_model(run.model, replace_batchnorm=self.config.replace_batchnorm)
        run.ddp = False  # the DP optimizer sums the clipped gradients over ranks itself
        if run.world.distributed:  # as DDP does: every rank (and its copies) starts at rank 0's
            for t in [*run.model.parameters(), *run.model.buffers()]:
                torch.distributed.broadcast(t.data, src=0)

    def wrap(self, run: Run) -> None:
        """After the averagers copied the model, so that their copies carry no Opacus hooks."""
        from ember.train.privacy import make_private

        saved = (run.resume_state or {}).get(self.key)
        # a resumed run keeps its noise multiplier: more epochs compose with the steps taken
        sigma = saved["noise_multiplier"] if saved is not None else None
        self.private = make_private(run.model, run.optimizer, run.loader, self.config,
                                    self.epochs, run.world, noise_multiplier=sigma)
        run.net, run.optimizer, run.loader = (self.private.module, self.private.optimizer,
                                              self.private.loader)
        self.stepping.batching = _PoissonBatching(self.private)
        if saved is not None and self.config.epsilon is not None:
            planned = self.epochs * self.private.steps_per_epoch
            spent = self._epsilon_after(planned)
            if self.config.max_epsilon is not None:  # the budget stop ends it sooner
                spent = min(spent, self.config.max_epsilon)
            if spent > self.config.epsilon * (1 + 1e-9):
                warnings.warn(f"continuing the private run to {self.epochs} epochs spends "
                              f"{'up to ' if self.config.max_epsilon is not None else ''}"
                              f"epsilon {spent:.4g} in all (delta {self.config.delta:g}), above "
                              f"the epsilon={self.config.epsilon:g} its noise was chosen for: the "
                              "accountant composes every step taken", UserWarning, stacklevel=2)

    def state_dict(self) -> Any:
        return self.private.state_dict(self._generator_states)

    def before_save(self, run: Run) -> None:
        """Every rank's noise generator state (a collective: every rank calls it)."""
        self._generator_states = all_gather_objects(self.private.generator.get_state(), run.world)

    def load_state_dict(self, state: Any) -> None:
        if state is None:
            raise ConfigError("the checkpoint was written without privacy; resume it without")
        self.private.load_state_dict(state)

    def on_fit_start(self, run: Run) -> None:
        self.private.watch_buffers()  # after resuming: a training step must not change a buffer
        # a resumed run whose next step would pass the bound has nothing left to do
        if self.private.steps > 0 and self._exceeds_after(self.private.steps + 1):
            self.private.stopped = True
        if self.private.stopped:
            run.stop = True  # a budget-stopped run resumes to its end at once
            return
        if self.private.steps == 0 and self._exceeds_after(1):
            raise ConfigError(
                f"privacy max_epsilon={self.config.max_epsilon:g} is below the epsilon of one "
                f"step ({self._epsilon_after(1):.4g} at delta={self.config.delta:g}): no step "
                "can be taken; raise max_epsilon or the noise")

    def _epsilon_after(self, steps: int) -> float:
        probe = type(self.private.accountant)()
        probe.history = [(self.private.noise_multiplier, self.private.sample_rate, steps)]
        return float(probe.get_epsilon(self.config.delta))

    def _exceeds_after(self, steps: int) -> bool:
        return self.config.max_epsilon is not None \
            and self._epsilon_after(steps) > self.config.max_epsilon

    def on_batch_end(self, run: Run) -> None:
        self.private.check_buffers()

    def on_step_end(self, run: Run, record: dict[str, Any]) -> None:
        if self._exceeds_after(self.private.steps + 1):
            self.private.stopped = True  # the budget stop: this was the last step under it
            run.stop = True

    def on_epoch_end(self, run: Run, record: dict[str, Any]) -> None:
        self.private.epoch_done()
        record["nonempty_batches"] = run.progress.loss_batches
        record.update(self.private.epoch_record())

    def on_fit_end(self, run: Run) -> None:
        run.report["privacy"] = self.private.report()

    def close(self, run: Run) -> None:
        if self.private is not None:
            self.private.close()
