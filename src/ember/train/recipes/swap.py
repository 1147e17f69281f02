"""SWAP training, Stochastic Weight Averaging in Parallel (Gupta, Akle Serrano & DeCoste, ICLR 2020).

:func:`swap_fit` runs the three phases on every rank of a ``torch.distributed`` process group:
phase 1 is :func:`ember.train.fit` (large-batch data-parallel training), phase 2 is
:func:`refine_locally` (each rank trains alone with small batches and its own data order) and
phase 3 is :func:`ember.swa.swap_average_` with BatchNorm recomputed and averaged
(:func:`ember.swa.average_bn_stats_`). :func:`refine_and_average` is phases 2 and 3 after your own
phase 1. The averaging operations themselves live in :mod:`ember.swa.swap`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ember.swa._batches import unwrap_compiled
from ember.swa.bn import update_bn
from ember.swa.swap import average_bn_stats_, swap_average_, swap_world_size
from ember.train.loop import StopTraining, TrainConfig, fit

__all__ = ["SWAPResult", "refine_and_average", "refine_locally", "swap_fit"]


def _split(batch: Any, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"expected batches of (inputs, targets), got {type(batch).__name__}")
    x, y = batch
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


PHASE2_SCHEDULES = ("linear", "cosine", "constant")


def _phase2_rate(base: float, step: int, total: int, schedule: str) -> float:
    if schedule == "linear":
        return base * (1.0 - step / total)
    if schedule == "cosine":
        return base * (1.0 + math.cos(math.pi * step / total)) / 2.0
    return base


def refine_locally(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Iterable, *,
                   epochs: int = 1,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                   device: torch.device | str | None = None, lr: float | None = None,
                   schedule: str = "constant", fresh_optimizer: bool = False) -> list[float]:
    """SWAP's phase 2: train ``model`` on this rank alone, without any gradient all-reduce.

    ``model`` may be DDP-wrapped or compiled; the module inside is trained, so no rank waits for
    another. ``loader`` should give this rank its own data order (for example a shuffle seeded
    with the rank) with small batches of ``(inputs, targets)``. The rate starts at ``lr`` (default:
    each parameter group's current rate) and follows ``schedule`` per step over the phase:
    ``"linear"`` or ``"cosine"`` decay to 0 (``loader`` must have a length), or ``"constant"``.
    ``fresh_optimizer=True`` clears the optimizer's state (momentum buffers) first, so phase 2
    does not carry phase 1's large-batch momentum. Returns the mean training loss of every epoch.
    """
    total = _phase2_steps(loader, epochs, schedule, lr)
    module = unwrap_compiled(model)
    loss_fn = loss_fn or nn.functional.cross_entropy
    dev = torch.device(device) if device is not None else None
    if fresh_optimizer:
        optimizer.state.clear()
    bases = [lr if lr is not None else g["lr"] for g in optimizer.param_groups]
    losses = []
    step = 0
    module.train()
    for _ in range(epochs):
        total_loss, n = 0.0, 0
        for batch in loader:
            x, y = _split(batch, dev)
            if total is not None and step >= total:
                break  # a loader longer than its len(): the schedule has reached 0
            for g, base in zip(optimizer.param_groups, bases, strict=True):
                g["lr"] = base if total is None else _phase2_rate(base, step, total, schedule)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(module(x).float(), y)
            loss.backward()
            optimizer.step()
            total_loss += float(loss.detach())
            n += 1
            step += 1
        if n == 0:
            raise ValueError("refine_locally: the loader yielded no batches")
        losses.append(total_loss / n)
    return losses


def _phase2_steps(loader: Iterable, epochs: int, schedule: str, lr: float | None) -> int | None:
    """Check refine_locally's arguments; the steps its schedule decays over (None: constant)."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
    if schedule not in PHASE2_SCHEDULES:
        raise ValueError(f"schedule must be one of {PHASE2_SCHEDULES}, got {schedule!r}")
    if lr is not None and not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if schedule == "constant":
        return None
    try:
        return epochs * len(loader)  # type: ignore[arg-type]
    except TypeError as err:
        raise ValueError(f"schedule={schedule!r} needs a loader with a length (len(loader)); "
                         f"give the loader one or pass schedule='constant' ({err})") from None


def _phase1(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Iterable, config: Any,
            *, target_accuracy: float | None,
            loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
            eval_loader: Iterable | None = None, group: Any = None,
            on_epoch: Callable[[float], None] | None = None) -> tuple[Any, int]:
    """SWAP's phase 1: :func:`fit`, stopped at the end of the first epoch whose training accuracy
    (over the epoch's batches, summed over ranks) reaches ``target_accuracy``. Returns fit's
    result and the number of epochs run."""
    loss_fn = loss_fn or nn.functional.cross_entropy
    if target_accuracy is None:
        result = fit(model, optimizer, loader, config, loss_fn=loss_fn, eval_loader=eval_loader)
        return result, config.epochs
    if not hasattr(loader, "__len__"):
        raise ValueError("phase1_target_accuracy needs a large-batch loader with a length")
    steps_per_epoch = len(cast(Sized, loader)) // config.accumulate
    if steps_per_epoch < 1:
        raise ValueError("phase1_target_accuracy: the large-batch loader has fewer batches than "
                         "config.accumulate")
    counts = torch.zeros(2, dtype=torch.float64)  # correct, seen (this epoch, this rank)
    epochs = 0

    def counting_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            counts[0] += float((logits.argmax(-1) == y).sum())
            counts[1] += y.numel()
        return loss_fn(logits, y)

    def check(step: int, _record: dict) -> None:
        nonlocal epochs
        if step % steps_per_epoch:
            return
        epochs += 1
        total = counts.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total, group=group)  # every rank decides on the same numbers
        counts.zero_()
        accuracy = float(total[0] / total[1].clamp(min=1))
        if on_epoch is not None:
            on_epoch(accuracy)
        if accuracy >= target_accuracy:
            raise StopTraining

    result = fit(model, optimizer, loader, config, loss_fn=counting_loss, eval_loader=eval_loader,
                 on_step=check)
    return result, epochs


@dataclass
class SWAPResult:
    """What :func:`swap_fit` returns (the same on every rank, except ``phase2_losses``)."""

    model: nn.Module  # the averaged model, BatchNorm statistics recomputed
    phase1: Any  # ember.train.TrainResult of the large-batch phase
    phase2_losses: list[float]  # this rank's mean training loss per refinement epoch
    world_size: int
    bn_batches: int  # batches used to recompute BatchNorm (0: no such layers)
    phase1_epochs: int = 0  # epochs phase 1 ran (fewer than config.epochs when it hit the target)


def swap_fit(model: nn.Module, optimizer: torch.optim.Optimizer, large_batch_loader: Iterable,
             small_batch_loader: Iterable, config: Any = None, *, phase2_epochs: int = 1,
             phase2_lr: float | None = None, phase2_schedule: str = "linear",
             phase2_fresh_optimizer: bool = True, phase1_target_accuracy: float | None = None,
             bn_loader: Iterable | None = None, bn_batches: int | None = 50,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             eval_loader: Iterable | None = None, group: Any = None) -> SWAPResult:
    """Train ``model`` with SWAP on every rank of an initialised process group.

    Phase 1 is :func:`ember.train.fit` with ``config`` (an :class:`ember.train.TrainConfig`) on
    ``large_batch_loader`` (each rank its own share, same number of batches), for
    ``config.epochs`` or, with ``phase1_target_accuracy``, until the end of the first epoch whose
    training accuracy (summed over ranks) reaches it, as in the paper. Phase 2 is
    :func:`refine_locally` for ``phase2_epochs`` on ``small_batch_loader`` (this rank's own data
    order) with a fresh optimizer state (no phase-1 momentum; ``phase2_fresh_optimizer``) and the
    rate decaying from ``phase2_lr`` (default: the optimizer's rate) to 0 along
    ``phase2_schedule`` (``"linear"``, ``"cosine"`` or ``"constant"``). Phase 3 is
    :func:`ember.swa.swap_average_`, then :func:`ember.swa.update_bn` on at most ``bn_batches``
    batches of ``bn_loader`` (default: ``small_batch_loader``) on every rank, averaged over ranks
    with :func:`average_bn_stats_`. The process group is left initialised.
    """
    size = swap_world_size(group)  # before phase 1: fit would otherwise start (and end) a group
    config = config or TrainConfig()
    if getattr(config, "swa_start", None) is not None:
        raise ValueError("swap_fit: config.swa_start must be None (SWAP does its own averaging)")
    if phase2_lr is not None and not phase2_lr > 0:
        raise ValueError(f"phase2_lr must be > 0, got {phase2_lr!r}")
    if phase2_schedule not in PHASE2_SCHEDULES:
        raise ValueError(f"phase2_schedule must be one of {PHASE2_SCHEDULES}, got "
                         f"{phase2_schedule!r}")
    if phase1_target_accuracy is not None and not 0.0 < phase1_target_accuracy <= 1.0:
        raise ValueError(f"phase1_target_accuracy must be in (0, 1], got {phase1_target_accuracy!r}")
    phase1, epochs = _phase1(model, optimizer, large_batch_loader, config,
                             target_accuracy=phase1_target_accuracy, loss_fn=loss_fn,
                             eval_loader=eval_loader, group=group)
    losses, used = refine_and_average(model, optimizer, small_batch_loader,
                                      phase2_epochs=phase2_epochs, phase2_lr=phase2_lr,
                                      phase2_schedule=phase2_schedule,
                                      phase2_fresh_optimizer=phase2_fresh_optimizer,
                                      bn_loader=bn_loader, bn_batches=bn_batches, loss_fn=loss_fn,
                                      device=config.device, group=group)
    return SWAPResult(model=model, phase1=phase1, phase2_losses=losses, world_size=size,
                      bn_batches=used, phase1_epochs=epochs)


def refine_and_average(model: nn.Module, optimizer: torch.optim.Optimizer,
                       small_batch_loader: Iterable, *, phase2_epochs: int = 1,
                       phase2_lr: float | None = None, phase2_schedule: str = "linear",
                       phase2_fresh_optimizer: bool = True, bn_loader: Iterable | None = None,
                       bn_batches: int | None = 50,
                       loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                       device: torch.device | str | None = None,
                       group: Any = None) -> tuple[list[float], int]:
    """SWAP's phases 2 and 3 after a data-parallel phase 1 that left every rank the same model.

    Runs :func:`refine_locally` (``lr=phase2_lr``, ``schedule=phase2_schedule``,
    ``fresh_optimizer=phase2_fresh_optimizer``), averages with :func:`swap_average_`, recomputes
    BatchNorm on at most ``bn_batches`` batches of ``bn_loader`` (default ``small_batch_loader``)
    and averages the statistics over ranks (:func:`average_bn_stats_`). Returns this rank's
    phase-2 losses and the number of BatchNorm batches used.
    """
    swap_world_size(group)
    if phase2_lr is not None and not phase2_lr > 0:
        raise ValueError(f"phase2_lr must be > 0, got {phase2_lr!r}")
    losses = refine_locally(model, optimizer, small_batch_loader, epochs=phase2_epochs,
                            loss_fn=loss_fn, device=device, lr=phase2_lr,
                            schedule=phase2_schedule, fresh_optimizer=phase2_fresh_optimizer)
    swap_average_(model, group=group)
    used = update_bn(bn_loader if bn_loader is not None else small_batch_loader,
                     unwrap_compiled(model), device=device, max_batches=bn_batches)
    if used:
        average_bn_stats_(model, group=group)
    return losses, used
