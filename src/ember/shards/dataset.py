"""ShardDataset: an IterableDataset over WebDataset-format shards with a fluent stage pipeline,
deterministic per-epoch shuffling and splitting, and exact mid-epoch resumption; and ShardLoader,
a DataLoader wrapper that tracks what the training loop consumed so state_dict() is exact with
several workers.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ember.shards import plan, stages
from ember.shards.decode import Decoder
from ember.shards.errors import ShardError
from ember.shards.format import group_samples
from ember.shards.tar import iter_members, open_tar_source
from ember.shards.urls import UrlOptions, as_list, open_url

__all__ = ["ShardDataset", "ShardLoader", "iter_shard", "rank_and_world"]

STATE_VERSION = 1


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
    stream = open_url(url, options)
    try:
        src = open_tar_source(stream, url)
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
    """

    def __init__(self, urls: str | Sequence, *, shuffle_shards: bool = True, seed: int = 0,
                 generator: torch.Generator | None = None, rank: int | None = None,
                 world_size: int | None = None, on_error: str | Callable = "raise",
                 equalize: str | None = None, shard_sizes: Sequence[int] | None = None,
                 timeout: float = 60.0, retries: int = 5, allow_pipe: bool = False,
                 s3_endpoint: str | None = None):
        super().__init__()
        self.urls = as_list(urls)
        self.shuffle_shards = shuffle_shards
        self.seed = int(seed)
        self.generator = generator
        self.rank, self.world_size = rank, world_size
        _ErrorPolicy(on_error)  # validate early
        self.on_error = on_error
        if equalize not in (None, "drop", "repeat"):
            raise ValueError(f"expected equalize=None, 'drop' or 'repeat', got {equalize!r}")
        self.equalize = equalize
        if shard_sizes is not None and len(shard_sizes) != len(self.urls):
            raise ValueError(f"shard_sizes has {len(shard_sizes)} entries for {len(self.urls)} "
                             "shards")
        self.shard_sizes = list(shard_sizes) if shard_sizes is not None else None
        self.options = UrlOptions(timeout=timeout, retries=retries, allow_pipe=allow_pipe,
                                  s3_endpoint=s3_endpoint)
        self.stages: list[tuple[str, tuple]] = []
        self.epoch = 0
        self.epoch_length: int | None = None
        self.error_count = 0
        self._resume: dict | None = None
        self._consumed = 0
        self._tagged = False

    # ---- fluent pipeline -------------------------------------------------------------------

    def _with(self, kind: str, *payload) -> ShardDataset:
        out = copy.copy(self)
        out.stages = self.stages + [(kind, payload)]
        return out

    def shuffle(self, bufsize: int, initial: int | None = None) -> ShardDataset:
        """Shuffle samples through a buffer of ``bufsize`` (reproducible per seed and epoch)."""
        return self._with("shuffle", int(bufsize), initial)

    def decode(self, *handlers: str | Callable, only: str | list[str] | None = None,
               allow_pickle: bool = False, max_pixels: int | None = 89_478_485) -> ShardDataset:
        """Decode fields by extension; image specs (``"pil"``, ``"rgb8"``, ``"torchrgb"``, ...)
        and handler callables ``(ext, data) -> value or None`` are tried first."""
        decoder = Decoder(*handlers, only=only, allow_pickle=allow_pickle, max_pixels=max_pixels)
        return self._with("decode", decoder)

    def map(self, fn: Callable[[Any], Any]) -> ShardDataset:
        """Apply ``fn`` to every item."""
        return self._with("map", fn)

    def map_dict(self, **fns: Callable) -> ShardDataset:
        """Apply ``fns[field]`` to those fields of every sample dict."""
        return self._with("map_dict", fns)

    def rename(self, keep: bool = True, **renames: str) -> ShardDataset:
        """Rename fields, ``new="old1;old2"`` (first present); ``keep=False`` drops the others."""
        return self._with("rename", renames, keep)

    def select(self, predicate: Callable[[Any], bool]) -> ShardDataset:
        """Keep items for which ``predicate(item)`` is true."""
        return self._with("select", predicate)

    def to_tuple(self, *fields: str, missing_ok: bool = False) -> ShardDataset:
        """Turn dicts into tuples: ``to_tuple("jpg;png cls")`` -> (jpg or png, cls)."""
        return self._with("to_tuple", fields, missing_ok)

    def batched(self, batchsize: int, collation_fn: Callable | None = stages.default_collate,
                partial: bool = True) -> ShardDataset:
        """Group items into batches of ``batchsize`` (collated by ``collation_fn``, or lists if
        None); each worker's last batch may be short unless ``partial=False``."""
        return self._with("batched", int(batchsize), collation_fn, partial)

    def with_epoch(self, n: int) -> ShardDataset:
        """Make every epoch yield exactly ``n`` items per reading stream (rank x worker): the
        stream is cut after ``n`` items or restarted (a new shuffled pass) until it has ``n``."""
        out = copy.copy(self)
        out.epoch_length = int(n)
        return out

    # ---- epochs and state ------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shard order and shuffle are used by the next iteration."""
        self.epoch = int(epoch)

    def state_dict(self) -> dict:
        """The position of direct (main-process) iteration: load it to continue exactly there."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "seed": self.seed,
                "num_workers": 1, "consumed": [self._consumed], "next": 0,
                "num_shards": len(self.urls)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (from this class's or ShardLoader's state_dict())."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported shard state version {state.get('version')!r}")
        if state["seed"] != self.seed or state["num_shards"] != len(self.urls):
            raise ValueError(f"state is for seed={state['seed']} over {state['num_shards']} "
                             f"shards, this dataset has seed={self.seed} over {len(self.urls)}")
        self.epoch = int(state["epoch"])
        self._resume = {"epoch": self.epoch, "consumed": list(state["consumed"]),
                        "next": int(state["next"]), "num_workers": int(state["num_workers"])}
        self._consumed = 0

    # ---- reading ---------------------------------------------------------------------------

    def _generator_copy(self) -> torch.Generator | None:
        return copy.deepcopy(self.generator) if self.generator is not None else None

    def _generator(self, seed: int) -> torch.Generator:
        return plan.make_generator(seed, self._generator_copy())

    def ensure_shard_sizes(self) -> list[int]:
        """Sample counts of every shard (from shard_sizes, index files, or a header scan)."""
        if self.shard_sizes is None:
            from ember.shards.index import sample_count

            self.shard_sizes = [sample_count(u, self.options) for u in self.urls]
        return self.shard_sizes

    def _shard_samples(self, urls: list[str], policy: _ErrorPolicy) -> Iterator[dict]:
        for url in urls:
            try:
                yield from iter_shard(url, self.options)
            except ShardError as exc:
                policy(exc)

    def _raw(self, epoch: int, rank: int, world: int, worker: int, num_workers: int, pass_: int,
             policy: _ErrorPolicy, quota: int | None) -> Iterator[dict]:
        seed = self.seed if pass_ == 0 else plan.derive_seed(self.seed, "pass", pass_)
        g = self._generator_copy()
        idx = plan.worker_shards(len(self.urls), seed=seed, epoch=epoch, rank=rank, world=world,
                                 worker=worker, num_workers=num_workers,
                                 shuffle=self.shuffle_shards, generator=g)
        if quota is None:
            yield from self._shard_samples([self.urls[i] for i in idx], policy)
            return
        if not idx:  # an empty stream repeats a shard chosen from its position
            order = plan.shard_order(len(self.urls), seed=seed, epoch=epoch,
                                     shuffle=self.shuffle_shards, generator=g)
            idx = [order[plan.stream_index(rank, world, worker, num_workers) % len(order)]]
        n = 0
        while n < quota:
            before = n
            for sample in self._shard_samples([self.urls[i] for i in idx], policy):
                yield sample
                n += 1
                if n == quota:
                    return
            if n == before:
                raise ShardError(f"reading stream {rank}/{worker} has no readable samples to "
                                 "repeat for equalize='repeat'")

    def _pipeline(self, src: Iterator, epoch: int, rank: int, world: int, worker: int,
                  num_workers: int, pass_: int, policy: _ErrorPolicy) -> Iterator:
        for i, (kind, p) in enumerate(self.stages):
            if kind == "shuffle":
                g = self._generator(plan.derive_seed(self.seed, "samples", epoch, pass_, rank,
                                                     world, worker, num_workers, i))
                src = stages.shuffle(src, p[0], p[1], g)
            elif kind == "decode":
                src = stages.decode(src, p[0], policy)
            elif kind == "map":
                src = stages.map_samples(src, p[0])
            elif kind == "map_dict":
                src = stages.map_dict(src, p[0])
            elif kind == "rename":
                src = stages.rename(src, p[0], p[1])
            elif kind == "select":
                src = stages.select(src, p[0])
            elif kind == "to_tuple":
                src = stages.to_tuple(src, p[0], p[1])
            elif kind == "batched":
                src = stages.batched(src, p[0], p[1], p[2])
            else:  # pragma: no cover
                raise AssertionError(kind)
        return src

    def _items(self, epoch: int, rank: int, world: int, worker: int, num_workers: int,
               policy: _ErrorPolicy) -> Iterator:
        quota = None
        if self.equalize is not None:
            quota = plan.equal_quotas(self.ensure_shard_sizes(), seed=self.seed, epoch=epoch,
                                      world=world, num_workers=num_workers, mode=self.equalize,
                                      shuffle=self.shuffle_shards,
                                      generator=self._generator_copy())[worker]
        pass_ = 0
        left = self.epoch_length
        while True:
            raw = self._raw(epoch, rank, world, worker, num_workers, pass_, policy, quota)
            produced = 0
            for item in self._pipeline(raw, epoch, rank, world, worker, num_workers, pass_,
                                       policy):
                if left is not None:
                    if left == 0:
                        return
                    left -= 1
                produced += 1
                yield item
            if left is None or left == 0:
                return
            if produced == 0:
                raise ShardError(f"with_epoch({self.epoch_length}): reading stream rank {rank} "
                                 f"worker {worker} produced no items")
            pass_ += 1

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        physical, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rank, world = rank_and_world(self.rank, self.world_size)
        epoch = self.epoch
        resume = self._resume
        self._resume = None
        worker, skip = physical, 0
        if resume is not None and resume["epoch"] == epoch:
            if resume["num_workers"] != num_workers:
                raise ValueError(f"state was saved with {resume['num_workers']} reading workers, "
                                 f"resuming with {num_workers}")
            # DataLoader cycles workers from 0; rotate so the next stream to deliver comes first
            worker = (resume["next"] + physical) % num_workers
            skip = resume["consumed"][worker]
        policy = _ErrorPolicy(self.on_error)
        items = self._items(epoch, rank, world, worker, num_workers, policy)
        try:
            for _ in range(skip):
                if next(items, _END) is _END:
                    return
            self._consumed = skip
            tagged = self._tagged
            for item in items:
                self._consumed += 1
                self.error_count = policy.count
                yield (worker, policy.count, item) if tagged else item
            self.error_count = policy.count
            if info is None and not tagged:
                self.epoch = epoch + 1
                self._consumed = 0
        finally:
            items.close()


_END = object()


class ShardLoader:
    """A torch DataLoader over a ShardDataset that knows exactly what the loop has consumed.

    Batch with ``dataset.batched(n)``: this loader passes ``batch_size=None`` to DataLoader.
    ``state_dict()`` taken after receiving an item resumes at the next item, with any number of
    workers; iterating to the end advances the epoch.
    """

    def __init__(self, dataset: ShardDataset, *, num_workers: int = 0, **kwargs: Any):
        for bad in ("batch_size", "sampler", "batch_sampler", "shuffle"):
            if kwargs.get(bad) not in (None, False):
                raise ValueError(f"ShardLoader does not take {bad}=; use dataset.batched(n) and "
                                 "dataset.shuffle(n)")
            kwargs.pop(bad, None)
        if kwargs.get("persistent_workers"):
            raise ValueError("ShardLoader needs fresh workers each epoch: persistent_workers=False")
        self.dataset = dataset
        self.num_workers = int(num_workers)
        self.kwargs = kwargs
        self.epoch = dataset.epoch
        self._streams = max(1, self.num_workers)
        self._consumed = [0] * self._streams
        self._errors = [0] * self._streams
        self._next = 0
        self._resume: dict | None = None

    @property
    def error_count(self) -> int:
        """Shards/samples skipped by on_error in the current epoch, over all workers."""
        return sum(self._errors)

    def state_dict(self) -> dict:
        """Epoch, seed and items consumed per reading stream: enough to resume exactly."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "seed": self.dataset.seed,
                "num_workers": self._streams, "consumed": list(self._consumed),
                "next": self._next, "num_shards": len(self.dataset.urls)}

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state`` on the next iteration."""
        if int(state["num_workers"]) != self._streams:
            raise ValueError(f"state was saved with {state['num_workers']} workers, this loader "
                             f"has {self._streams}")
        probe = copy.copy(self.dataset)
        probe.load_state_dict(state)  # validates
        self.epoch = int(state["epoch"])
        self._resume = dict(state)

    def __len__(self) -> int:
        raise TypeError("ShardLoader has no length; use dataset.with_epoch(n) for fixed epochs")

    def __iter__(self) -> Iterator:
        ds = copy.copy(self.dataset)
        ds.set_epoch(self.epoch)
        ds._tagged = True
        if self.dataset.equalize is not None:
            ds.ensure_shard_sizes()
            self.dataset.shard_sizes = ds.shard_sizes
        if self._resume is not None:
            ds.load_state_dict(self._resume)
            consumed = list(self._resume["consumed"])
            first = int(self._resume["next"])
            self._resume = None
        else:
            consumed, first = [0] * self._streams, 0
        self._consumed, self._next = consumed, first
        self._errors = [0] * self._streams
        loader = DataLoader(ds, batch_size=None, num_workers=self.num_workers, **self.kwargs)
        n = self._streams
        for stream, errors, item in loader:
            consumed[stream] += 1
            self._errors[stream] = errors
            self._next = (stream + 1) % n
            yield item
        self.epoch += 1
        self._consumed, self._next = [0] * n, 0
