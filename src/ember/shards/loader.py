"""ShardLoader: a DataLoader wrapper over a ShardDataset that tracks what the training loop
consumed (items handed out per reading stream, error counts, the loader-level stages' buffers), so
that ``state_dict()`` is exact with several workers; items travel from the workers in groups,
their large bytes values through shared memory.
"""

from __future__ import annotations

import copy
import multiprocessing
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

from ember.shards import stages
from ember.shards.checks import integer
from ember.shards.rebatch import LoaderStages
from ember.shards.resume import STATE_VERSION
from ember.shards.transfer import TransferArena

if TYPE_CHECKING:
    from ember.shards.dataset import ShardDataset

__all__ = ["DEFAULT_TRANSFER_GROUP", "DEFAULT_TRANSFER_MEMORY", "ShardLoader"]

DEFAULT_TRANSFER_GROUP = 128  # items per worker-to-main-process transfer in ShardLoader
DEFAULT_TRANSFER_MEMORY = 16 << 20  # bytes per shared-memory transfer slot in ShardLoader


def _as_is(item: Any) -> Any:
    return item


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
        num_workers = integer(num_workers, "num_workers", minimum=0)
        transfer_memory = integer(transfer_memory, "transfer_memory", minimum=0)
        if transfer_group is not None:
            transfer_group = integer(transfer_group, "transfer_group", minimum=1)
        self.persistent_workers = bool(kwargs.pop("persistent_workers", False))
        if self.persistent_workers and num_workers < 1:
            raise ValueError("persistent_workers=True needs num_workers >= 1")
        self._kept: tuple | None = None  # persistent workers: (DataLoader, copy, group, arena)
        if batch_size is not None:
            # as DataLoader's batch_size: batches made in the workers, collated by collate_fn
            batch_size = integer(batch_size, "batch_size", minimum=1)
            dataset = dataset.batched(batch_size, collation_fn=collate_fn or
                                      stages.default_collate, partial=not drop_last)
        elif collate_fn is not None:
            # as DataLoader with batch_size=None: applied to every item, in the workers
            dataset = dataset.map(collate_fn)
        elif drop_last:
            raise ValueError("drop_last=True needs batch_size= (or dataset.batched(n, "
                             "partial=False))")
        self.transfer_memory = transfer_memory
        self.dataset = dataset
        self.num_workers = num_workers
        if self.num_workers == 0:
            self.transfer_group = 1  # nothing to transfer
        elif transfer_group is not None:
            self.transfer_group = transfer_group
        elif any(stage.ray_scope == "final" for stage in dataset.stages):  # batches go alone
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
        self._stages: list[stages.Stage] = []  # loader-level stages
        self._running: LoaderStages | None = None  # this epoch's loader-level stages
        self._drained = False  # the loader-level stages are emptying after the workers ended
        self.length: int | None = None

    # ---- loader-level stages (main process, over all workers' items) -----------------------

    def _with(self, stage: stages.Stage) -> ShardLoader:
        if not stage.loader_level:
            raise ValueError(f"{stage.name}() runs in the dataset's reading streams, not at the "
                             "loader level")
        out = copy.copy(self)
        out._stages = self._stages + [stage]
        out.length = None
        out._kept = None  # a loader of its own: its own persistent workers
        return out

    def unbatched(self) -> ShardLoader:
        """Split every item (a batch from the workers) into its samples."""
        return self._with(stages.Unbatched())

    def shuffle(self, bufsize: int) -> ShardLoader:
        """Shuffle items across workers through a buffer of ``bufsize`` (reproducible per seed
        and epoch; the buffer is part of state_dict())."""
        return self._with(stages.Shuffle(integer(bufsize, "bufsize", minimum=1)))

    def batched(self, batchsize: int, collation_fn: Callable | None = stages.default_collate,
                partial: bool = True) -> ShardLoader:
        """Group items into batches of ``batchsize`` in the main process (across workers)."""
        return self._with(stages.Batched(batchsize, collation_fn, partial))

    def with_length(self, n: int) -> ShardLoader:
        """Declare how many items an epoch of this loader yields: ``len()`` returns it."""
        n = integer(n, "n", minimum=0)
        out = copy.copy(self)
        out.length = n
        out._kept = None
        return out

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (from its start); epochs also advance by
        themselves when an iteration reaches the end."""
        self.epoch = integer(epoch, "epoch", minimum=0)
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
            state["loader_epoch"] = True  # "epoch" is the epoch being drained, not the next one
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state`` on the next iteration (the rest of that epoch uses the state's
        transfer group size, so the order is the uninterrupted run's)."""
        if int(state["num_workers"]) != self._streams:
            raise ValueError(f"state was saved with {state['num_workers']} workers, this loader "
                             f"has {self._streams}")
        if bool(self._stages) != ("loader_stages" in state):
            raise ValueError("state and loader differ in having loader-level stages")
        resume = self.dataset.check_state(state)
        self.epoch = int(state["epoch"])
        if state.get("loader_drained") and "loader_epoch" not in state:
            self.epoch -= 1  # saved by an older ember while draining: it named the next epoch
        self._resume = dict(state)
        self._errors = list(resume["errors"])  # error_count continues from the state
        self._kept = None  # persistent workers hold the old position: start new ones

    def _start_method(self) -> str:
        """How the workers start: ``multiprocessing_context=``, else the default."""
        context = self.kwargs.get("multiprocessing_context")
        get = getattr(context, "get_start_method", None)
        method = get() if get is not None else context
        # (the first method listed is the platform's default)
        return method or multiprocessing.get_start_method(allow_none=True) \
            or multiprocessing.get_all_start_methods()[0]

    def _arena(self) -> TransferArena | None:
        """Shared memory for this epoch's groups, where workers are forked and it is wanted."""
        if (not self.num_workers or not self.transfer_memory or self.transfer_group == 1
                or self.persistent_workers):
            return None  # (an arena lives for one epoch's workers)
        if not TransferArena.supported(self._start_method()):
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
            self.epoch += 1
            return
        resume = self._resume
        loader_state = resume.get("loader_stages") if resume is not None else None
        drained = bool(resume.get("loader_drained")) if resume is not None else False
        epoch = self.epoch
        if drained:  # the workers had finished: only the buffers are left of that epoch
            self._resume = None
            upstream: Iterator = iter(())
        else:
            upstream = self._upstream()
        self._running = running = LoaderStages(self._stages, self.dataset.seed, epoch,
                                                     self.dataset.generator)
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
        self.epoch = epoch + 1  # a full pass: the workers' items and the buffers they filled

    def _upstream(self) -> Iterator:
        self.dataset.check_streams(self._streams)
        group = self.transfer_group
        if self._kept is not None and self._resume is None and self._kept[2] == group:
            # persistent workers: the next epoch (or this one again after a break)
            self._consumed, self._next, self._group = [0] * self._streams, 0, group
            self._errors = [0] * self._streams
            yield from self._read(self._kept[0], self._kept[1], self._kept[3])
            return
        if self.dataset.equalize is not None:
            self.dataset.ensure_shard_sizes()  # once, here, not in every worker
        if self.num_workers and self._start_method() != "fork":
            self.dataset.openers.check_picklable()  # the workers unpickle the dataset
        resume = None
        if self._resume is not None:
            resume = self.dataset.check_state(self._resume)
            consumed, errors, first = resume["consumed"], resume["errors"], resume["next"]
            if self.num_workers:  # states without the key are from per-item transfer
                group = int(self._resume.get("transfer_group", 1))
            self._resume = None
        else:
            consumed, first, errors = [0] * self._streams, 0, [0] * self._streams
        self._consumed, self._next, self._group = consumed, first, group
        self._errors = errors
        arena = self._arena()
        # the workers' copy: its epoch fixed (persistent workers: through its own epoch cell),
        # its items sent in groups through the arena, continuing at the resume point
        state = self.dataset.state.for_loader(self.epoch, group, arena, resume,
                                              self.persistent_workers)
        ds = self.dataset.with_state(state)
        # the groups travel as they are (DataLoader's default_convert would turn the items'
        # tuples into lists); collate_fn= was applied in the workers' pipeline
        loader = DataLoader(ds, batch_size=None, num_workers=self.num_workers,
                            collate_fn=_as_is, persistent_workers=self.persistent_workers,
                            **self.kwargs)
        self._kept = (loader, ds, group, arena) if self.persistent_workers else None
        yield from self._read(loader, ds, arena)

    def _read(self, loader: DataLoader, ds: ShardDataset, arena: TransferArena | None
              ) -> Iterator:
        """One epoch of ``loader``'s groups, handed out item by item and counted."""
        if self.persistent_workers:
            ds.set_epoch(self.epoch)  # through the copy's epoch cell, into the workers
        consumed = self._consumed
        n = self._streams
        try:
            for stream, errors, group in loader:
                if not group:  # the stream's final error count, after its last item
                    self._errors[stream] = errors[0]
                    continue
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
        # the epoch moves on when the loader's pass ends (__iter__), after any loader-level
        # stages have drained their buffers
        self._consumed, self._next = [0] * n, 0
        self._group = self.transfer_group
