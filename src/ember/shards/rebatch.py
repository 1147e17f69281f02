"""Loader-level stages (``ShardLoader(...).unbatched().shuffle(n).batched(m)``): run in the main
process over the items of all workers, with their state (buffered items, the shuffle's random
state) taken at any point, so that a resumed loader continues exactly.

Each stage pulls from the one before it; after every item handed to the loop, each stage's state
is complete in itself, which is what ``state()`` returns and ``load()`` restores.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["unbatch", "LoaderStages"]

_END = object()


def unbatch(batch: Any) -> list:
    """The items of a batch: the elements of a list; for a collated batch (a tensor, a tuple or
    list of tensors/lists, a dict of them), the i-th row of every part."""
    if isinstance(batch, torch.Tensor):
        return list(batch.unbind(0))
    if isinstance(batch, Mapping):
        keys = list(batch)
        rows = [unbatch(batch[k]) for k in keys]
        _same_lengths(rows, batch)
        return [dict(zip(keys, parts, strict=True)) for parts in zip(*rows, strict=True)] if rows else []
    if isinstance(batch, tuple):
        rows = [unbatch(part) for part in batch]
        _same_lengths(rows, batch)
        return [tuple(parts) for parts in zip(*rows, strict=True)]
    if isinstance(batch, list):
        return list(batch)
    raise TypeError(f"unbatched() needs batches (lists, tensors, or tuples/dicts of them), got "
                    f"{type(batch).__name__}")


def _same_lengths(rows: list[list], batch: Any) -> None:
    if len({len(r) for r in rows}) > 1:
        raise ValueError(f"unbatched(): the parts of a batch have different lengths "
                         f"{[len(r) for r in rows]}")


class _Unbatch:
    def __init__(self):
        self.pending: deque = deque()

    def pull(self, src: Callable[[], Any]) -> Any:
        while not self.pending:
            batch = src()
            if batch is _END:
                return _END
            self.pending.extend(unbatch(batch))
        return self.pending.popleft()

    def state(self) -> Any:
        return list(self.pending)

    def load(self, state: Any) -> None:
        self.pending = deque(state)


class _Shuffle:
    def __init__(self, bufsize: int, seed: int):
        self.bufsize = bufsize
        self.buffer: list = []
        self.rng = random.Random(seed)
        self.ended = False

    def pull(self, src: Callable[[], Any]) -> Any:
        while not self.ended and len(self.buffer) < self.bufsize:
            item = src()
            if item is _END:
                self.ended = True
            else:
                self.buffer.append(item)
        if not self.buffer:
            return _END
        i = self.rng.randrange(len(self.buffer))
        self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
        return self.buffer.pop()

    def state(self) -> Any:
        return {"buffer": list(self.buffer), "rng": self.rng.getstate(), "ended": self.ended}

    def load(self, state: Any) -> None:
        self.buffer = list(state["buffer"])
        self.rng.setstate(state["rng"])
        self.ended = bool(state["ended"])


class _Batch:
    def __init__(self, size: int, collate: Callable | None, partial: bool):
        self.size, self.collate, self.partial = size, collate, partial

    def pull(self, src: Callable[[], Any]) -> Any:
        items: list = []
        while len(items) < self.size:
            item = src()
            if item is _END:
                break
            items.append(item)
        if not items or (len(items) < self.size and not self.partial):
            return _END
        return self.collate(items) if self.collate is not None else items

    def state(self) -> Any:
        return None

    def load(self, state: Any) -> None:
        pass


class LoaderStages:
    """One epoch of a list of loader-level stages (:class:`ember.shards.stages.Stage` objects
    with ``loader_level``) over an upstream iterator: each runs as its stage's ``runner``."""

    def __init__(self, stages: list, seed: int, epoch: int, generator: Any = None):
        self.stages = [stage.runner(seed, epoch, i, generator) for i, stage in enumerate(stages)]
    def state(self) -> list:
        return [s.state() for s in self.stages]

    def load(self, state: list) -> None:
        if len(state) != len(self.stages):
            raise ValueError(f"state has {len(state)} loader-level stages, this loader has "
                             f"{len(self.stages)}")
        for stage, st in zip(self.stages, state, strict=True):
            stage.load(st)

    def run(self, upstream: Iterator) -> Iterator:
        src: Callable[[], Any] = lambda: next(upstream, _END)
        for stage in self.stages:
            src = (lambda st, inner: lambda: st.pull(inner))(stage, src)
        while True:
            item = src()
            if item is _END:
                return
            yield item
