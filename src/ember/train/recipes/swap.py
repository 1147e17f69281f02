"""SWAP training, Stochastic Weight Averaging in Parallel (Gupta, Akle Serrano & DeCoste, ICLR 2020).

:func:`swap_fit` runs the three phases on every rank of a ``torch.distributed`` process group:
phase 1 is :func:`ember.train.fit` (large-batch data-parallel training), phase 2 is
:func:`refine_locally` (each rank trains alone with small batches and its own data order) and
phase 3 is :func:`ember.swa.swap_average_` with BatchNorm recomputed and averaged
(:func:`ember.swa.average_bn_stats_`). :func:`refine_and_average` is phases 2 and 3 after your own
phase 1. The averaging operations themselves live in :mod:`ember.swa.swap`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ember.swa._batches import unwrap_compiled
from ember.swa.bn import update_bn
from ember.swa.swap import average_bn_stats_, swap_average_, swap_world_size
from ember.train.loop import TrainConfig, fit

__all__ = ["SWAPResult", "refine_and_average", "refine_locally", "swap_fit"]


def _split(batch: Any, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"expected batches of (inputs, targets), got {type(batch).__name__}")
    x, y = batch
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


def refine_locally(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Iterable, *,
                   epochs: int = 1,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                   device: torch.device | str | None = None) -> list[float]:
    """SWAP's phase 2: train ``model`` on this rank alone, without any gradient all-reduce.

    ``model`` may be DDP-wrapped or compiled; the module inside is trained, so no rank waits for
    another. ``loader`` should give this rank its own data order (for example a shuffle seeded
    with the rank) with small batches of ``(inputs, targets)``. Returns the mean training loss of
    every epoch.
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
    module = unwrap_compiled(model)
    loss_fn = loss_fn or nn.functional.cross_entropy
    dev = torch.device(device) if device is not None else None
    losses = []
    module.train()
    for _ in range(epochs):
        total, n = 0.0, 0
        for batch in loader:
            x, y = _split(batch, dev)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(module(x).float(), y)
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
            n += 1
        if n == 0:
            raise ValueError("refine_locally: the loader yielded no batches")
        losses.append(total / n)
    return losses


@dataclass
class SWAPResult:
    """What :func:`swap_fit` returns (the same on every rank, except ``phase2_losses``)."""

    model: nn.Module  # the averaged model, BatchNorm statistics recomputed
    phase1: Any  # ember.train.TrainResult of the large-batch phase
    phase2_losses: list[float]  # this rank's mean training loss per refinement epoch
    world_size: int
    bn_batches: int  # batches used to recompute BatchNorm (0: no such layers)


def swap_fit(model: nn.Module, optimizer: torch.optim.Optimizer, large_batch_loader: Iterable,
             small_batch_loader: Iterable, config: Any = None, *, phase2_epochs: int = 1,
             phase2_lr: float | None = None, bn_loader: Iterable | None = None,
             bn_batches: int | None = 50,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             eval_loader: Iterable | None = None, group: Any = None) -> SWAPResult:
    """Train ``model`` with SWAP on every rank of an initialised process group.

    Phase 1 is :func:`ember.train.fit` with ``config`` (an :class:`ember.train.TrainConfig`) on
    ``large_batch_loader`` (each rank its own share, same number of batches). Phase 2 is
    :func:`refine_locally` for ``phase2_epochs`` on ``small_batch_loader`` (this rank's own data
    order), with the optimizer's learning rate set to ``phase2_lr`` when given. Phase 3 is
    :func:`ember.swa.swap_average_`, then :func:`ember.swa.update_bn` on at most ``bn_batches`` batches of
    ``bn_loader`` (default: ``small_batch_loader``) on every rank, averaged over ranks with
    :func:`average_bn_stats_`. The process group is left initialised.
    """
    size = swap_world_size(group)  # before phase 1: fit would otherwise start (and end) a group
    config = config or TrainConfig()
    if getattr(config, "swa_start", None) is not None:
        raise ValueError("swap_fit: config.swa_start must be None (SWAP does its own averaging)")
    if phase2_lr is not None and not phase2_lr > 0:
        raise ValueError(f"phase2_lr must be > 0, got {phase2_lr!r}")
    phase1 = fit(model, optimizer, large_batch_loader, config, loss_fn=loss_fn,
                 eval_loader=eval_loader)
    losses, used = refine_and_average(model, optimizer, small_batch_loader,
                                      phase2_epochs=phase2_epochs, phase2_lr=phase2_lr,
                                      bn_loader=bn_loader, bn_batches=bn_batches, loss_fn=loss_fn,
                                      device=config.device, group=group)
    return SWAPResult(model=model, phase1=phase1, phase2_losses=losses, world_size=size,
                      bn_batches=used)


def refine_and_average(model: nn.Module, optimizer: torch.optim.Optimizer,
                       small_batch_loader: Iterable, *, phase2_epochs: int = 1,
                       phase2_lr: float | None = None, bn_loader: Iterable | None = None,
                       bn_batches: int | None = 50,
                       loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                       device: torch.device | str | None = None,
                       group: Any = None) -> tuple[list[float], int]:
    """SWAP's phases 2 and 3 after a data-parallel phase 1 that left every rank the same model.

    Sets the optimizer's learning rate to ``phase2_lr`` (when given), runs
    :func:`refine_locally`, averages with :func:`swap_average_`, recomputes BatchNorm on at most
    ``bn_batches`` batches of ``bn_loader`` (default ``small_batch_loader``) and averages the
    statistics over ranks (:func:`average_bn_stats_`). Returns this rank's phase-2 losses and the
    number of BatchNorm batches used.
    """
    swap_world_size(group)
    if phase2_lr is not None and not phase2_lr > 0:
        raise ValueError(f"phase2_lr must be > 0, got {phase2_lr!r}")
    if phase2_lr is not None:
        for g in optimizer.param_groups:
            g["lr"] = phase2_lr
    losses = refine_locally(model, optimizer, small_batch_loader, epochs=phase2_epochs,
                            loss_fn=loss_fn, device=device)
    swap_average_(model, group=group)
    used = update_bn(bn_loader if bn_loader is not None else small_batch_loader,
                     unwrap_compiled(model), device=device, max_batches=bn_batches)
    if used:
        average_bn_stats_(model, group=group)
    return losses, used
