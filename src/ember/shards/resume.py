"""Where an iteration stands, and how to get back there: the shard state's version, the epoch
cell shared with DataLoader workers (:class:`_EpochCell`), a direct iteration's position
(:class:`_Position`), and the index-based seek that resumes a stream mid-epoch without reading
what it already delivered (:class:`_Delivered`, :class:`_IndexedLayout`, :class:`_SkippingReader`
and the placeholders, :class:`_Skipped`, that stand for delivered samples in the stages).
"""

from __future__ import annotations

import copy
import multiprocessing
import multiprocessing.context
import random
import warnings
from collections.abc import Callable, Iterable, Iterator
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


class StreamState:
    """Where the iteration of one ShardDataset pipeline stands: the epoch cell (shared with the
    DataLoader workers), the epoch of a direct iteration in progress and its position, a loaded
    state waiting for the next iteration, the stream a ``with_epoch`` iteration left off in, and,
    for the copies a loader hands to its workers, the fixed epoch, the transfer group size and
    the transfer arena. The dataset is the description of the pipeline; this object is the one
    owner of everything that changes while it is iterated.

    Copying a dataset (its fluent methods) gives the copy a state of its own (:meth:`fork`);
    pickling keeps the epoch numbers (a copy in another process counts
    on from there) and drops what belongs to this process's iteration."""

    def __init__(self, on_error: Any = "raise", cell: _EpochCell | None = None):
        self.cell = cell if cell is not None else _EpochCell()
        self.on_error = on_error
        self.running: int | None = None  # epoch of the direct iteration in progress
        self.fixed_epoch: int | None = None  # a loader's copy: the epoch its workers read
        self.live: tuple | None = None  # with_epoch: (stream, items, policy) to continue
        self.pos = _Position(0, _ErrorPolicy(on_error))  # fresh per iteration and loaded state
        self.resume: dict | None = None  # a loaded state, for the next iteration
        self.tagged = False  # a loader's copy: yield (stream, error counts, items) groups
        self.group = 1  # a loader's copy: items per group
        self.arena: Any = None  # a loader's copy: shared memory for the groups (TransferArena)
        self.warned_streams = False

    def fork(self) -> StreamState:
        """A state of its own for a copy of the dataset: an epoch counter of its own, starting
        where this one is; the rest as now."""
        out = copy.copy(self)
        out.cell = _EpochCell(*self.cell.snapshot())
        out.live = None
        return out

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["live"] = None
        if multiprocessing.context.get_spawning_popen() is None:
            # not a worker being started: a copy gets its own counter, starting where this is
            state["cell"] = self.cell.snapshot()
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["cell"], tuple):
            state["cell"] = _EpochCell(*state["cell"])
        self.__dict__.update(state)

    @property
    def next_epoch(self) -> int:
        """The epoch the next iteration uses."""
        return self.cell.next_epoch()

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration use ``epoch`` (also in DataLoader workers)."""
        self.cell.set_next(epoch)

    def begin(self, worker: Any) -> int:
        """The epoch of an iteration starting now, in DataLoader worker ``worker`` (its
        get_worker_info(), or None for a direct iteration)."""
        if self.fixed_epoch is not None:
            return self.fixed_epoch
        if worker is None:
            return self.cell.begin(random.getrandbits(63), 0)
        return self.cell.begin((worker.seed - worker.id) & ((1 << 63) - 1), worker.id)

    def take_resume(self) -> dict | None:
        """The loaded state, once (the next iteration uses it)."""
        resume, self.resume = self.resume, None
        return resume

    def load(self, resume: dict) -> None:
        """Continue at ``resume`` (a checked state) on the next iteration."""
        self.set_epoch(resume["epoch"])
        self.running = None
        self.resume = resume
        errors = resume["errors"]
        policy = _ErrorPolicy(self.on_error)
        policy.count = errors[0] if len(errors) == 1 else 0  # direct iteration counts on from here
        self.pos = _Position(0, policy)

    def position(self, epoch: int, urls: int, seed: int) -> dict:
        """The state dict of a direct iteration."""
        if self.running is not None:
            epoch, consumed, errors = self.running, self.pos.consumed, self.pos.policy.count
        else:
            consumed, errors = 0, 0
        return {"version": STATE_VERSION, "epoch": epoch, "seed": seed,
                "num_workers": 1, "consumed": [consumed], "next": 0,
                "num_shards": urls, "errors": [errors]}

    def for_loader(self, epoch: int, group: int, arena: Any, resume: dict | None,
                   persistent: bool) -> StreamState:
        """The state of the copy a loader hands to its DataLoader workers: epoch ``epoch``
        (persistent workers: whatever the copy's own cell says), items sent in groups of
        ``group`` through ``arena``, continuing at ``resume``."""
        out = StreamState(self.on_error, _EpochCell() if persistent else self.cell)
        out.fixed_epoch = None if persistent else epoch
        out.tagged = True
        out.group = group
        out.arena = arena
        out.warned_streams = True  # the loader warns
        if resume is not None:
            out.load(resume)
        return out


def check_state(state: dict, seed: int, num_shards: int) -> dict:
    """The resume point of ``state`` (from ShardDataset's or ShardLoader's state_dict()), checked
    against a pipeline of ``seed`` over ``num_shards`` shards."""
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"unsupported shard state version {state.get('version')!r}")
    if state["seed"] != seed or state["num_shards"] != num_shards:
        raise ValueError(f"state is for seed={state['seed']} over {state['num_shards']} "
                         f"shards, this dataset has seed={seed} over {num_shards}")
    errors = [int(e) for e in state.get("errors", [0] * len(state["consumed"]))]
    if len(errors) != len(state["consumed"]) or min(errors, default=0) < 0:
        raise ValueError(f"state's errors {state.get('errors')!r} do not match its "
                         f"{len(state['consumed'])} reading streams")
    return {"epoch": int(state["epoch"]), "consumed": list(state["consumed"]),
            "next": int(state["next"]), "num_workers": int(state["num_workers"]),
            "errors": errors}


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

    def samples(self, urls: Iterable[str]) -> Iterator[_Skipped]:
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

    def samples(self, urls: Iterable[str]) -> Iterator:
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
