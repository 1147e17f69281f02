"""fast-SWA: several collections per cycle of a cyclical learning rate.

Athiwaratkun et al. (2019), "There Are Many Consistent Explanations of Unlabeled Data: Why You
Should Average" (ICLR): instead of one SWA collection at the end of each cycle (where the rate is
lowest), fast-SWA averages every ``every`` steps across each cycle (the reference code collects
over the whole cycle of a cosine-shaped cyclical rate), so that the average gathers many more,
more diverse, points for the same training budget.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ember.swa.averaging import SWA
from ember.swa.schedules import CyclicSWALR

__all__ = ["FastSWA", "FastSWASchedule"]


class FastSWASchedule:
    """Which steps of a cyclical schedule are collection points.

    Steps are counted from 0 at the start of the cyclical phase. Within each cycle of ``cycle``
    steps the collection points are the last step of the cycle and every ``every``-th step before
    it, as long as it lies in the collection window: position ``>= floor(start * cycle)``. The
    default ``start=0`` is the whole cycle, as in the reference code; ``start=0.5`` collects only
    in the late half. ``every == cycle`` (or ``start == 1``) gives one collection per cycle,
    classic cyclic SWA.
    """

    def __init__(self, cycle: int, every: int, *, start: float = 0.0) -> None:
        for name, value in (("cycle", cycle), ("every", every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if every > cycle:
            raise ValueError(f"every={every} is longer than the cycle ({cycle} steps): at most "
                             "one collection per cycle is cyclic SWA, pass every=cycle")
        if isinstance(start, bool) or not 0.0 <= start <= 1.0:
            raise ValueError(f"start must be a fraction of the cycle in [0, 1], got {start!r}")
        self.cycle, self.every, self.start = cycle, every, float(start)
        first = min(int(start * cycle), cycle - 1)
        last = cycle - 1
        self.positions = [p for p in range(first, cycle) if (last - p) % every == 0]

    def collect_at(self, step: int) -> bool:
        """Whether step ``step`` (from 0, after that optimizer step) is a collection point."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        return step % self.cycle in self.positions

    @property
    def per_cycle(self) -> int:
        """Collections per cycle."""
        return len(self.positions)


class FastSWA:
    """A cyclical rate on ``optimizer`` and an SWA of ``model`` collected fast-SWA style.

    Call :meth:`step` with the training model after every optimizer step: it adds the weights to
    :attr:`swa` at the collection points of :class:`FastSWASchedule` (window from ``start``) and
    moves the rate to the next step's value of :class:`~ember.swa.CyclicSWALR` (from ``lr_max``
    down to ``lr_min`` within each cycle, along a half cosine by default as the reference, or
    ``shape="linear"``). Recompute BatchNorm statistics of ``swa.module`` before use
    (:func:`ember.swa.update_bn`).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, lr_max: float,
                 lr_min: float, cycle: int, every: int, start: float = 0.0,
                 shape: str = "cosine",
                 device: torch.device | str | int | None = None) -> None:
        self.schedule = FastSWASchedule(cycle, every, start=start)
        self.scheduler = CyclicSWALR(optimizer, lr_max=lr_max, lr_min=lr_min, cycle=cycle,
                                     shape=shape)
        self.swa = SWA(model, device=device)
        self.steps = 0

    @torch.no_grad()
    def step(self, model: nn.Module) -> bool:
        """Account for one optimizer step just taken; returns whether the weights were collected."""
        collected = self.schedule.collect_at(self.steps)
        if collected:
            self.swa.update(model)
        self.steps += 1
        self.scheduler.step()
        return collected

    @property
    def module(self) -> nn.Module:
        """The averaged model."""
        return self.swa.module

    def state_dict(self) -> dict[str, Any]:
        """Steps taken, the rate scheduler's state and the average."""
        return {"steps": self.steps, "cycle": self.schedule.cycle, "every": self.schedule.every,
                "start": self.schedule.start, "scheduler": self.scheduler.state_dict(),
                "swa": self.swa.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (same cycle, every and start)."""
        for key in ("cycle", "every", "start"):
            mine = getattr(self.schedule, key)
            if state[key] != mine:
                raise ValueError(f"fast-SWA state dict has {key}={state[key]!r}, this one {mine!r}")
        self.scheduler.load_state_dict(state["scheduler"])
        self.swa.load_state_dict(state["swa"])
        self.steps = int(state["steps"])
