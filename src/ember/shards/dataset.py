"""ShardDataset: an IterableDataset over WebDataset-format shards with a fluent stage pipeline,
deterministic per-epoch shuffling and splitting, and exact mid-epoch resumption; and ShardLoader,
a DataLoader wrapper that tracks what the training loop consumed so state_dict() is exact with
several workers.
"""

from __future__ import annotations

import copy
import itertools
import multiprocessing
import multiprocessing.context
import os
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# DataLoader's worker loop seeds numpy.random: loaded here, forked workers inherit it instead of
# each importing it every epoch, an import that has failed in a forked worker inside importlib's
# module locks (KeyError in _lock_unlock_module)
import numpy.random  # noqa: F401
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ember.shards import plan, stages
from ember.shards.decode import Decoder
from ember.shards.errors import ShardError
from ember.shards.format import group_samples
from ember.shards.index import index_mismatch, index_path, read_index
from ember.shards.rebatch import LoaderStages
from ember.shards.tar import iter_members, open_tar_source
from ember.shards.transfer import TransferArena
from ember.shards.urls import UrlOptions, as_list, local_path, open_url

__all__ = ["ShardDataset", "ShardLoader", "iter_shard", "rank_and_world"]

STATE_VERSION = 1
DEFAULT_TRANSFER_GROUP = 128  # items per worker-to-main-process transfer in ShardLoader
DEFAULT_TRANSFER_MEMORY = 16 << 20  # bytes per shared-memory transfer slot in ShardLoader


def rank_and_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Rank and world size: the arguments if given, else torch.distributed if initialised, else
    the RANK / WORLD_SIZE environment variables, else (0, 1)."""
    if rank is not None and world_size is not None:
        r, w = rank, world_size
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        r, w = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        r = int(os.environ.get("RANK", 0))
        w = int(os.environ.get("WORLD_SIZE", 1))
    if rank is not None:
        r = rank
    if world_size is not None:
        w = world_size
    if not 0 <= r < w:
        raise ValueError(f"expected 0 <= rank < world_size, got rank={r}, world_size={w}")
    return r, w


def iter_shard(url: str, options: UrlOptions | None = None) -> Iterator[dict]:
    """Yield the raw samples (dicts of bytes) of one shard; the stream is closed when done."""
    yield from _samples(open_url(url, options), url)


def _shard_from(url: str, offset: int) -> Iterator[dict]:
    """Yield the raw samples of a local uncompressed shard from the sample whose records start
    at byte ``offset`` (a header boundary taken from the shard's index). Offsets, in errors and
    their messages too, are absolute (counted from the start of the shard)."""
    stream = open_url(url)
    try:
        stream.seek(offset)
    except BaseException:
        stream.close()
        raise
    yield from _samples(stream, url, offset)


def _samples(stream, url: str, base: int = 0) -> Iterator[dict]:
    """The samples of the tar stream ``stream`` (positioned at absolute byte ``base`` of the
    shard, at a header); closes the stream when done."""
    try:
        try:
            src = open_tar_source(stream, url)
        except ShardError as exc:
            if not base or exc.offset is None:
                raise
            raise type(exc)(exc.message, exc.url, exc.offset + base) from exc
        # a seeked stream is read sequentially: its window starts at absolute byte `base`, so
        # every offset the parser reports (member offsets, error offsets and the byte positions
        # quoted in error messages) is counted from the start of the shard
        if base:
            src.base = base
        try:
            yield from group_samples(iter_members(src, url), url)
        finally:
            src.close()
    finally:
        stream.close()


class _ErrorPolicy:
    """Applies on_error to shard and decode errors and counts what was skipped."""

    def __init__(self, on_error: str | Callable[[Exception], Any]):
        if not callable(on_error) and on_error not in ("raise", "warn", "skip"):
            raise ValueError(f"expected on_error='raise', 'warn', 'skip' or a callable, "
                             f"got {on_error!r}")
        self.on_error = on_error
        self.count = 0

    def __call__(self, exc: Exception) -> None:
        if self.on_error == "raise":
            raise exc
        self.count += 1
        if self.on_error == "warn":
            warnings.warn(f"skipped: {exc} ({self.count} errors so far)")
        elif callable(self.on_error):
            self.on_error(exc)


class _Position:
    """Where a direct iteration stands: items delivered so far, and the policy that counts its
    errors. Updated for every item, so it is a slotted object: its stores stay fast however the
    dataset's own attributes are laid out (copies and unpickled workers lose CPython's compact
    layout)."""

    __slots__ = ("consumed", "policy")

    def __init__(self, consumed: int, policy: _ErrorPolicy):
        self.consumed = consumed
        self.policy = policy


_MAX_WORKERS = 4096  # reading workers per process that the shared epoch cell can tell apart
_AUTO = "auto"
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


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


def _split_with(splitter: Callable, urls: list[str], what: str) -> list[str]:
    """Apply a webdataset-style splitter (an iterable of ``{"url": ...}`` dicts in, the selected
    ones out; plain URL strings out are accepted too) to a list of URLs."""
    out = []
    for item in splitter(iter([{"url": u} for u in urls])):
        url = item["url"] if isinstance(item, dict) else item
        if not isinstance(url, str):
            raise TypeError(f"{what} must yield URL strings or dicts with a 'url', got {item!r}")
        out.append(url)
    return out


class ShardDataset(IterableDataset):
    """Samples from a list of WebDataset tar shards, split over ranks and DataLoader workers.

    ``urls`` is a brace pattern, a list, or nested lists (see :func:`expand_urls`). Each epoch,
    shards are put in an order drawn from ``(seed, epoch)`` (if ``shuffle_shards``) and dealt to
    the ``world_size * num_workers`` reading streams; samples are dicts ``{ext: bytes, "__key__",
    "__url__"}`` until stages transform them.

    ``on_error``: ``"raise"`` (default), ``"warn"`` or ``"skip"`` (skip the rest of a bad shard or
    a sample that fails to decode, and count it in ``error_count``), or a callable receiving the
    exception. ``equalize``: ``"drop"`` or ``"repeat"`` gives every rank the same number of
    samples per epoch (see :func:`ember.shards.plan.equal_quotas`); it needs per-shard sample
    counts, taken from ``shard_sizes``, else from index files, else by scanning the shards.
    ``generator`` (optional) is the torch.Generator type to draw with, e.g. an ember.csprng
    generator; it is copied and re-seeded from ``seed`` for every draw stream.

    Epochs: every new iteration (direct, or one DataLoader epoch, with or without persistent
    workers) uses the epoch after the previous one, starting at 0; ``set_epoch(e)`` makes the next
    one use ``e``. ``resampled=True`` draws each stream's shards with replacement, endlessly (cut
    epochs with ``with_epoch``). ``nodesplitter``/``workersplitter``: ``"auto"`` deals the
    epoch's shard order over ``world x workers`` streams; ``None`` does not split over ranks
    (a URL list already split per rank) or workers; a callable is a webdataset-style splitter.
    ``cache_dir`` keeps a local copy of every remote shard read (at most ``cache_size`` bytes).
    """

    def __init__(self, urls: str | Sequence, *, shuffle_shards: bool = True, seed: int = 0,
                 generator: torch.Generator | None = None, rank: int | None = None,
                 world_size: int | None = None, on_error: str | Callable = "raise",
                 equalize: str | None = None, shard_sizes: Sequence[int] | None = None,
                 timeout: float = 60.0, retries: int = 5, allow_pipe: bool = False,
                 s3_endpoint: str | None = None, resampled: bool = False,
                 nodesplitter: str | Callable | None = _AUTO,
                 workersplitter: str | Callable | None = _AUTO,
                 cache_dir: str | os.PathLike | None = None, cache_size: int | None = None):
        super().__init__()
        self.urls = as_list(urls)
        for name, fn in (("nodesplitter", nodesplitter), ("workersplitter", workersplitter)):
            if fn is not None and fn != _AUTO and not callable(fn):
                raise ValueError(f"expected {name}='auto', None or a callable, got {fn!r}")
        self.nodesplitter, self.workersplitter = nodesplitter, workersplitter
        self.resampled = bool(resampled)
        if self.resampled and equalize is not None:
            raise ValueError("equalize= does not apply to resampled=True (every stream is endless;"
                             " use with_epoch(n) to give every stream n items per epoch)")
        custom = nodesplitter != _AUTO or workersplitter != _AUTO
        if custom and equalize is not None:
            raise ValueError("equalize= needs ember's own splitting (nodesplitter='auto', "
                             "workersplitter='auto'): with other splitters a rank cannot know "
                             "what the other ranks read")
        self.shuffle_shards = shuffle_shards
        self.seed = int(seed)
        self.generator = generator
        self.rank, self.world_size = rank, world_size
        policy = _ErrorPolicy(on_error)  # validates on_error
        self.on_error = on_error
        if equalize not in (None, "drop", "repeat"):
            raise ValueError(f"expected equalize=None, 'drop' or 'repeat', got {equalize!r}")
        self.equalize = equalize
        if shard_sizes is not None and len(shard_sizes) != len(self.urls):
            raise ValueError(f"shard_sizes has {len(shard_sizes)} entries for {len(self.urls)} "
                             "shards")
        self.shard_sizes = list(shard_sizes) if shard_sizes is not None else None
        if cache_size is not None and cache_dir is None:
            raise ValueError("cache_size= needs cache_dir=")
        self.options = UrlOptions(timeout=timeout, retries=retries, allow_pipe=allow_pipe,
                                  s3_endpoint=s3_endpoint,
                                  cache_dir=os.fspath(cache_dir) if cache_dir is not None else None,
                                  cache_size=cache_size)
        self.stages: list[tuple[str, tuple]] = []
        self._cell = _EpochCell()
        self._running: int | None = None  # epoch of the direct iteration in progress
        self._fixed_epoch: int | None = None  # set by ShardLoader for its copies
        self._live: tuple[int, Iterator] | None = None  # with_epoch: (position, stream) kept
        self.length: int | None = None
        self._warned_streams = False
        self.epoch_length: int | None = None
        self._pos = _Position(0, policy)  # fresh for each iteration and each loaded state
        self._resume: dict | None = None
        self._tagged = False  # set by ShardLoader: yield (stream, error counts, items) groups
        self._group = 1
        self._arena: TransferArena | None = None  # set by ShardLoader: shared memory for groups

    # ---- fluent pipeline -------------------------------------------------------------------

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_live"] = None
        if multiprocessing.context.get_spawning_popen() is None:
            # not a worker being started: a copy gets its own counter, starting where this is
            state["_cell"] = self._cell.snapshot()
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["_cell"], tuple):
            state["_cell"] = _EpochCell(*state["_cell"])
        self.__dict__.update(state)

    @property
    def error_count(self) -> int:
        """Errors skipped so far in the current (or last) direct iteration, as on_error and the
        stage handlers counted them (continued from a loaded state)."""
        return self._pos.policy.count

    @property
    def epoch(self) -> int:
        """The epoch the next iteration uses."""
        return self._cell.next_epoch()

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("this ShardDataset has no length: declare it with with_length(n) "
                            "(the number of items one epoch yields on this rank)")
        return self.length

    def with_length(self, n: int) -> ShardDataset:
        """Declare that an epoch yields ``n`` items on this rank: ``len()`` returns it (as
        webdataset's with_length, it is not enforced; ``with_epoch`` is)."""
        if int(n) < 0:
            raise ValueError(f"expected a length >= 0, got {n!r}")
        out = copy.copy(self)
        out.length = int(n)
        return out

    def _with(self, kind: str, *payload) -> ShardDataset:
        out = copy.copy(self)
        out.stages = self.stages + [(kind, payload)]
        return out

    def shuffle(self, bufsize: int, initial: int | None = None) -> ShardDataset:
        """Shuffle samples through a buffer of ``bufsize`` (reproducible per seed and epoch)."""
        return self._with("shuffle", int(bufsize), initial)

    def decode(self, *handlers: str | Callable, only: str | list[str] | None = None,
               allow_pickle: bool = False, max_pixels: int | None = 89_478_485,
               handler: Callable[[Exception], Any] | None = None) -> ShardDataset:
        """Decode fields by extension; image specs (``"pil"``, ``"rgb8"``, ``"torchrgb"``, ...)
        and handler callables ``(ext, data) -> value or None`` are tried first.

        Without ``handler``, a DecodeError goes to the dataset's ``on_error``; with it, any
        exception while decoding a sample goes to ``handler`` (see :meth:`map`)."""
        decoder = Decoder(*handlers, only=only, allow_pickle=allow_pickle, max_pixels=max_pixels)
        return self._with("decode", decoder, _check_handler(handler))

    def map(self, fn: Callable[[Any], Any], *,
            handler: Callable[[Exception], Any] | None = None) -> ShardDataset:
        """Apply ``fn`` to every item.

        ``handler`` (as in webdataset) gets any exception raised for an item: it returns True to
        skip the item, False to end the stream, or raises (``reraise_exception``,
        ``warn_and_continue``, ``ignore_and_continue``, ``warn_and_stop``). Skipped items are
        counted in ``error_count``. Default: the exception propagates."""
        return self._with("map", fn, _check_handler(handler))

    def map_dict(self, *, handler: Callable[[Exception], Any] | None = None,
                 **fns: Callable) -> ShardDataset:
        """Apply ``fns[field]`` to those fields of every sample dict (``handler`` as in map)."""
        return self._with("map_dict", fns, _check_handler(handler))

    def map_tuple(self, *fns: Callable | None,
                  handler: Callable[[Exception], Any] | None = None) -> ShardDataset:
        """Apply ``fns[i]`` to element ``i`` of every tuple item; None keeps the element
        (``handler`` as in map)."""
        if not fns or not all(f is None or callable(f) for f in fns):
            raise TypeError(f"expected map_tuple(*fns) with callables or None, got {fns!r}")
        return self._with("map_tuple", tuple(fns), _check_handler(handler))

    def rename(self, keep: bool = True, **renames: str) -> ShardDataset:
        """Rename fields, ``new="old1;old2"`` (first present); ``keep=False`` drops the others."""
        return self._with("rename", renames, keep)

    def select(self, predicate: Callable[[Any], bool]) -> ShardDataset:
        """Keep items for which ``predicate(item)`` is true."""
        return self._with("select", predicate)

    def to_tuple(self, *fields: str, missing_ok: bool = False,
                 handler: Callable[[Exception], Any] | None = None) -> ShardDataset:
        """Turn dicts into tuples: ``to_tuple("jpg;png cls")`` -> (jpg or png, cls)
        (``handler`` as in map, e.g. to skip samples missing a field)."""
        return self._with("to_tuple", fields, missing_ok, _check_handler(handler))

    def slice(self, *args: int | None) -> ShardDataset:
        """``itertools.islice`` on each reading stream: ``slice(stop)`` or
        ``slice(start, stop[, step])`` (per pass, per rank x worker stream)."""
        if not 1 <= len(args) <= 3:
            raise TypeError(f"slice expected 1 to 3 arguments, got {len(args)}")
        s = slice(*args)
        start, stop, step = s.start or 0, s.stop, 1 if s.step is None else s.step
        if int(start) < 0 or (stop is not None and int(stop) < 0) or int(step) < 1:
            raise ValueError(f"slice: expected start >= 0, stop >= 0 or None and step >= 1, "
                             f"got {args!r}")
        return self._with("slice", int(start), None if stop is None else int(stop), int(step))

    def rsample(self, p: float = 0.5) -> ShardDataset:
        """Keep each item with probability ``p``, drawn from the pipeline's generator
        (reproducible per seed and epoch, and resumed exactly)."""
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"expected rsample probability in [0, 1], got {p!r}")
        return self._with("rsample", float(p))

    def batched(self, batchsize: int, collation_fn: Callable | None = stages.default_collate,
                partial: bool = True) -> ShardDataset:
        """Group items into batches of ``batchsize`` (collated by ``collation_fn``, or lists if
        None); each worker's last batch may be short unless ``partial=False``."""
        return self._with("batched", int(batchsize), collation_fn, partial)

    def with_epoch(self, n: int) -> ShardDataset:
        """Make every epoch yield exactly ``n`` items per reading stream (rank x worker).

        Each stream is the endless succession of its ordinary passes (pass ``q`` ordered and
        shuffled as epoch ``q`` would be); epoch ``e`` is items ``[e*n, (e+1)*n)`` of it, so each
        epoch continues where the previous one stopped. With ``resampled=True``, epoch ``e`` is
        the first ``n`` items of that epoch's own draws."""
        if int(n) < 1:
            raise ValueError(f"expected with_epoch(n) with n >= 1, got {n!r}")
        out = copy.copy(self)
        out.epoch_length = int(n)
        return out

    # ---- epochs and state ------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shard order and shuffle are used by the next iteration (also
        by DataLoader workers, persistent ones included)."""
        if int(epoch) < 0:
            raise ValueError(f"expected an epoch >= 0, got {epoch!r}")
        self._cell.set_next(int(epoch))

    def state_dict(self) -> dict:
        """The position of direct (main-process) iteration: load it to continue exactly there."""
        if self._running is not None:
            epoch, consumed, errors = self._running, self._pos.consumed, self._pos.policy.count
        else:
            epoch, consumed, errors = self.epoch, 0, 0
        return {"version": STATE_VERSION, "epoch": epoch, "seed": self.seed,
                "num_workers": 1, "consumed": [consumed], "next": 0,
                "num_shards": len(self.urls), "errors": [errors]}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (from this class's or ShardLoader's state_dict())."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported shard state version {state.get('version')!r}")
        if state["seed"] != self.seed or state["num_shards"] != len(self.urls):
            raise ValueError(f"state is for seed={state['seed']} over {state['num_shards']} "
                             f"shards, this dataset has seed={self.seed} over {len(self.urls)}")
        self.set_epoch(int(state["epoch"]))
        self._running = None
        errors = [int(e) for e in state.get("errors", [0] * len(state["consumed"]))]
        if len(errors) != len(state["consumed"]) or min(errors, default=0) < 0:
            raise ValueError(f"state's errors {state.get('errors')!r} do not match its "
                             f"{len(state['consumed'])} reading streams")
        self._resume = {"epoch": int(state["epoch"]), "consumed": list(state["consumed"]),
                        "next": int(state["next"]), "num_workers": int(state["num_workers"]),
                        "errors": errors}
        policy = _ErrorPolicy(self.on_error)
        policy.count = errors[0] if len(errors) == 1 else 0  # direct iteration counts on from here
        self._pos = _Position(0, policy)

    # ---- reading ---------------------------------------------------------------------------

    def _generator_copy(self) -> torch.Generator | None:
        return copy.deepcopy(self.generator) if self.generator is not None else None

    def _generator(self, seed: int) -> torch.Generator:
        return plan.make_generator(seed, self._generator_copy())

    def ensure_shard_sizes(self) -> list[int]:
        """Sample counts of every shard (from shard_sizes, index files, or a header scan)."""
        if self.shard_sizes is None:
            from ember.shards.index import _spans

            sizes, scanned = [], 0
            for u in self.urls:
                index = read_index(u, self.options)
                if index is not None:
                    sizes.append(len(index["samples"]))
                    continue
                if local_path(u) is None and not scanned and self.options.cache_dir is None:
                    where = " in every DataLoader worker" if get_worker_info() is not None else ""
                    remote = sum(local_path(x) is None for x in self.urls)
                    warnings.warn(f"equalize={self.equalize!r} needs sample counts: remote shard "
                                  f"{u} (of {remote} remote shards) has no index file ({u}.idx), "
                                  f"so shards without one are downloaded once more{where} only to "
                                  "count their samples; pass shard_sizes=, write indexes (`ember "
                                  "shards index`), or set cache_dir= so that download is reused",
                                  stacklevel=2)
                scanned += 1
                sizes.append(sum(1 for _ in _spans(u, self.options)))
            self.shard_sizes = sizes
        return self.shard_sizes

    def _shard_samples(self, urls: list[str], policy: _ErrorPolicy) -> Iterator[dict]:
        for url in urls:
            try:
                yield from _samples(open_url(url, self.options), url)  # iter_shard, inlined
            except ShardError as exc:
                policy(exc)

    def _draws(self, epoch: int, rank: int, world: int, worker: int,
               num_workers: int) -> Iterator[str]:
        """resampled=True: the stream's endless shard draws, with replacement, uniform over the
        shard list, from (seed, epoch, rank, world, worker, num_workers)."""
        g = self._generator(plan.derive_seed(self.seed, "resample", epoch, rank, world, worker,
                                             num_workers))
        n = len(self.urls)
        while True:
            for i in torch.randint(n, (256,), generator=g).tolist():
                yield self.urls[i]

    def _stream_urls(self, epoch: int, rank: int, world: int, worker: int, num_workers: int,
                     borrow: bool) -> list[str]:
        """The shards one stream reads in one ordinary pass; ``borrow``: a stream left without
        shards reads one chosen from its position instead (so that it has items to give)."""
        g = self._generator_copy()
        if self.nodesplitter == _AUTO and self.workersplitter == _AUTO:
            idx = plan.worker_shards(len(self.urls), seed=self.seed, epoch=epoch, rank=rank,
                                     world=world, worker=worker, num_workers=num_workers,
                                     shuffle=self.shuffle_shards, generator=g)
            urls = [self.urls[i] for i in idx]
        else:
            order = plan.shard_order(len(self.urls), seed=self.seed, epoch=epoch,
                                     shuffle=self.shuffle_shards, generator=g)
            urls = [self.urls[i] for i in order]
            if self.nodesplitter == _AUTO:
                urls = urls[rank::world]
            elif self.nodesplitter is not None:
                urls = _split_with(self.nodesplitter, urls, "nodesplitter")
            if self.workersplitter == _AUTO:
                urls = urls[worker::num_workers]
            elif self.workersplitter is not None:
                urls = _split_with(self.workersplitter, urls, "workersplitter")
        if not urls and borrow:
            order = plan.shard_order(len(self.urls), seed=self.seed, epoch=epoch,
                                     shuffle=self.shuffle_shards, generator=self._generator_copy())
            urls = [self.urls[order[plan.stream_index(rank, world, worker, num_workers)
                                    % len(order)]]]
        return urls

    def _raw(self, epoch: int, rank: int, world: int, worker: int, num_workers: int, pass_: int,
             read: Callable[[list[str]], Iterator], quota: int | None) -> Iterator:
        # returns the reader's own iterator where it can: one generator less per sample
        if self.resampled:
            return read(self._draws(epoch, rank, world, worker, num_workers))
        borrow = quota is not None or self.epoch_length is not None
        urls = self._stream_urls(epoch, rank, world, worker, num_workers, borrow)
        if quota is None:
            return read(urls)
        return self._with_quota(urls, rank, worker, read, quota)

    @staticmethod
    def _with_quota(urls: list[str], rank: int, worker: int, read: Callable,
                    quota: int) -> Iterator:
        n = 0
        while n < quota:
            before = n
            for sample in read(urls):
                yield sample
                n += 1
                if n == quota:
                    return
            if n == before:
                raise ShardError(f"reading stream {rank}/{worker} has no readable samples to "
                                 "repeat for equalize='repeat'")

    def _pipeline(self, src: Iterator, epoch: int, rank: int, world: int, worker: int,
                  num_workers: int, pass_: int, policy: _ErrorPolicy, skipping: bool) -> Iterator:
        for i, (kind, p) in enumerate(self.stages):
            if kind == "shuffle":
                g = self._generator(plan.derive_seed(self.seed, "samples", epoch, pass_, rank,
                                                     world, worker, num_workers, i))
                src = stages.shuffle(src, p[0], p[1], g)
            elif kind == "rsample":
                g = self._generator(plan.derive_seed(self.seed, "samples", epoch, pass_, rank,
                                                     world, worker, num_workers, i))
                src = stages.rsample(src, p[0], g)
            elif kind == "slice":
                src = stages.islice_stream(src, p[0], p[1], p[2])
            elif kind == "batched":
                collate = _collate_unless_skipped(p[1]) if skipping else p[1]
                src = stages.batched(src, p[0], collate, p[2])
            else:
                stage = _one_to_one(kind, p, policy)
                src = _around_skipped(src, stage) if skipping else stage(src)
        return src

    def _pass(self, epoch: int, rank: int, world: int, worker: int, num_workers: int,
              policy: _ErrorPolicy, read: Callable, skipping: bool) -> Iterator:
        """One ordinary pass of a stream (endless with resampled=True), through the stages."""
        quota = None
        if self.equalize is not None:
            quota = plan.equal_quotas(self.ensure_shard_sizes(), seed=self.seed, epoch=epoch,
                                      world=world, num_workers=num_workers, mode=self.equalize,
                                      shuffle=self.shuffle_shards,
                                      generator=self._generator_copy())[worker]
            if quota == 0 and self.epoch_length is not None:
                quota = None  # with_epoch gives the stream its items: read its (borrowed) shards
        raw = self._raw(epoch, rank, world, worker, num_workers, 0, read, quota)
        return self._pipeline(raw, epoch, rank, world, worker, num_workers, 0, policy, skipping)

    def _items(self, epoch: int, rank: int, world: int, worker: int, num_workers: int,
               policy: _ErrorPolicy, read: Callable[[list[str]], Iterator] | None = None,
               skipping: bool = False) -> Iterator:
        """The items of one reading stream: one pass (or with_epoch's endless succession of
        passes, pass q as in epoch q); ``read(urls)`` yields the raw samples of a list of shards
        (by default by reading them), ``skipping`` carries placeholders past the stages."""
        if read is None:
            read = lambda urls: self._shard_samples(urls, policy)
        if self.epoch_length is None or self.resampled:
            return self._pass(epoch, rank, world, worker, num_workers, policy, read, skipping)
        return self._passes(rank, world, worker, num_workers, policy, read, skipping)

    def _passes(self, rank: int, world: int, worker: int, num_workers: int,
                policy: _ErrorPolicy, read: Callable, skipping: bool) -> Iterator:
        """with_epoch: the endless succession of a stream's passes, pass q as in epoch q."""
        for q in itertools.count():
            produced = 0
            for item in self._pass(q, rank, world, worker, num_workers, policy, read, skipping):
                produced += 1
                yield item
            if produced == 0:
                raise ShardError(f"with_epoch({self.epoch_length}): reading stream rank {rank} "
                                 f"worker {worker} has no readable samples")

    def _counts_are_content_free(self) -> bool:
        """Whether how many items a stream yields, and which samples each is made of, depend on
        sample counts only (no select, no decode errors skipped), so the delivered part of a
        resumed stream can be worked out from indexes without reading it."""
        for kind, p in self.stages:
            if kind == "select" or (kind == "decode" and self.on_error != "raise"):
                return False
            if kind in _HANDLED and p[-1] is not None:
                return False  # a handler may skip items
        return True

    def _resumed_items(self, epoch: int, rank: int, world: int, worker: int, num_workers: int,
                       policy: _ErrorPolicy, skip: int) -> Iterator | None:
        """The stream's items with its first ``skip`` (already delivered) as placeholders made
        without reading them, using the shards' indexes; None where the indexes cannot tell."""
        if not self._counts_are_content_free():
            return None
        layout = _IndexedLayout(self.options)
        delivered = _Delivered()
        # run the stream's stages over placeholders numbered by position: which positions the
        # first `skip` items took depends on the shuffle draws and sample counts only
        shape = self._items(epoch, rank, world, worker, num_workers, policy, layout.samples, True)
        try:
            for _ in range(skip):
                item = next(shape, _END)
                if item is _END:
                    break
                delivered.add(item.positions)
        except _NoIndex:
            return None
        finally:
            getattr(shape, "close", lambda: None)()
        reason = layout.mismatch(delivered)
        if reason is not None:
            warnings.warn(f"{reason}; resuming by reading and discarding the consumed samples")
            return None
        reader = _SkippingReader(layout, delivered, self.options, policy)
        return self._items(epoch, rank, world, worker, num_workers, policy, reader.samples, True)

    def _check_streams(self, world: int, num_workers: int) -> None:
        """Warn (once per dataset) when some reading streams get no shard and nothing evens
        that out."""
        if (self.resampled or self.nodesplitter != _AUTO or self.workersplitter != _AUTO
                or self.equalize == "repeat" or self.epoch_length is not None
                or len(self.urls) >= world * num_workers or self._warned_streams):
            return
        self._warned_streams = True
        warnings.warn(f"{len(self.urls)} shards for {world * num_workers} reading streams "
                      f"({world} ranks x {num_workers} workers): some streams get no shard, so "
                      "ranks and workers are uneven; use more shards or fewer workers, or "
                      "equalize='repeat', with_epoch(n) or resampled=True", stacklevel=3)

    def _rank_world(self) -> tuple[int, int]:
        if self.nodesplitter is None:
            return 0, 1  # the URL list is this rank's own
        return rank_and_world(self.rank, self.world_size)

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        physical, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rank, world = self._rank_world()
        if self._fixed_epoch is not None:
            epoch = self._fixed_epoch
        else:
            key = (info.seed - info.id) & ((1 << 63) - 1) if info is not None else \
                random.getrandbits(63)
            epoch = self._cell.begin(key, physical)
        resume = self._resume
        self._resume = None
        if physical == 0 and not self._tagged:
            self._check_streams(world, num_workers)
        worker, skip, counted = physical, 0, None
        if resume is not None and resume["epoch"] == epoch:
            if resume["num_workers"] != num_workers:
                raise ValueError(f"state was saved with {resume['num_workers']} reading workers, "
                                 f"resuming with {num_workers}")
            # DataLoader cycles workers from 0; rotate so the next stream to deliver comes first
            worker = (resume["next"] + physical) % num_workers
            skip = resume["consumed"][worker]
            counted = resume["errors"][worker]  # skipped before the saved position
            if resume["next"] and callable(self.workersplitter):
                raise ValueError("cannot resume this state with a custom workersplitter: the "
                                 "state's next stream is not worker 0 (use workersplitter='auto')")
        n = self.epoch_length
        continued = n is not None and not self.resampled
        start = epoch * n if continued else 0  # with_epoch: where this epoch's items begin
        limit = None if n is None else n - skip
        stream = (rank, world, worker, num_workers, start + skip)
        policy = _ErrorPolicy(self.on_error)
        items = None
        if continued and self._live is not None and self._live[0] == stream:
            items, policy = self._live[1], self._live[2]  # the stream left off right here
            ahead = 0
        else:
            ahead = start + skip
        self._live = None
        if ahead:
            items = self._resumed_items(epoch, rank, world, worker, num_workers, policy, ahead)
        seeking = items is not None and ahead > 0
        if items is None:
            items = self._items(epoch, rank, world, worker, num_workers, policy)
        full = items
        keep = False
        self._running = epoch
        try:
            for _ in range(ahead):
                item = next(items, _END)
                if item is _END:
                    return
                if seeking and not isinstance(item, _Skipped):
                    raise RuntimeError("index-based resume went out of step (a bug in ember)")
            if counted is not None:
                policy.count = counted  # whatever fast-forwarding counted, the run had these
            pos = self._pos = _Position(skip, policy)
            if self._tagged:
                if limit is not None:
                    items = itertools.islice(items, limit)
                yield from self._groups(items, worker, skip, seeking, pos)
                return
            # positions counted by a C iterator that also ends the epoch: zip stops at the end
            # of `positions` without drawing another item
            positions = itertools.count(skip + 1) if limit is None else \
                range(skip + 1, skip + limit + 1)
            for pos.consumed, item in zip(positions, items, strict=False):
                if seeking and isinstance(item, _Skipped):
                    raise RuntimeError("index-based resume went out of step (a bug in ember)")
                yield item
            self._running = None
            pos.consumed = 0
            if continued:
                self._live = ((rank, world, worker, num_workers, start + n), full, policy)
                keep = True
        finally:
            if not keep:
                getattr(full, "close", lambda: None)()

    def _groups(self, items: Iterator, worker: int, skip: int, seeking: bool,
                pos: _Position) -> Iterator[tuple[int, list[int], list]]:
        """A stream's items for ShardLoader, as ``(stream, error counts, items)`` groups of up to
        ``_group`` items. Groups end at multiples of ``_group`` stream positions, counted from the
        epoch's start (a resumed stream's first group is short), so a resumed loader interleaves
        the streams exactly as the uninterrupted one. Items already grouped when an error is
        raised are sent before it. With a transfer arena, their large bytes values go through
        shared memory."""
        size = self._group
        room = size - skip % size
        policy = pos.policy
        arena = self._arena
        pack = (lambda item: arena.pack(worker, item)) if arena is not None else (lambda item: item)
        seal = (lambda g: arena.seal(worker, g)) if arena is not None else (lambda g: g)
        group: list = []
        errors: list[int] = []
        try:
            for item in items:
                if seeking and isinstance(item, _Skipped):
                    raise RuntimeError("index-based resume went out of step (a bug in ember)")
                pos.consumed += 1
                group.append(pack(item))
                errors.append(policy.count)
                if len(group) == room:
                    yield worker, errors, seal(group)
                    group, errors, room = [], [], size
        except Exception:
            if group:
                yield worker, errors, seal(group)
            raise
        if group:
            yield worker, errors, seal(group)


_END = object()


def _as_is(item: Any) -> Any:
    return item


_HANDLED = ("decode", "map", "map_dict", "map_tuple", "to_tuple")


def _check_handler(handler: Callable[[Exception], Any] | None) -> Callable | None:
    if handler is not None and not callable(handler):
        raise TypeError(f"expected handler= to be None or a callable taking the exception "
                        f"(e.g. warn_and_continue), got {handler!r}")
    return handler


def _one_to_one(kind: str, p: tuple, policy: _ErrorPolicy) -> Callable[[Iterator], Iterator]:
    """The stage for a pipeline entry that turns each item into at most one item (exactly one
    unless it has a handler= or is a select)."""
    if kind in _HANDLED and p[-1] is not None:
        handler = p[-1]
        one = _per_item(kind, p[:-1])

        def count() -> None:
            policy.count += 1

        return lambda src: stages.handled(src, one, handler, count)
    if kind == "decode":
        return lambda src: stages.decode(src, p[0], policy)
    if kind == "map":
        return lambda src: stages.map_samples(src, p[0])
    if kind == "map_dict":
        return lambda src: stages.map_dict(src, p[0])
    if kind == "map_tuple":
        return lambda src: stages.map_tuple(src, p[0])
    if kind == "rename":
        return lambda src: stages.rename(src, p[0], p[1])
    if kind == "select":
        return lambda src: stages.select(src, p[0])
    if kind == "to_tuple":
        return lambda src: stages.to_tuple(src, p[0], p[1])
    raise AssertionError(kind)  # pragma: no cover


def _per_item(kind: str, p: tuple) -> Callable[[Any], Any]:
    """The function of item to item that a one-to-one stage applies."""
    if kind in ("decode", "map"):
        return p[0]
    gen = {"map_dict": lambda src: stages.map_dict(src, p[0]),
           "map_tuple": lambda src: stages.map_tuple(src, p[0]),
           "to_tuple": lambda src: stages.to_tuple(src, p[0], p[1])}[kind]
    return lambda item: next(gen(iter((item,))))


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


class ShardLoader:
    """A torch DataLoader over a ShardDataset that knows exactly what the loop has consumed.

    Batch with ``dataset.batched(n)``: this loader passes ``batch_size=None`` to DataLoader.
    ``state_dict()`` taken after receiving an item resumes at the next item, with any number of
    workers; iterating to the end advances the epoch.

    With workers, each worker sends its items to the main process in groups of up to
    ``transfer_group`` (one inter-process transfer per group instead of per item), and the loader
    hands them out one at a time. The default (None) is 128 samples per group, or 1 when the
    pipeline is ``batched`` (a batch already amortises the transfer); 1 sends every item alone.
    DataLoader takes groups from the workers in turn, so the items of the streams interleave
    group by group. ``state_dict()`` counts the items handed out, not the items received, and
    records the group size, so resuming continues that same order exactly.

    Where workers are forked, the large ``bytes`` values of a group (4 KiB and up, in dict,
    tuple and list items) go through shared memory instead of the workers' result pipes:
    ``transfer_memory`` bytes per slot, ``prefetch_factor + 1`` slots per worker, touched only as
    far as groups fill them (see :mod:`ember.shards.transfer`). ``transfer_memory=0`` sends
    everything through DataLoader's result queue.
    """

    def __init__(self, dataset: ShardDataset, *, num_workers: int = 0,
                 transfer_group: int | None = None,
                 transfer_memory: int = DEFAULT_TRANSFER_MEMORY, batch_size: int | None = None,
                 collate_fn: Callable | None = None, drop_last: bool = False, **kwargs: Any):
        for bad in ("sampler", "batch_sampler", "shuffle"):
            if kwargs.get(bad) not in (None, False):
                raise ValueError(f"ShardLoader does not take {bad}=; use dataset.shuffle(n) or "
                                 "loader.shuffle(n)")
            kwargs.pop(bad, None)
        self.persistent_workers = bool(kwargs.pop("persistent_workers", False))
        if self.persistent_workers and int(num_workers) < 1:
            raise ValueError("persistent_workers=True needs num_workers >= 1")
        self._kept: tuple | None = None  # persistent workers: (DataLoader, dataset copy, group)
        if batch_size is not None:
            # as DataLoader's batch_size: batches made in the workers, collated by collate_fn
            if int(batch_size) < 1:
                raise ValueError(f"expected batch_size >= 1, got {batch_size!r}")
            dataset = dataset.batched(int(batch_size), collation_fn=collate_fn or
                                      stages.default_collate, partial=not drop_last)
        elif collate_fn is not None:
            # as DataLoader with batch_size=None: applied to every item, in the workers
            dataset = dataset.map(collate_fn)
        elif drop_last:
            raise ValueError("drop_last=True needs batch_size= (or dataset.batched(n, "
                             "partial=False))")
        if transfer_group is not None and int(transfer_group) < 1:
            raise ValueError(f"expected transfer_group >= 1, got {transfer_group!r}")
        if int(transfer_memory) < 0:
            raise ValueError(f"expected transfer_memory >= 0 bytes, got {transfer_memory!r}")
        self.transfer_memory = int(transfer_memory)
        self.dataset = dataset
        self.num_workers = int(num_workers)
        if self.num_workers == 0:
            self.transfer_group = 1  # nothing to transfer
        elif transfer_group is not None:
            self.transfer_group = int(transfer_group)
        elif any(kind == "batched" for kind, _ in dataset.stages):
            self.transfer_group = 1
        else:
            self.transfer_group = DEFAULT_TRANSFER_GROUP
        self.kwargs = kwargs
        self.epoch = dataset.epoch
        self._streams = max(1, self.num_workers)
        self._consumed = [0] * self._streams
        self._errors = [0] * self._streams
        self._next = 0
        self._group = self.transfer_group
        self._resume: dict | None = None
        self._stages: list[tuple[str, tuple]] = []  # loader-level stages
        self._running = None  # this epoch's LoaderStages
        self._drained = False  # the loader-level stages are emptying after the workers ended
        self.length: int | None = None

    # ---- loader-level stages (main process, over all workers' items) -----------------------

    def _with(self, kind: str, *args) -> ShardLoader:
        out = copy.copy(self)
        out._stages = self._stages + [(kind, args)]
        out.length = None
        out._kept = None  # a loader of its own: its own persistent workers
        return out

    def unbatched(self) -> ShardLoader:
        """Split every item (a batch from the workers) into its samples."""
        return self._with("unbatched")

    def shuffle(self, bufsize: int) -> ShardLoader:
        """Shuffle items across workers through a buffer of ``bufsize`` (reproducible per seed
        and epoch; the buffer is part of state_dict())."""
        if int(bufsize) < 1:
            raise ValueError(f"expected bufsize >= 1, got {bufsize!r}")
        return self._with("shuffle", int(bufsize))

    def batched(self, batchsize: int, collation_fn: Callable | None = stages.default_collate,
                partial: bool = True) -> ShardLoader:
        """Group items into batches of ``batchsize`` in the main process (across workers)."""
        if int(batchsize) < 1:
            raise ValueError(f"expected batchsize >= 1, got {batchsize!r}")
        return self._with("batched", int(batchsize), collation_fn, partial)

    def with_length(self, n: int) -> ShardLoader:
        """Declare how many items an epoch of this loader yields: ``len()`` returns it."""
        if int(n) < 0:
            raise ValueError(f"expected a length >= 0, got {n!r}")
        out = copy.copy(self)
        out.length = int(n)
        out._kept = None
        return out

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (from its start); epochs also advance by
        themselves when an iteration reaches the end."""
        if int(epoch) < 0:
            raise ValueError(f"expected an epoch >= 0, got {epoch!r}")
        self.epoch = int(epoch)
        self._resume = None

    @property
    def error_count(self) -> int:
        """Shards/samples skipped by on_error in the current epoch, over all workers."""
        return sum(self._errors)

    def state_dict(self) -> dict:
        """Epoch, seed, items consumed per reading stream, the stream that delivers next and the
        transfer group size: enough to resume exactly. With loader-level stages, also their
        state, including the items in their buffers (the state grows with the buffer)."""
        state = {"version": STATE_VERSION, "epoch": self.epoch, "seed": self.dataset.seed,
                 "num_workers": self._streams, "consumed": list(self._consumed),
                 "next": self._next, "num_shards": len(self.dataset.urls),
                 "transfer_group": self._group, "errors": list(self._errors)}
        if self._stages:
            state["loader_stages"] = self._running.state() if self._running is not None else None
            state["loader_drained"] = self._drained
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state`` on the next iteration (the rest of that epoch uses the state's
        transfer group size, so the order is the uninterrupted run's)."""
        if int(state["num_workers"]) != self._streams:
            raise ValueError(f"state was saved with {state['num_workers']} workers, this loader "
                             f"has {self._streams}")
        if bool(self._stages) != ("loader_stages" in state):
            raise ValueError("state and loader differ in having loader-level stages")
        probe = copy.copy(self.dataset)
        probe.load_state_dict(state)  # validates
        self.epoch = int(state["epoch"])
        self._resume = dict(state)
        self._errors = list(probe._resume["errors"])  # error_count continues from the state
        self._kept = None  # persistent workers hold the old position: start new ones

    def _arena(self) -> TransferArena | None:
        """Shared memory for this epoch's groups, where workers are forked and it is wanted."""
        if (not self.num_workers or not self.transfer_memory or self.transfer_group == 1
                or self.persistent_workers):
            return None  # (an arena lives for one epoch's workers)
        context = self.kwargs.get("multiprocessing_context")
        method = context.get_start_method() if hasattr(context, "get_start_method") else context
        if not TransferArena.supported(method):
            return None
        slots = (self.kwargs.get("prefetch_factor") or 2) + 1
        return TransferArena(self._streams, slots, self.transfer_memory)

    def __len__(self) -> int:
        if self.length is not None:
            return self.length
        if self._stages:
            raise TypeError("loader-level stages change the number of items: declare it with "
                            "loader.with_length(n)")
        if self.dataset.length is not None:
            return self.dataset.length
        if self.dataset.epoch_length is not None:
            return self.dataset.epoch_length * self._streams
        raise TypeError("ShardLoader has no length: declare it with dataset.with_length(n) (the "
                        "items an epoch yields on this rank) or fix it with dataset.with_epoch(n) "
                        "(n items per worker, so len() is n x num_workers)")

    def __iter__(self) -> Iterator:
        if not self._stages:
            yield from self._upstream()
            return
        resume = self._resume
        loader_state = resume.get("loader_stages") if resume is not None else None
        drained = bool(resume.get("loader_drained")) if resume is not None else False
        epoch = self.epoch
        if drained:  # the workers had finished: only the buffers are left of that epoch
            self._resume = None
            upstream: Iterator = iter(())
            epoch -= 1
        else:
            upstream = self._upstream()
        self._running = running = LoaderStages(self._stages, self.dataset.seed, epoch)
        if loader_state is not None:
            running.load(loader_state)
        self._drained = drained

        def feed() -> Iterator:
            yield from upstream
            self._drained = True  # what follows comes from the buffers only

        try:
            yield from running.run(feed())
        finally:
            close = getattr(upstream, "close", None)
            if close is not None:
                close()
        self._running = None
        self._drained = False

    def _upstream(self) -> Iterator:
        self.dataset._check_streams(self.dataset._rank_world()[1], self._streams)
        group = self.transfer_group
        if self._kept is not None and self._resume is None and self._kept[2] == group:
            # persistent workers: the next epoch (or this one again after a break)
            self._consumed, self._next, self._group = [0] * self._streams, 0, group
            self._errors = [0] * self._streams
            yield from self._read(*self._kept[:2])
            return
        ds = copy.copy(self.dataset)
        ds._fixed_epoch = self.epoch
        ds._tagged = True
        if self.dataset.equalize is not None:
            ds.ensure_shard_sizes()
            self.dataset.shard_sizes = ds.shard_sizes
        if self._resume is not None:
            ds.load_state_dict(self._resume)
            consumed = list(self._resume["consumed"])
            errors = [int(e) for e in self._resume.get("errors", [0] * self._streams)]
            first = int(self._resume["next"])
            if self.num_workers:  # states without the key are from per-item transfer
                group = int(self._resume.get("transfer_group", 1))
            self._resume = None
        else:
            consumed, first, errors = [0] * self._streams, 0, [0] * self._streams
        ds._group = group
        self._consumed, self._next, self._group = consumed, first, group
        self._errors = errors
        ds._arena = self._arena()
        # the groups travel as they are (DataLoader's default_convert would turn the items'
        # tuples into lists); collate_fn= was applied in the workers' pipeline
        if self.persistent_workers:
            # the workers keep their dataset copy: its epoch comes through its own epoch cell
            ds._fixed_epoch = None
            ds._cell = _EpochCell()
            ds._live = None
        loader = DataLoader(ds, batch_size=None, num_workers=self.num_workers,
                            collate_fn=_as_is, persistent_workers=self.persistent_workers,
                            **self.kwargs)
        self._kept = (loader, ds, group) if self.persistent_workers else None
        yield from self._read(loader, ds)

    def _read(self, loader: DataLoader, ds: ShardDataset) -> Iterator:
        """One epoch of ``loader``'s groups, handed out item by item and counted."""
        if self.persistent_workers:
            ds.set_epoch(self.epoch)  # through the copy's epoch cell, into the workers
        consumed = self._consumed
        arena = ds._arena
        n = self._streams
        try:
            for stream, errors, group in loader:
                items = arena.unpack(stream, group) if arena is not None else group
                last = len(group) - 1
                after = (stream + 1) % n
                for i, item in enumerate(items):
                    # count what the loop is handed, not what arrived: until the group's last
                    # item is handed out, this stream still delivers next
                    consumed[stream] += 1
                    self._errors[stream] = errors[i]
                    self._next = stream if i < last else after
                    yield item
        finally:
            if arena is not None:
                arena.close()  # the workers' mappings go with them
        self.epoch += 1
        self._consumed, self._next = [0] * n, 0
        self._group = self.transfer_group
