"""torch.distributed for the training loop: start from torchrun's environment, wrap in DDP, and
derive a per-rank ember.csprng substream.

Launch with ``torchrun --nproc_per_node=2 ...`` (or any launcher setting ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``). On CPU the backend is gloo.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["World", "all_gather_objects", "average_", "init_from_env", "shutdown", "wrap_model"]


@dataclass(frozen=True)
class World:
    """This process's place among the training processes."""

    rank: int = 0
    size: int = 1
    started_here: bool = False  # whether init_from_env created the process group

    @property
    def is_main(self) -> bool:
        """Rank 0 writes checkpoints, logs and plots."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> World:
    """Join the process group described by the environment (torchrun), if there is one.

    Uses the existing group when torch.distributed is already initialised; with ``WORLD_SIZE``
    unset or 1 the run is single-process.
    """
    import datetime

    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), False)
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=timeout_s))
    return World(dist.get_rank(), dist.get_world_size(), True)


def shutdown(world: World) -> None:
    """Destroy the process group if :func:`init_from_env` created it."""
    if world.started_here and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, world: World) -> nn.Module:
    """The model wrapped in DistributedDataParallel when several processes train, else itself."""
    if not world.distributed:
        return model
    return nn.parallel.DistributedDataParallel(model)


def all_gather_objects(obj: Any, world: World) -> list[Any]:
    """``obj`` from every rank, in rank order (just ``[obj]`` for a single process)."""
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def broadcast_buffers_(module: nn.Module, world: World, src: int = 0) -> nn.Module:
    """Copy every buffer of ``module`` (BatchNorm statistics, counters) from rank ``src`` (in place).

    DDP broadcasts rank 0's buffers before each forward, but every rank then updates them from
    its own batch, so after the last step they differ; this makes the ranks agree on rank 0's,
    which is what DDP would use next.
    """
    if world.distributed:
        for buf in module.buffers():
            dist.broadcast(buf.data, src=src)
    return module


def average_(tensor: torch.Tensor, world: World) -> torch.Tensor:
    """Replace ``tensor`` by its mean over ranks (in place)."""
    if world.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor.div_(world.size)
    return tensor
