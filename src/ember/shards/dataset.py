"""ShardDataset: an IterableDataset over WebDataset-format shards with a fluent stage pipeline
(``shuffle``, ``decode``, ``map``, ``batched``, ...), deterministic per-epoch shuffling and
splitting over ranks and workers, ``with_epoch``/``equalize``/``resampled`` streams, and exact
mid-epoch resumption (``state_dict``).

The parts it is built from live beside it: :mod:`ember.shards.reading` (raw samples of a shard,
rank and world, the error policy), :mod:`ember.shards.resume` (the epoch cell, positions and the
index-based seek) and :mod:`ember.shards.loader` (:class:`ShardLoader`). Their names are
re-exported here, so ``from ember.shards.dataset import ShardLoader`` keeps working.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

# DataLoader's worker loop seeds numpy.random: loaded here, forked workers inherit it instead of
# each importing it every epoch, an import that has failed in a forked worker inside importlib's
# module locks (KeyError in _lock_unlock_module)
import numpy.random  # noqa: F401
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ember.shards import plan, stages
from ember.shards.checks import integer
from ember.shards.decode import Decoder
from ember.shards.errors import ShardError
from ember.shards.index import read_index

# DEFAULT_TRANSFER_* and _shard_from moved; re-exported for code that imports them from here
from ember.shards.loader import DEFAULT_TRANSFER_GROUP, DEFAULT_TRANSFER_MEMORY, ShardLoader  # noqa: F401
from ember.shards.reading import _ErrorPolicy, _samples, _shard_from, iter_shard, rank_and_world  # noqa: F401
from ember.shards.resume import (  # noqa: F401 (STATE_VERSION: re-exported)
    _END,
    STATE_VERSION,
    StreamState,
    _around_skipped,
    _collate_unless_skipped,
    _Delivered,
    _IndexedLayout,
    _NoIndex,
    _Position,
    _Skipped,
    _SkippingReader,
    check_state,
)
from ember.shards.urls import Openers, UrlOptions, as_list, local_path, open_url, url_options_from

__all__ = ["ShardDataset", "ShardLoader", "iter_shard", "rank_and_world"]


_AUTO = "auto"
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
    ``generator`` (optional): an ember.csprng generator draws the shard orders and shuffles from
    its own substreams (``fold_in``; ``seed`` then does not enter the draws, and the generator
    given is neither copied nor advanced); a torch.Generator is the type of generator to draw
    with, seeded from ``seed`` for every draw stream.

    Epochs: every new iteration (direct, or one DataLoader epoch, with or without persistent
    workers) uses the epoch after the previous one, starting at 0; ``set_epoch(e)`` makes the next
    one use ``e``. ``resampled=True`` draws each stream's shards with replacement, endlessly (cut
    epochs with ``with_epoch``). ``nodesplitter``/``workersplitter``: ``"auto"`` deals the
    epoch's shard order over ``world x workers`` streams; ``None`` does not split over ranks
    (a URL list already split per rank) or workers; a callable is a webdataset-style splitter.
    ``url_options``: how URLs are opened (timeouts, retries, ``pipe:``, S3, ``cache_dir``; see
    :class:`UrlOptions`); its fields given as keywords of their own still work, deprecated.
    """

    def __init__(self, urls: str | Sequence, *, shuffle_shards: bool = True, seed: int = 0,
                 generator: torch.Generator | None = None, rank: int | None = None,
                 world_size: int | None = None, on_error: str | Callable = "raise",
                 equalize: str | None = None, shard_sizes: Sequence[int] | None = None,
                 url_options: UrlOptions | None = None, resampled: bool = False,
                 nodesplitter: str | Callable | None = _AUTO,
                 workersplitter: str | Callable | None = _AUTO, **deprecated: Any):
        super().__init__()
        self.urls = as_list(urls)
        _check_splitting(nodesplitter, workersplitter, resampled, equalize)
        self.nodesplitter, self.workersplitter = nodesplitter, workersplitter
        self.resampled = bool(resampled)
        self.shuffle_shards = shuffle_shards
        self.seed = integer(seed, "seed")
        # an OS-keyed generator differs in every process: ranks cannot agree on shard orders
        self._keyed_here = generator is not None and getattr(generator, "reproducible", True) \
            is False
        self.generator = plan.own_stream(generator)
        if world_size is not None:
            world_size = integer(world_size, "world_size", minimum=1)
        if rank is not None:
            rank = integer(rank, "rank", minimum=0)
        self.rank, self.world_size = rank, world_size
        _ErrorPolicy(on_error)  # validates on_error
        self.on_error = on_error
        self.equalize = equalize
        self.shard_sizes = _checked_sizes(shard_sizes, len(self.urls))
        self.options = url_options_from(url_options, deprecated)
        # registered openers of these URLs' schemes travel with the pickled dataset
        self.openers = Openers(self.urls)
        self.stages: list[stages.Stage] = []
        self.length: int | None = None
        self.epoch_length: int | None = None
        self._state = StreamState(on_error)

    def __copy__(self) -> ShardDataset:
        return self._bound_to(self._state.fork())

    def _bound_to(self, state: StreamState) -> ShardDataset:
        out = self.__class__.__new__(self.__class__)
        out.__dict__.update(self.__dict__)
        out._state = state
        return out

    @property
    def state(self) -> StreamState:
        """Where iteration of this pipeline stands (epoch, position, a loaded state): see
        :class:`ember.shards.resume.StreamState`."""
        return self._state

    def with_state(self, state: StreamState) -> ShardDataset:
        """A copy of this pipeline whose iteration is owned by ``state`` (a loader gives its
        DataLoader workers such a copy: ``state.for_loader(...)``)."""
        return self._bound_to(state)

    @property
    def error_count(self) -> int:
        """Errors skipped so far in the current (or last) direct iteration, as on_error and the
        stage handlers counted them (continued from a loaded state)."""
        return self._state.pos.policy.count

    @property
    def epoch(self) -> int:
        """The epoch the next iteration uses."""
        return self._state.next_epoch

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("this ShardDataset has no length: declare it with with_length(n) "
                            "(the number of items one epoch yields on this rank)")
        return self.length

    def with_length(self, n: int) -> ShardDataset:
        """Declare that an epoch yields ``n`` items on this rank: ``len()`` returns it (as
        webdataset's with_length, it is not enforced; ``with_epoch`` is)."""
        n = integer(n, "n", minimum=0)
        out = copy.copy(self)
        out.length = n
        return out

    def _with(self, stage: stages.Stage) -> ShardDataset:
        if not stage.dataset_level:
            raise ValueError(f"{stage.name}() runs at the loader level: use "
                             f"ShardLoader(...).{stage.name}()")
        out = copy.copy(self)
        out.stages = self.stages + [stage]
        return out

    def shuffle(self, bufsize: int, initial: int | None = None) -> ShardDataset:
        """Shuffle samples through a buffer of ``bufsize`` (reproducible per seed and epoch)."""
        return self._with(stages.Shuffle(bufsize, initial))

    def decode(self, *handlers: str | Callable, only: str | list[str] | None = None,
               allow_pickle: bool = False, max_pixels: int | None = 89_478_485,
               handler: Callable[[Exception], Any] | None = None) -> ShardDataset:
        """Decode fields by extension; image specs (``"pil"``, ``"rgb8"``, ``"torchrgb"``, ...)
        and handler callables ``(ext, data) -> value or None`` are tried first.

        Without ``handler``, a DecodeError goes to the dataset's ``on_error``; with it, any
        exception while decoding a sample goes to ``handler`` (see :meth:`map`)."""
        decoder = Decoder(*handlers, only=only, allow_pickle=allow_pickle, max_pixels=max_pixels)
        return self._with(stages.Decode(decoder, handler))

    def map(self, fn: Callable[[Any], Any], *,
            handler: Callable[[Exception], Any] | None = None) -> ShardDataset:
        """Apply ``fn`` to every item.

        ``handler`` (as in webdataset) gets any exception raised for an item: it returns True to
        skip the item, False to end the stream, or raises (``reraise_exception``,
        ``warn_and_continue``, ``ignore_and_continue``, ``warn_and_stop``). Skipped items are
        counted in ``error_count``. Default: the exception propagates."""
        return self._with(stages.Map(fn, handler))

    def map_dict(self, *, handler: Callable[[Exception], Any] | None = None,
                 **fns: Callable) -> ShardDataset:
        """Apply ``fns[field]`` to those fields of every sample dict (``handler`` as in map)."""
        return self._with(stages.MapDict(fns, handler))

    def map_tuple(self, *fns: Callable | None,
                  handler: Callable[[Exception], Any] | None = None) -> ShardDataset:
        """Apply ``fns[i]`` to element ``i`` of every tuple item; None keeps the element
        (``handler`` as in map)."""
        return self._with(stages.MapTuple(fns, handler))

    def rename(self, keep: bool = True, **renames: str) -> ShardDataset:
        """Rename fields, ``new="old1;old2"`` (first present); ``keep=False`` drops the others."""
        return self._with(stages.Rename(renames, keep))

    def select(self, predicate: Callable[[Any], bool]) -> ShardDataset:
        """Keep items for which ``predicate(item)`` is true."""
        return self._with(stages.Select(predicate))

    def to_tuple(self, *fields: str, missing_ok: bool = False,
                 handler: Callable[[Exception], Any] | None = None) -> ShardDataset:
        """Turn dicts into tuples: ``to_tuple("jpg;png cls")`` -> (jpg or png, cls)
        (``handler`` as in map, e.g. to skip samples missing a field)."""
        return self._with(stages.ToTuple(fields, missing_ok, handler))

    def slice(self, *args: int | None) -> ShardDataset:
        """``itertools.islice`` on each reading stream: ``slice(stop)`` or
        ``slice(start, stop[, step])`` (per pass, per rank x worker stream)."""
        return self._with(stages.Slice(*args))

    def rsample(self, p: float = 0.5) -> ShardDataset:
        """Keep each item with probability ``p``, drawn from the pipeline's generator
        (reproducible per seed and epoch, and resumed exactly)."""
        return self._with(stages.RSample(p))

    def batched(self, batchsize: int, collation_fn: Callable | None = stages.default_collate,
                partial: bool = True) -> ShardDataset:
        """Group items into batches of ``batchsize`` (collated by ``collation_fn``, or lists if
        None); each worker's last batch may be short unless ``partial=False``."""
        return self._with(stages.Batched(batchsize, collation_fn, partial))

    def with_epoch(self, n: int) -> ShardDataset:
        """Make every epoch yield exactly ``n`` items per reading stream (rank x worker).

        Each stream is the endless succession of its ordinary passes (pass ``q`` ordered and
        shuffled as epoch ``q`` would be); epoch ``e`` is items ``[e*n, (e+1)*n)`` of it, so each
        epoch continues where the previous one stopped. With ``resampled=True``, epoch ``e`` is
        the first ``n`` items of that epoch's own draws."""
        n = integer(n, "n", minimum=1)
        out = copy.copy(self)
        out.epoch_length = n
        return out

    # ---- epochs and state ------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shard order and shuffle are used by the next iteration (also
        by DataLoader workers, persistent ones included)."""
        self._state.set_epoch(integer(epoch, "epoch", minimum=0))

    def state_dict(self) -> dict:
        """The position of direct (main-process) iteration: load it to continue exactly there."""
        return self._state.position(self.epoch, len(self.urls), self.seed)

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (from this class's or ShardLoader's state_dict())."""
        self._state.load(self.check_state(state))

    def check_state(self, state: dict) -> dict:
        """The resume point of ``state`` (from this class's or ShardLoader's state_dict()):
        epoch, items consumed, errors counted per reading stream, the stream that delivers next;
        ValueError if it is not a state of this pipeline."""
        return check_state(state, self.seed, len(self.urls))

    # ---- reading ---------------------------------------------------------------------------

    def _generator(self, *path: int | str) -> torch.Generator:
        """The generator of one draw stream (see plan.draw_generator)."""
        return plan.draw_generator(self.seed, self.generator, *path)

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

    def _shard_samples(self, urls: Iterable[str], policy: _ErrorPolicy) -> Iterator[dict]:
        for url in urls:
            try:
                yield from _samples(open_url(url, self.options), url)  # iter_shard, inlined
            except ShardError as exc:
                policy(exc)

    def _draws(self, epoch: int, rank: int, world: int, worker: int,
               num_workers: int) -> Iterator[str]:
        """resampled=True: the stream's endless shard draws, with replacement, uniform over the
        shard list, from (seed, epoch, rank, world, worker, num_workers)."""
        g = self._generator("resample", epoch, rank, world, worker, num_workers)
        n = len(self.urls)
        while True:
            for i in torch.randint(n, (256,), generator=g).tolist():
                yield self.urls[i]

    def _stream_urls(self, epoch: int, rank: int, world: int, worker: int, num_workers: int,
                     borrow: bool) -> list[str]:
        """The shards one stream reads in one ordinary pass; ``borrow``: a stream left without
        shards reads one chosen from its position instead (so that it has items to give)."""
        g = self.generator
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
                urls = _split_with(cast(Callable, self.nodesplitter), urls, "nodesplitter")
            if self.workersplitter == _AUTO:
                urls = urls[worker::num_workers]
            elif self.workersplitter is not None:
                urls = _split_with(cast(Callable, self.workersplitter), urls,
                                   "workersplitter")
        if not urls and borrow:
            order = plan.shard_order(len(self.urls), seed=self.seed, epoch=epoch,
                                     shuffle=self.shuffle_shards, generator=self.generator)
            urls = [self.urls[order[plan.stream_index(rank, world, worker, num_workers)
                                    % len(order)]]]
        return urls

    def _raw(self, epoch: int, rank: int, world: int, worker: int, num_workers: int, pass_: int,
             read: Callable[[Iterable[str]], Iterator], quota: int | None) -> Iterator:
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
        def draw(i: int) -> torch.Generator:
            return self._generator("samples", epoch, pass_, rank, world, worker, num_workers, i)

        ctx = stages.StageContext(draw, policy,
                                  collate=_collate_unless_skipped if skipping else None)
        for i, stage in enumerate(self.stages):
            if skipping and stage.one_to_one:
                src = _around_skipped(src, _running(stage, ctx, i))
            else:
                src = stage.run(src, ctx, i)
        return src

    def _pass(self, epoch: int, rank: int, world: int, worker: int, num_workers: int,
              policy: _ErrorPolicy, read: Callable, skipping: bool) -> Iterator:
        """One ordinary pass of a stream (endless with resampled=True), through the stages."""
        quota = None
        if self.equalize is not None:
            quota = plan.equal_quotas(self.ensure_shard_sizes(), seed=self.seed, epoch=epoch,
                                      world=world, num_workers=num_workers, mode=self.equalize,
                                      shuffle=self.shuffle_shards,
                                      generator=self.generator)[worker]
            if quota == 0 and self.epoch_length is not None:
                quota = None  # with_epoch gives the stream its items: read its (borrowed) shards
        raw = self._raw(epoch, rank, world, worker, num_workers, 0, read, quota)
        return self._pipeline(raw, epoch, rank, world, worker, num_workers, 0, policy, skipping)

    def _items(self, epoch: int, rank: int, world: int, worker: int, num_workers: int,
               policy: _ErrorPolicy, read: Callable[[Iterable[str]], Iterator] | None = None,
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
        return not any(stage.counts_depend_on_content(self.on_error) for stage in self.stages)

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
                delivered.add(cast(_Skipped, item).positions)
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

    def check_streams(self, num_workers: int) -> None:
        """Warn (once per dataset) when some of the ``world x num_workers`` reading streams get
        no shard and nothing evens that out."""
        self._check_streams(self._rank_world()[1], num_workers)

    def _check_streams(self, world: int, num_workers: int) -> None:
        if (self.resampled or self.nodesplitter != _AUTO or self.workersplitter != _AUTO
                or self.equalize == "repeat" or self.epoch_length is not None
                or len(self.urls) >= world * num_workers or self._state.warned_streams):
            return
        self._state.warned_streams = True
        warnings.warn(f"{len(self.urls)} shards for {world * num_workers} reading streams "
                      f"({world} ranks x {num_workers} workers): some streams get no shard, so "
                      "ranks and workers are uneven; use more shards or fewer workers, or "
                      "equalize='repeat', with_epoch(n) or resampled=True", stacklevel=3)

    def _rank_world(self) -> tuple[int, int]:
        if self.nodesplitter is None:
            return 0, 1  # the URL list is this rank's own
        rank, world = rank_and_world(self.rank, self.world_size)
        if world > 1 and self._keyed_here:
            raise ValueError(f"generator= is keyed from the OS, so each of the {world} ranks "
                             "draws another shard order and they would read overlapping "
                             "shards; give every rank a generator with the same key "
                             "(ember.csprng.create_generator(seed)), or nodesplitter=None with "
                             "each rank's own URL list")
        return rank, world

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        st = self._state
        epoch = st.begin(info)
        physical, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rank, world = self._rank_world()
        resume = st.take_resume()
        if physical == 0 and not st.tagged:
            self._check_streams(world, num_workers)
        worker, skip, counted = self._resume_point(resume, epoch, physical, num_workers)
        start, end = self._epoch_span(epoch)
        limit = None if end is None else end - start - skip
        continued = end is not None and not self.resampled
        where = (rank, world, worker, num_workers)
        items, policy, ahead, seeking = self._open(epoch, where, start + skip, continued)
        full = items
        keep = False
        st.running = epoch
        try:
            if not _fast_forward(items, ahead, seeking):
                return
            if counted is not None:
                policy.count = counted  # whatever fast-forwarding counted, the run had these
            pos = st.pos = _Position(skip, policy)
            if st.tagged:
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
            st.running = None
            pos.consumed = 0
            if continued:
                st.live = (where + (end,), full, policy)
                keep = True
        finally:
            if not keep:
                getattr(full, "close", lambda: None)()

    def _epoch_span(self, epoch: int) -> tuple[int, int | None]:
        """Where ``epoch``'s items begin and end in a reading stream (end None: at the end of
        the pass). with_epoch(n): items ``[epoch * n, (epoch + 1) * n)`` of the stream's endless
        succession of passes, or with resampled=True the first n of the epoch's own draws."""
        n = self.epoch_length
        if n is None:
            return 0, None
        return (0, n) if self.resampled else (epoch * n, (epoch + 1) * n)

    def _resume_point(self, resume: dict | None, epoch: int, physical: int,
                      num_workers: int) -> tuple[int, int, int | None]:
        """The reading stream a DataLoader worker runs, the items of it already delivered, and
        the errors counted before them (None: not resuming)."""
        if resume is None or resume["epoch"] != epoch:
            return physical, 0, None
        if resume["num_workers"] != num_workers:
            raise ValueError(f"state was saved with {resume['num_workers']} reading workers, "
                             f"resuming with {num_workers}")
        if resume["next"] and callable(self.workersplitter):
            raise ValueError("cannot resume this state with a custom workersplitter: the "
                             "state's next stream is not worker 0 (use workersplitter='auto')")
        # DataLoader cycles workers from 0; rotate so the next stream to deliver comes first
        worker = (resume["next"] + physical) % num_workers
        return worker, resume["consumed"][worker], resume["errors"][worker]

    def _open(self, epoch: int, where: tuple[int, int, int, int], at: int,
              continued: bool) -> tuple[Iterator, _ErrorPolicy, int, bool]:
        """The items of stream ``where`` (rank, world, worker, num_workers) in ``epoch``, to be
        taken from position ``at``: (items, their error policy, how many items to pass over
        first, whether those are placeholders of an index-based seek)."""
        st = self._state
        live, st.live = st.live, None
        if continued and live is not None and live[0] == where + (at,):
            return live[1], live[2], 0, False  # the stream left off right here
        policy = _ErrorPolicy(self.on_error)
        items = self._resumed_items(epoch, *where, policy, at) if at else None
        if items is not None:
            return items, policy, at, True
        return self._items(epoch, *where, policy), policy, at, False

    def _groups(self, items: Iterator, worker: int, skip: int, seeking: bool,
                pos: _Position) -> Iterator[tuple[int, list[int], list]]:
        """A stream's items for ShardLoader, as ``(stream, error counts, items)`` groups of up to
        ``_group`` items. Groups end at multiples of ``_group`` stream positions, counted from the
        epoch's start (a resumed stream's first group is short), so a resumed loader interleaves
        the streams exactly as the uninterrupted one. Items already grouped when an error is
        raised are sent before it. With a transfer arena, their large bytes values go through
        shared memory."""
        size = self._state.group
        room = size - skip % size
        policy = pos.policy
        arena = self._state.arena
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
            last = errors[-1]
        else:
            last = None
        if policy.count and policy.count != last:
            # shards or samples skipped after the stream's last item: an empty group carries the
            # count (it hands out no item, so the order of the items is unchanged)
            yield worker, [policy.count], []


def _fluent(cls: type[stages.Stage]) -> Callable[..., ShardDataset]:
    """The fluent method of a stage class: ``ds.<name>(*args)`` appends ``cls.build(*args)``."""
    def method(self: ShardDataset, *args: Any, **kwargs: Any) -> ShardDataset:
        return self._with(cls.build(*args, **kwargs))

    method.__name__ = cls.name
    method.__qualname__ = f"ShardDataset.{cls.name}"
    method.__doc__ = cls.build.__doc__ if cls.build is not stages.Stage.build else cls.__doc__
    method.__signature__ = inspect.signature(cls.build)  # type: ignore[attr-defined]
    return method


def _add_fluent(cls: type[stages.Stage]) -> None:
    """Stage classes with a name and no method written out above get theirs."""
    if cls.dataset_level and not hasattr(ShardDataset, cls.name):
        setattr(ShardDataset, cls.name, _fluent(cls))


stages.on_register(_add_fluent)


def _running(stage: stages.Stage, ctx: stages.StageContext, index: int
             ) -> Callable[[Iterator], Iterator]:
    """``stage`` as a function of its input, as stage ``index`` run by ``ctx``."""
    return lambda src: stage.run(src, ctx, index)


def _fast_forward(items: Iterator, ahead: int, seeking: bool) -> bool:
    """Pass over the first ``ahead`` items (placeholders, if ``seeking``); False if the stream
    ended first."""
    for _ in range(ahead):
        item = next(items, _END)
        if item is _END:
            return False
        if seeking and not isinstance(item, _Skipped):
            raise RuntimeError("index-based resume went out of step (a bug in ember)")
    return True


def _check_splitting(nodesplitter: Any, workersplitter: Any, resampled: bool,
                     equalize: str | None) -> None:
    for name, fn in (("nodesplitter", nodesplitter), ("workersplitter", workersplitter)):
        if fn is not None and fn != _AUTO and not callable(fn):
            raise ValueError(f"expected {name}='auto', None or a callable, got {fn!r}")
    if equalize not in (None, "drop", "repeat"):
        raise ValueError(f"expected equalize=None, 'drop' or 'repeat', got {equalize!r}")
    if resampled and equalize is not None:
        raise ValueError("equalize= does not apply to resampled=True (every stream is endless;"
                         " use with_epoch(n) to give every stream n items per epoch)")
    custom = nodesplitter != _AUTO or workersplitter != _AUTO
    if custom and equalize is not None:
        raise ValueError("equalize= needs ember's own splitting (nodesplitter='auto', "
                         "workersplitter='auto'): with other splitters a rank cannot know "
                         "what the other ranks read")


def _checked_sizes(shard_sizes: Sequence[int] | None, num_shards: int) -> list[int] | None:
    if shard_sizes is None:
        return None
    sizes = [integer(n, "shard_sizes entries", minimum=0) for n in shard_sizes]
    if len(sizes) != num_shards:
        raise ValueError(f"shard_sizes has {len(sizes)} entries for {num_shards} shards")
    return sizes

