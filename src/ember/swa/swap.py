"""SWAP's averaging operations, Stochastic Weight Averaging in Parallel (Gupta, Akle Serrano &
DeCoste, ICLR 2020), on ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

This module owns SWAP's phase 3, which any training loop can call once its ranks have refined
their own copies: :func:`swap_average_` (one all-reduce replaces every rank's weights by the mean
over ranks) and :func:`average_bn_stats_` (the ranks' recomputed BatchNorm statistics averaged, so
all ranks end equal), with :func:`swap_world_size` checking the group. The procedures that train
(phase 1 with :func:`ember.train.fit`, phase 2's :func:`~ember.train.recipes.refine_locally`, and
:func:`~ember.train.recipes.swap_fit` running all three) live in :mod:`ember.train.recipes.swap`.
SWAP needs at least two processes: with one, the average is the model itself, so a world size of
1 is an error.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ember.swa._batches import unwrap_compiled

__all__ = ["average_bn_stats_", "swap_average_", "swap_world_size"]

# moved to ember.train.recipes.swap (they run training); the old names warn until ember 0.2
_MOVED = ("SWAPResult", "refine_and_average", "refine_locally", "swap_fit")


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
    :func:`ember.swa.update_bn` (as :func:`ember.train.recipes.swap_fit` does). Returns ``model``.
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
        stats = [t for t in (layer.running_mean, layer.running_var) if t is not None]
        flat = torch.cat([t.reshape(-1) for t in stats])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for t in stats:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
    return model


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        from ember.train.recipes import swap as _recipes_swap  # deprecation shim, see _MOVED

        warnings.warn(f"ember.swa.swap.{name} has moved to ember.train.recipes.swap.{name}; the "
                      "old path will be removed in ember 0.2", DeprecationWarning, stacklevel=2)
        return getattr(_recipes_swap, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    # the moved names stay discoverable (help(), completion); `from ... import *` skips them, since
    # star imports read __all__, which may not name them without importing ember.train
    return sorted(set(globals()) | set(_MOVED))
