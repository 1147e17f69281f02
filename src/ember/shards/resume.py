"""Where an iteration stands, and how to get back there: the shard state's version, the epoch
cell shared with DataLoader workers (:class:`_EpochCell`), a direct iteration's position
(:class:`_Position`), and the index-based seek that resumes a stream mid-epoch without reading
what it already delivered (:class:`_Delivered`, :class:`_IndexedLayout`, :class:`_SkippingReader`
and the placeholders, :class:`_Skipped`, that stand for delivered samples in the stages).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from ember.shards.errors import ShardError
from ember.shards.index import index_mismatch, index_path, read_index
from ember.shards.reading import _ErrorPolicy, _shard_from, iter_shard
from ember.shards.urls import UrlOptions, local_path

STATE_VERSION = 1  # of the state dicts of ShardDataset and ShardLoader
_MAX_WORKERS = 4096  # reading workers per process that the shared epoch cell can tell apart


class _Position:
    """Where a direct iteration stands: items delivered so far, and the policy that counts its
    errors. Updated for every item, so it is a slotted object: its stores stay fast however the
    dataset's own attributes are laid out (copies and unpickled workers lose CPython's compact
    layout)."""

    __slots__ = ("consumed", "policy")

    def __init__(self, consumed: int, policy: _ErrorPolicy):
        self.consumed = consumed
        self.policy = policy


class _EpochCell:
    """The epoch counter of a ShardDataset, in memory shared with its DataLoader workers (made
    before they start; inherited by fork and by spawn), so that ``set_epoch`` reaches persistent
    workers and every new iteration, in any process, uses the next epoch.

    A *generation* is one DataLoader iteration (its workers share a base seed, ``info.seed -
    info.id``) or one direct iteration. The first reading worker of a new generation moves the
    epoch on (to the epoch set by set_epoch, if any, else the previous one plus one); the other
    workers of that generation join it. A generation is recognised as new when its key differs
    from the last one or when the worker already joined the last one (persistent workers keep
    their base seed)."""

    def __init__(self, pending: int = -1, current: int = -1):
        # a spawn-context lock can also be inherited by forked workers (not the other way round)
        self._lock = multiprocessing.get_context("spawn").Lock()
        self._cells = multiprocessing.RawArray("q", 3 + _MAX_WORKERS // 64)
        self._cells[0], self._cells[1], self._cells[2] = pending, current, -1

    def snapshot(self) -> tuple[int, int]:
        return self._cells[0], self._cells[1]

    def set_next(self, epoch: int) -> None:
        with self._lock:
            self._cells[0] = epoch

    def next_epoch(self) -> int:
        pending, current = self.snapshot()
        return pending if pending >= 0 else current + 1

    def begin(self, key: int, worker: int) -> int:
        """The epoch of reading worker ``worker`` in generation ``key`` (starting it if new)."""
        if not 0 <= worker < _MAX_WORKERS:
            raise ValueError(f"ShardDataset supports up to {_MAX_WORKERS} DataLoader workers")
        c = self._cells
        word, bit = 3 + worker // 64, 1 << (worker % 64)
        if bit >= 1 << 63:
            bit -= 1 << 64  # the sign bit of a signed 64-bit cell
        with self._lock:
            if c[2] != key or c[word] & bit:
                c[1] = c[0] if c[0] >= 0 else c[1] + 1
                c[0] = -1
                c[2] = key
                for i in range(3, len(c)):
                    c[i] = 0
            c[word] |= bit
            return c[1]


_END = object()  # next(items, _END): the end of a stream


# ---- resuming through indexes ---------------------------------------------------------------
#
# A resumed stream must yield exactly what the uninterrupted one would have yielded after its
# first `skip` items. Those items were made of samples at some positions of the stream; the
# positions (not the contents) follow from the shuffle draws and the shards' sample counts. So a
# first pass runs the stages over numbered placeholders (_Skipped) to find the delivered
# positions, and the real pass reads only the others, putting placeholders in the delivered
# positions so that shuffle buffers and batches line up with the uninterrupted run.


class _Skipped:
    """Stands for an item made of samples already delivered before the resume: the stream
    positions of those samples. It goes through shuffles and batches but is never decoded."""

    __slots__ = ("positions",)

    def __init__(self, positions: tuple[int, ...]):
        self.positions = positions


class _NoIndex(Exception):
    """A shard of the delivered part has no usable index: read and discard instead."""


class _Delivered:
    """The set of delivered stream positions: all those below ``low``, and those in ``rest``."""

    def __init__(self):
        self.low = 0
        self.rest: set[int] = set()
        self.end = 0  # one past the last delivered position

    def add(self, positions: tuple[int, ...]) -> None:
        self.rest.update(positions)
        self.end = max(self.end, max(positions, default=-1) + 1)
        while self.low in self.rest:
            self.rest.remove(self.low)
            self.low += 1

    def __contains__(self, k: int) -> bool:
        return k < self.low or k in self.rest

    def first_missing(self, a: int, b: int) -> int:
        """The first position in [a, b) not delivered, or b."""
        t = max(a, self.low)
        while t < b and t in self.rest:
            t += 1
        return min(t, b)


def _around_skipped(src: Iterator, stage: Callable[[Iterator], Iterator]) -> Iterator:
    """Apply the one-in, one-out ``stage`` to the real items of ``src``; placeholders go around
    it, in order."""
    box: list = []

    def feed() -> Iterator:
        while True:
            yield box.pop()

    out = stage(feed())
    for item in src:
        if isinstance(item, _Skipped):
            yield item
        else:
            box.append(item)
            yield next(out)


def _collate_unless_skipped(collate: Callable | None) -> Callable:
    """A collation function that turns a batch of placeholders into one placeholder."""

    def fn(batch: list) -> Any:
        skipped = [b for b in batch if isinstance(b, _Skipped)]
        if not skipped:
            return collate(batch) if collate is not None else batch
        if len(skipped) != len(batch):
            raise RuntimeError("index-based resume mixed delivered and new samples in a batch "
                               "(a bug in ember)")
        return _Skipped(tuple(k for b in skipped for k in b.positions))

    return fn


def _seekable_index(url: str, options: UrlOptions) -> dict:
    """The index of a local uncompressed shard, if it has a current one; else raises _NoIndex."""
    path = local_path(url)
    if path is None:
        raise _NoIndex  # remote shards: nothing to seek in, and their indexes cannot be checked
    try:
        index = read_index(url, options)  # None (with a warning) when stale
    except (ShardError, ValueError) as exc:
        warnings.warn(f"ignoring the index of {url}: {exc}")
        raise _NoIndex from None
    if index is None:
        raise _NoIndex
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
    except OSError:
        raise _NoIndex from None
    if magic == b"\x1f\x8b":
        raise _NoIndex  # gzip: index offsets are in the uncompressed stream
    return index


class _IndexedLayout:
    """``samples(urls)`` yields one numbered placeholder per sample of each shard, counted from
    the indexes, and records where each shard's samples fall in the stream."""

    def __init__(self, options: UrlOptions):
        self.options = options
        self.indexes: dict[str, dict] = {}
        self.visits: list[tuple[str, int, int]] = []  # (url, first position, sample count)
        self.end = 0

    def samples(self, urls: list[str]) -> Iterator[_Skipped]:
        for url in urls:
            if url not in self.indexes:
                self.indexes[url] = _seekable_index(url, self.options)
            k, n = self.end, len(self.indexes[url]["samples"])
            self.visits.append((url, k, n))
            self.end = k + n
            for j in range(k, k + n):
                yield _Skipped((j,))

    def mismatch(self, delivered: _Delivered) -> str | None:
        """Why an index relied on does not match its shard, or None. Checked: the last sample of
        every shard with delivered samples (its count is relied on) and the first undelivered
        sample of a partly delivered shard (where reading starts)."""
        spots: dict[str, set[int]] = {}
        for url, k, n in self.visits:
            if k >= delivered.end or n == 0:
                continue
            first = delivered.first_missing(k, k + n) - k
            spots.setdefault(url, set()).update({n - 1, first} if 0 < first < n else {n - 1})
        for url, js in spots.items():
            reason = index_mismatch(url, self.indexes[url], sorted(js))
            if reason is not None:
                return f"index {index_path(url)} does not match shard {url}: {reason}"
        return None


class _SkippingReader:
    """``samples(urls)`` for a resumed stream: placeholders in the delivered positions (a shard
    with only delivered samples is not opened; one partly delivered is entered at its first
    undelivered sample through its index), the shards' samples everywhere else."""

    def __init__(self, layout: _IndexedLayout, delivered: _Delivered, options: UrlOptions,
                 policy: _ErrorPolicy):
        self.layout = layout
        self.delivered = delivered
        self.options = options
        self.policy = policy
        self.pos = 0

    def samples(self, urls: list[str]) -> Iterator:
        for url in urls:
            k = self.pos
            if k >= self.delivered.end:  # past everything delivered: read as usual
                try:
                    yield from iter_shard(url, self.options)
                except ShardError as exc:
                    self.policy(exc)
                continue
            spans = self.layout.indexes[url]["samples"]
            self.pos = k + len(spans)
            yield from self._partly_delivered(url, spans, k)

    def _partly_delivered(self, url: str, spans: list, k: int) -> Iterator:
        d, n = self.delivered, len(spans)
        first = d.first_missing(k, k + n) - k
        for j in range(k, k + first):
            yield _Skipped((j,))
        if first == n:
            return
        j = first
        try:
            for sample in _shard_from(url, spans[j][1]) if j else iter_shard(url, self.options):
                if k + j < d.end:  # positions still matter: the shard must match its index
                    if j >= n or sample["__key__"] != spans[j][0]:
                        indexed = repr(spans[j][0]) if j < n else "there is none"
                        raise ShardError(f"sample {j} is {sample['__key__']!r}, its index says "
                                         f"{indexed}: the shard changed while resuming", url)
                    yield _Skipped((k + j,)) if k + j in d else sample
                else:
                    yield sample
                j += 1
            if j < n and k + j < d.end:
                raise ShardError(f"shard has {j} samples, its index says {n}: it changed while "
                                 "resuming", url)
        except ShardError as exc:
            if k + j < d.end:
                raise  # skipping the rest would shift every later delivered position
            self.policy(exc)
