"""Learning-rate schedules of the SWA phase: constant, annealed (torch's ``SWALR``), cyclical.

The linear cyclical schedule is the one of Izmailov et al. (2018), "Averaging Weights Leads to
Wider Optima and Better Generalization", eq. 2: within each cycle of ``cycle`` steps the rate falls
linearly from ``lr_max`` to ``lr_min``, and weights are collected at the end of each cycle (where
the rate is ``lr_min``). The cosine one falls along a half cosine within each cycle, as the
cycles of fast-SWA (Athiwaratkun et al., 2019).
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.swa_utils import SWALR

__all__ = ["SWALR", "CyclicSWALR", "cyclic_lr", "is_cycle_end"]


def _check_cycle(cycle: int) -> None:
    if isinstance(cycle, bool) or not isinstance(cycle, int) or cycle < 1:
        raise ValueError(f"cycle must be an integer >= 1, got {cycle!r}")


SHAPES = ("linear", "cosine")


def cyclic_lr(step: int, *, lr_max: float, lr_min: float, cycle: int,
              shape: str = "linear") -> float:
    """Rate at ``step`` (counted from 0) of the cyclical SWA schedule.

    With ``t = (step % cycle + 1) / cycle`` the rate is ``(1 - t) * lr_max + t * lr_min`` for
    ``shape="linear"`` and ``lr_min + (lr_max - lr_min) * (1 + cos(pi * t)) / 2`` for
    ``shape="cosine"``: the last step of each cycle uses ``lr_min`` (``lr_min`` for every step
    when ``cycle == 1``, a constant rate).
    """
    _check_cycle(cycle)
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if not lr_max >= lr_min >= 0:
        raise ValueError(f"need lr_max >= lr_min >= 0, got lr_max={lr_max}, lr_min={lr_min}")
    t = (step % cycle + 1) / cycle
    if shape == "cosine":
        return lr_min + (lr_max - lr_min) * (1.0 + math.cos(math.pi * t)) / 2.0
    return (1.0 - t) * lr_max + t * lr_min


def is_cycle_end(step: int, cycle: int) -> bool:
    """Whether ``step`` (from 0) is the last of a cycle: the point to collect SWA weights."""
    _check_cycle(cycle)
    return (step + 1) % cycle == 0


class CyclicSWALR(LRScheduler):
    """Sets every parameter group's rate to :func:`cyclic_lr` of the step count.

    Call :meth:`step` after every optimizer step. The rate before the first step is that of
    step 0; after ``n`` calls it is that of step ``n``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, lr_max: float, lr_min: float,
                 cycle: int, shape: str = "linear", last_epoch: int = -1) -> None:
        cyclic_lr(0, lr_max=lr_max, lr_min=lr_min, cycle=cycle, shape=shape)  # validates them
        self.lr_max, self.lr_min, self.cycle, self.shape = lr_max, lr_min, cycle, shape
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float | torch.Tensor]:
        lr = cyclic_lr(max(self.last_epoch, 0), lr_max=self.lr_max, lr_min=self.lr_min,
                       cycle=self.cycle, shape=self.shape)
        return [lr for _ in self.optimizer.param_groups]
