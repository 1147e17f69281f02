"""Which shards each (rank, worker) reads in an epoch, and in what order: pure functions.

Everything here is a function of (seed, epoch, rank, world, worker, num_workers) and the shard
list, computed identically on every process; that is what makes shuffling reproducible and
resumption exact.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["derive_seed", "make_generator", "draw_generator", "own_stream", "shard_order",
           "worker_shards", "equal_quotas", "stream_index"]


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


def has_substreams(generator: Any) -> bool:
    """Whether ``generator`` derives independent substreams (``fold_in``, as ember.csprng's)."""
    return generator is not None and callable(getattr(generator, "fold_in", None))


def own_stream(generator: Any) -> Any:
    """What a pipeline draws from, given ``generator=``: for a generator with substreams
    (``fold_in``, as ember.csprng's), a seeded generator of its type whose seed is drawn from
    one of its substreams, so that every process of a run (DataLoader workers, forked or spawned)
    derives the same draws from it, the generator given is neither copied, pickled nor advanced,
    and its key is in no copy; any other generator (a torch.Generator, or None) as it is."""
    if not has_substreams(generator):
        return generator
    try:
        sub = generator.fold_in(derive_seed(0, "ember.shards"))
    except NotImplementedError:  # a kind without substreams (torchcsprng-compatible)
        return generator
    words = torch.randint(0, 1 << 32, (4,), generator=sub, dtype=torch.int64).tolist()
    pinned = type(generator)()
    pinned.manual_seed(sum(w << (32 * i) for i, w in enumerate(words)))
    return pinned


def draw_generator(seed: int, generator: Any, *path: int | str) -> torch.Generator:
    """The generator of draw stream ``path`` (shard order, a shuffle stage, ...): substream
    ``path`` of ``generator`` where it has substreams (``seed`` is then not used), else a
    generator of ``generator``'s type (a copy; a torch.Generator if None) seeded from
    ``(seed, *path)``."""
    if has_substreams(generator):
        try:
            return generator.fold_in(derive_seed(0, *path))
        except NotImplementedError:
            pass
    return make_generator(derive_seed(seed, *path),
                          copy.deepcopy(generator) if generator is not None else None)


def shard_order(num_shards: int, *, seed: int, epoch: int, shuffle: bool = True,
                generator: torch.Generator | None = None) -> list[int]:
    """The epoch's global order of shard indices (the same on every rank and worker)."""
    if not shuffle or num_shards <= 1:
        return list(range(num_shards))
    g = draw_generator(seed, generator, "shards", epoch)
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
