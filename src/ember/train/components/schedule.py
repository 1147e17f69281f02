"""The learning rate: the user's scheduler before the SWA phase, SWALR or a cyclic SWA rate in
it."""

from __future__ import annotations

from typing import Any, Literal, cast

from torch.optim.lr_scheduler import LRScheduler

from ember.swa import SWALR, CyclicSWALR
from ember.train.components.base import Component, Run
from ember.train.config import SWAConfig, TrainConfig
from ember.train.errors import ConfigError

__all__ = ["RateSchedule", "lr_of"]


def lr_of(optimizer: Any) -> float:
    """The rate of the optimizer's first parameter group."""
    return float(optimizer.param_groups[0]["lr"])


def make_swalr(optimizer: Any, swa: SWAConfig) -> LRScheduler:
    """The SWA phase's rate schedule (SWALR per epoch, or CyclicSWALR per step) of a checked
    SWAConfig (its ``lr``, and for ``cyclic`` its ``lr_max`` and ``cycle``, are set)."""
    lr = cast(float, swa.lr)
    if swa.schedule == "cyclic":
        return CyclicSWALR(optimizer, lr_max=cast(float, swa.lr_max), lr_min=lr,
                           cycle=cast(int, swa.cycle), shape=swa.cycle_shape)
    if swa.schedule == "constant":  # a cycle of one step is the constant rate lr_min
        return CyclicSWALR(optimizer, lr_max=lr, lr_min=lr, cycle=1)
    return SWALR(optimizer, swa_lr=lr, anneal_epochs=swa.anneal_epochs,
                 anneal_strategy=cast(Literal["cos", "linear"], swa.anneal_strategy))


class RateSchedule(Component):
    """Steps the user's ``scheduler`` (per epoch or per step) outside the SWA phase and the SWA
    phase's own schedule in it; logs the rate each epoch trained with."""

    key = "schedule"

    def __init__(self, config: TrainConfig, scheduler: LRScheduler | None) -> None:
        self.swa, self.interval = config.swa, config.schedule.interval
        self.scheduler = scheduler
        self.swalr: LRScheduler | None = None

    def settings(self) -> dict[str, Any]:
        return {"scheduler_interval": self.interval}

    def _in_phase(self, epoch: int) -> bool:
        return self.swa is not None and epoch >= self.swa.start  # type: ignore[operator]

    def state_dict(self) -> dict[str, Any]:
        # some torch versions put SWALR's anneal function in its state_dict: a function, which
        # torch.load(weights_only=True) refuses; make_swalr sets it again from the config
        swalr = {k: v for k, v in self.swalr.state_dict().items() if k != "anneal_func"} \
            if self.swalr is not None else None
        return {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "swalr": swalr}

    def setup(self, run: Run) -> None:
        self.run = run  # its optimizer is read when needed: privacy replaces it in wrap

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """SWALR sets the rate when built: it is built here, before the loop loads the
        optimizer's state; the schedulers' states are loaded after it
        (:meth:`after_optimizer_restored`)."""
        if (state["scheduler"] is None) != (self.scheduler is None):
            raise ConfigError("checkpoint and this run disagree on whether an LR scheduler is "
                              "used")
        if state["swalr"] is not None:
            self.swalr = make_swalr(self.run.optimizer, self.swa)  # type: ignore[arg-type]
        self._restored = state

    def after_optimizer_restored(self) -> None:
        state = getattr(self, "_restored", None)
        if state is None:
            return
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.swalr is not None:
            self.swalr.load_state_dict(state["swalr"])

    def on_epoch_start(self, run: Run, epoch: int) -> None:
        if self._in_phase(epoch) and self.swalr is None:
            self.swalr = make_swalr(run.optimizer, self.swa)  # type: ignore[arg-type]
        p = run.progress
        # the rate this epoch trains with: schedulers step at its end (log it, not the next one;
        # kept in the checkpoint: a per-step schedule has moved on when a run resumes mid-epoch)
        if p.micro == 0 or p.epoch_lr is None:
            p.epoch_lr = lr_of(run.optimizer)

    def on_step_end(self, run: Run, record: dict[str, Any]) -> None:
        if self._in_phase(record["epoch"]):
            if self.swa.schedule == "cyclic":  # type: ignore[union-attr]
                self.swalr.step()  # type: ignore[union-attr]
        elif self.scheduler is not None and self.interval == "step":
            self.scheduler.step()

    def on_epoch_end(self, run: Run, record: dict[str, Any]) -> None:
        if self._in_phase(record["epoch"]):
            if self.swa.schedule == "anneal":  # type: ignore[union-attr]
                self.swalr.step()  # type: ignore[union-attr]
        elif self.scheduler is not None and self.interval == "epoch":
            self.scheduler.step()
        record["lr"] = run.progress.epoch_lr
