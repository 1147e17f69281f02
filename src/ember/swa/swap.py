"""SWAP, Stochastic Weight Averaging in Parallel (Gupta, Akle Serrano & DeCoste, ICLR 2020).

Three phases on ``torch.distributed`` (gloo on CPU, NCCL on GPUs):

1. large-batch synchronous data-parallel training (DDP: all ranks hold one model), for example
   with :func:`ember.train.fit` under ``torchrun``;
2. :func:`refine_locally`: every rank continues alone from that model with small batches and its
   own data order, with no gradient all-reduce, so the ranks' weights drift apart;
3. :func:`swap_average_`: one all-reduce replaces every rank's weights by the mean over ranks,
   then BatchNorm statistics are recomputed for the averaged weights on a bounded number of batches
   on every rank and averaged over the ranks (:func:`average_bn_stats_`), so all ranks end equal.

:func:`swap_fit` runs the three phases. SWAP needs at least two processes: with one, the average is
the model itself and the method is plain training, so a world size of 1 is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ember.swa._batches import unwrap_compiled
from ember.swa.bn import update_bn

__all__ = ["SWAPResult", "average_bn_stats_", "refine_and_average", "refine_locally",
           "swap_average_", "swap_fit", "swap_world_size"]


def swap_world_size(group: Any = None) -> int:
    """The number of processes SWAP averages over; raises if it is not at least 2.

    ``group`` is a ``torch.distributed`` process group (None: the default group).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "SWAP needs an initialised torch.distributed process group with at least 2 processes "
            "(run under torchrun --nproc_per_node=N with N >= 2); none is initialised")
    size = dist.get_world_size(group)
    if size < 2:
        raise RuntimeError(
            f"SWAP needs a world size of at least 2, got {size}: with one process the average is "
            "the model itself (use torchrun --nproc_per_node=N with N >= 2)")
    return size


def _averaged_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters and floating-point buffers (BatchNorm running mean/var) of ``model``."""
    tensors = [p.data for p in model.parameters()]
    tensors += [b for b in model.buffers() if b.is_floating_point()]
    return tensors


@torch.no_grad()
def swap_average_(model: nn.Module, *, group: Any = None) -> nn.Module:
    """Replace ``model``'s parameters and floating-point buffers by their mean over the ranks.

    Every rank must call this with the same architecture. Integer buffers (such as BatchNorm's
    ``num_batches_tracked``) are left alone; recompute BatchNorm statistics afterwards with
    :func:`ember.swa.update_bn` (as :func:`swap_fit` does). Returns ``model``.
    """
    size = swap_world_size(group)
    model = unwrap_compiled(model)
    tensors = _averaged_tensors(model)
    if not tensors:
        raise ValueError("swap_average_: the model has no parameters or floating-point buffers")
    # one flat buffer per dtype/device: one all-reduce each instead of one per tensor
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for members in groups.values():
        flat = torch.cat([t.reshape(-1) for t in members])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(size)
        offset = 0
        for t in members:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n
    return model


@torch.no_grad()
def average_bn_stats_(model: nn.Module, *, group: Any = None) -> nn.Module:
    """Average the BatchNorm running statistics that every rank computed on its own batches.

    After :func:`ember.swa.update_bn` on the same number of batches per rank, the mean over ranks
    of the running means and variances is exactly what ``update_bn`` gives on all ranks' batches
    together (an equal-weight average over batches), so every rank ends with the same
    statistics. Returns ``model``.
    """
    size = swap_world_size(group)
    from ember.swa.bn import _stat_modules

    for layer in _stat_modules(unwrap_compiled(model)):
        stats = [layer.running_mean] + ([layer.running_var] if layer.running_var is not None else [])
        flat = torch.cat([t.reshape(-1) for t in stats])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for t in stats:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
    return model


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
    :func:`swap_average_`, then :func:`ember.swa.update_bn` on at most ``bn_batches`` batches of
    ``bn_loader`` (default: ``small_batch_loader``) on every rank, averaged over ranks with
    :func:`average_bn_stats_`. The process group is left initialised.
    """
    from ember.train.loop import TrainConfig, fit

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
