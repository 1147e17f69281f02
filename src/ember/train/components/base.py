"""What every component of :func:`ember.train.fit` is, and the run state they share.

A component owns one concern end to end. The loop calls its hooks by name, in the order the
components were given (a component defines only the hooks it needs):

- ``setup(run)``: before training: check and prepare (the model may still change here);
- ``wrap(run)``: then: may replace ``run.net``, ``run.optimizer``, ``run.loader``;
- (on resume, after every ``wrap``, the checkpointing component loads each component's state)
- ``on_fit_start(run)``, ``on_epoch_start(run, epoch)``,
- ``on_batch_end(run)``: after each micro-batch's backward pass,
- ``on_step_end(run, record)``: after each optimizer step, ``record`` the step's record,
- ``on_epoch_end(run, record)``: ``record`` the epoch's record (components add to it),
- ``on_fit_end(run)``, ``close(run)`` (always, also after an error).

``state_dict()`` is saved in checkpoints under the component's ``key`` and given back to
``load_state_dict()`` on resume; ``settings()`` are what a resumed run must share with its
checkpoint (compared option by option).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ember.train.config import TrainConfig
from ember.train.distributed import World

__all__ = ["HOOKS", "Component", "Progress", "Run", "StopTraining", "call"]

HOOKS = ("setup", "wrap", "on_fit_start", "on_epoch_start", "on_batch_end", "on_step_end",
         "on_epoch_end", "on_fit_end", "close")


class StopTraining(Exception):  # noqa: N818 (a signal, not an error)
    """Raise from a callback's ``on_step_end`` (or ``fit``'s ``on_step``) to end training after
    that step: the epoch's bookkeeping (history, evaluation, checkpoint) runs, then ``fit``
    returns normally. Under DDP every rank must raise at the same step."""


class Component:
    """Base of ember.train's components: no hooks, no state, no settings."""

    key: str = ""  # where its state lives in a checkpoint ("" : it keeps none)

    def settings(self) -> dict[str, Any]:
        """Options a resumed run must share with the checkpoint it resumes."""
        return {}

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any) -> None:
        """Restore what :meth:`state_dict` returned."""


@dataclass
class Progress:
    """Where the run is; saved in checkpoints."""

    epoch: int = 0  # epochs completed
    swa_steps: int = 0  # optimizer steps taken in the SWA phase
    epoch_lr: float | None = None  # the rate at the start of the current epoch
    step: int = 0  # optimizer steps taken (skipped ones included)
    skipped_steps: int = 0  # fp16 steps skipped for non-finite gradients
    dropped_microbatches: int = 0  # left over at epoch ends when accumulating
    micro: int = 0  # micro-batches seen in the current epoch
    epoch_loss_sum: float = 0.0
    loss_batches: int = 0  # micro-batches of the current epoch with examples (Poisson: not all)
    empty_steps: int = 0  # optimizer steps whose (Poisson) batch held no example
    history: list[dict] = field(default_factory=list)


@dataclass
class Run:
    """What the components of one run share."""

    model: nn.Module
    net: nn.Module  # what the forward pass calls (DDP or Opacus wrapping of model)
    optimizer: torch.optim.Optimizer
    loader: Iterable
    config: TrainConfig
    world: World
    device: torch.device
    generator: Any  # this rank's ember.csprng substream
    progress: Progress = field(default_factory=Progress)
    stop: bool = False  # end after this step (StopTraining, budget stop)
    ddp: bool = True  # wrap the model in DDP under several processes (privacy sums its own)
    report: dict[str, Any] = field(default_factory=dict)  # end-of-run fields (the "end" record)
    resume_state: dict[str, Any] | None = None  # the checkpoint being resumed, during setup


def call(components: Iterable[Any], hook: str, *args: Any) -> None:
    """Call ``hook`` on every component that defines it, in order."""
    for c in components:
        method = getattr(c, hook, None)
        if method is not None:
            method(*args)


def close_all(components: Iterable[Any], run: Run) -> None:
    """Every component's ``close``, each even when another's raised (the first error wins)."""
    with contextlib.ExitStack() as stack:
        for c in components:
            method = getattr(c, "close", None)
            if method is not None:
                stack.callback(method, run)
