"""Weight averaging in the loop: SWA and SWAG collected in the SWA phase, EMA after every step,
all through ember.swa's averager protocol (``update(model, step=)``, ``state_dict``)."""

from __future__ import annotations

import warnings
from typing import Any

from ember.swa import EMA, SWA, SWAG, update_bn
from ember.swa.bn import has_running_stats
from ember.swa.fastswa import FastSWASchedule
from ember.swa.schedules import is_cycle_end
from ember.train.components.base import Component, Run
from ember.train.config import TrainConfig
from ember.train.distributed import broadcast_buffers_
from ember.train.errors import ConfigError

__all__ = ["Averaging"]


class Averaging(Component):
    """Owns ``swa``, ``swag`` and ``ema`` (each None when off) and when they are updated."""

    key = "averaging"

    def __init__(self, config: TrainConfig, bn_loader: Any = None) -> None:
        self.swa_config, self.swag_config, self.ema_config = config.swa, config.swag, config.ema
        self.bn_loader = bn_loader
        self.swa: SWA | None = None
        self.swag: SWAG | None = None
        self.ema: EMA | None = None
        swa = self.swa_config
        self.fast = FastSWASchedule(swa.cycle, swa.every_steps, start=swa.collect_start) \
            if swa is not None and swa.cycle is not None and swa.schedule == "cyclic" \
            and swa.every_steps is not None else None

    def in_phase(self, epoch: int) -> bool:
        """Whether ``epoch`` is in the SWA phase."""
        return self.swa_config is not None and epoch >= self.swa_config.start  # type: ignore[operator]

    def settings(self) -> dict[str, Any]:
        swa = self.swa_config
        swag = self.swag_config
        return {"swa_start": swa.start if swa else None,
                "swag_rank": swag.rank if swag else None,
                "swa_every_steps": swa.every_steps if swa else None,
                "swa_schedule": swa.schedule if swa else "anneal",
                "swa_cycle": swa.cycle if swa else None,
                "swag_diagonal": swag.diagonal if swag else False,
                "swag_params": list(swag.params) if swag and swag.params is not None else None,
                "swa_cycle_shape": swa.cycle_shape if swa else "linear",
                "swa_collect_start": swa.collect_start if swa else 0.0}

    def setup(self, run: Run) -> None:
        model = run.model
        if self.swa_config is not None:
            self.swa = SWA(model)
            if self.swag_config is not None:
                c = self.swag_config
                try:
                    self.swag = SWAG(model, max_rank=c.rank, diagonal=c.diagonal,
                                     params=c.params, device=c.device)
                except ValueError as err:
                    raise ConfigError(f"swag_params/swag_device: {err}") from err
        if self.ema_config is not None:
            warmup = self.ema_config.warmup
            self.ema = EMA(model, self.ema_config.decay, warmup=False if warmup == "off" else warmup)

    def averagers(self) -> dict[str, Any]:
        return {k: v for k, v in (("swa", self.swa), ("swag", self.swag), ("ema", self.ema))
                if v is not None}

    def state_dict(self) -> dict[str, Any]:
        return {k: v.state_dict() for k, v in self.averagers().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if ("ema" in state) != (self.ema is not None):
            raise ConfigError("checkpoint and this run disagree on whether an EMA is kept "
                              "(ema_decay)")
        for name, averager in self.averagers().items():
            if name in state:
                averager.load_state_dict(state[name])

    def _collect(self, run: Run) -> None:
        for averager in (self.swa, self.swag):
            if averager is not None:
                averager.update(run.model, step=run.progress.step)

    def on_step_end(self, run: Run, record: dict[str, Any]) -> None:
        p = run.progress
        if self.ema is not None:
            self.ema.update(run.model)
        if not self.in_phase(record["epoch"]):
            return
        s, p.swa_steps = p.swa_steps, p.swa_steps + 1  # this step's index in the phase, from 0
        swa = self.swa_config
        if swa.schedule == "cyclic":  # type: ignore[union-attr]
            due = self.fast.collect_at(s) if self.fast is not None \
                else is_cycle_end(s, swa.cycle)  # type: ignore[union-attr,arg-type]
        else:
            due = swa.every_steps is not None and p.swa_steps % swa.every_steps == 0  # type: ignore[union-attr]
        if due:
            self._collect(run)

    def on_epoch_end(self, run: Run, record: dict[str, Any]) -> None:
        swa = self.swa_config
        if swa is not None and self.in_phase(record["epoch"]) and swa.every_steps is None \
                and swa.schedule != "cyclic":
            self._collect(run)

    def on_fit_end(self, run: Run) -> None:
        # each rank's last forward updated its own BatchNorm statistics: agree on rank 0's
        for kept in (run.model, self.swa.module if self.swa is not None else None,
                     self.ema.module if self.ema is not None else None):
            if kept is not None:
                broadcast_buffers_(kept, run.world)
        if self.swa is None:
            return
        if self.bn_loader is not None:
            update_bn(self.bn_loader, self.swa.module, device=run.device,
                      max_batches=self.swa_config.bn_batches)  # type: ignore[union-attr]
            broadcast_buffers_(self.swa.module, run.world)
        elif has_running_stats(self.swa.module):
            warnings.warn(
                "fit returns an SWA model whose BatchNorm running statistics are those of the last "
                "training weights, not of the averaged ones (stale); pass bn_loader= to fit, or "
                "call ember.swa.update_bn(loader, result.swa.module) before using it",
                UserWarning, stacklevel=2)
