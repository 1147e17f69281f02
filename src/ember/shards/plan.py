"""Which shards each (rank, worker) reads in an epoch, and in what order: pure functions.

Everything here is a function of (seed, epoch, rank, world, worker, num_workers) and the shard
list, computed identically on every process; that is what makes shuffling reproducible and
resumption exact.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

__all__ = ["derive_seed", "make_generator", "shard_order", "worker_shards", "equal_quotas",
           "stream_index"]


def derive_seed(seed: int, *path: int | str) -> int:
    """A 63-bit seed derived from ``seed`` and a path of integers/strings (like JAX's fold_in)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((int(seed),) + tuple(path)).encode())
    return int.from_bytes(h.digest(), "little") >> 1


def make_generator(seed: int, generator: torch.Generator | None = None) -> torch.Generator:
    """A generator seeded with ``seed``: ``generator`` itself (re-seeded) if given, else a new one.

    Passing an ember.csprng generator makes every draw come from it.
    """
    g = generator if generator is not None else torch.Generator()
    g.manual_seed(seed)
    return g


def shard_order(num_shards: int, *, seed: int, epoch: int, shuffle: bool = True,
                generator: torch.Generator | None = None) -> list[int]:
    """The epoch's global order of shard indices (the same on every rank and worker)."""
    if not shuffle or num_shards <= 1:
        return list(range(num_shards))
    g = make_generator(derive_seed(seed, "shards", epoch), generator)
    return torch.randperm(num_shards, generator=g).tolist()


def stream_index(rank: int, world: int, worker: int, num_workers: int) -> int:
    """The position of (rank, worker) among the ``world * num_workers`` reading streams."""
    if not 0 <= rank < world:
        raise ValueError(f"expected 0 <= rank < world_size, got rank={rank}, world_size={world}")
    if not 0 <= worker < num_workers:
        raise ValueError(f"expected 0 <= worker < num_workers, got worker={worker}, "
                         f"num_workers={num_workers}")
    return worker * world + rank


def worker_shards(num_shards: int, *, seed: int, epoch: int, rank: int, world: int, worker: int,
                  num_workers: int, shuffle: bool = True,
                  generator: torch.Generator | None = None) -> list[int]:
    """The shard indices (in reading order) of one (rank, worker) stream in ``epoch``.

    Streams take every ``world * num_workers``-th shard of the epoch's order, so all streams
    together read each shard exactly once.
    """
    order = shard_order(num_shards, seed=seed, epoch=epoch, shuffle=shuffle, generator=generator)
    s = stream_index(rank, world, worker, num_workers)
    return order[s :: world * num_workers]


def equal_quotas(shard_sizes: Sequence[int], *, seed: int, epoch: int, world: int,
                 num_workers: int, mode: str, shuffle: bool = True,
                 generator: torch.Generator | None = None) -> list[int]:
    """Samples each worker slot yields per rank so that all ranks yield the same number.

    Returns one quota per worker index, identical on every rank, so every rank also produces the
    same number of per-worker batches. ``mode="drop"`` takes the smallest count over ranks for each
    worker slot (a few samples dropped), ``mode="repeat"`` the largest (a few samples repeated).
    """
    if mode not in ("drop", "repeat"):
        raise ValueError(f"expected equalize='drop' or 'repeat', got {mode!r}")
    n = len(shard_sizes)
    order = shard_order(n, seed=seed, epoch=epoch, shuffle=shuffle, generator=generator)
    quotas = []
    for w in range(num_workers):
        counts = []
        for r in range(world):
            s = stream_index(r, world, w, num_workers)
            counts.append(sum(shard_sizes[i] for i in order[s :: world * num_workers]))
        quotas.append(min(counts) if mode == "drop" else max(counts))
    return quotas
