"""RayShardLoader: a ShardDataset pipeline run as Ray tasks across a cluster, its items delivered
to one training process per rank.

Each shard of a rank's epoch is read by one Ray task, which also runs the pipeline's per-sample
stages (decode, map, to_tuple, ...) and cuts full batches. The training process takes the tasks'
outputs in the order of the plan, not in the order they finish, so which samples a rank gets, and
in what order, are pure functions of (seed, epoch, rank, world) and the shard list, whatever the
cluster's size. Ray is imported only when a loader first runs (``pip install 'ember[ray]'``).
"""

from __future__ import annotations

import contextlib
import copy
import random
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from ember.shards import plan, stages
from ember.shards.checks import integer
from ember.shards.dataset import ShardDataset
from ember.shards.errors import ShardError
from ember.shards.reading import _ErrorPolicy, iter_shard, rank_and_world

if TYPE_CHECKING:
    from ember.shards.urls import Openers, UrlOptions

__all__ = ["RayShardLoader"]

STATE_VERSION = 1
DEFAULT_TRANSFER_GROUP = 128  # items per object a task sends when the pipeline is not batched

def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("RayShardLoader needs Ray: pip install 'ember[ray]' (or 'ray>=2.9') "
                          "on the training machines and on every node of the cluster") from None
    return ray


# ---- what runs on the Ray workers ------------------------------------------------------------

@dataclass
class _Spec:
    """What every task of an epoch needs besides its shard (put in the object store once)."""

    urls: list[str]
    options: UrlOptions
    stages: list[stages.Stage]  # the per-shard stages, in order
    batch: tuple[int, Callable | None] | None  # batched(n, collation_fn): (n, collation_fn)
    seed: int
    generator: torch.Generator | None
    raise_errors: bool  # on_error="raise": shard and decode errors end the task
    group: int  # items per object sent (batched pipelines send every batch alone)
    openers: Openers | None = None  # registered openers of the URLs: registered in the worker


@dataclass
class _Outcome:
    """The last object a task sends: what the trainer needs after the shard's items."""

    raw: int = 0  # samples read from the shard
    handled: int = 0  # items skipped or stopped at by a stage's handler=
    skipped: list = field(default_factory=list)  # errors on_error has to see, in order
    leftover: list = field(default_factory=list)  # items after the shard's last full batch
    stopped: bool = False  # a handler returned False: the rank's stream ends after this shard
    fatal: BaseException | None = None  # raised by the pipeline (after the items sent)
    warned: list = field(default_factory=list)  # (category, message) warned by the stages


def _portable(exc: BaseException, where: str) -> BaseException:
    """``exc`` with a note saying where it was raised and the worker's traceback, or, if it
    cannot be pickled, a RuntimeError that says what it was."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        exc = RuntimeError(f"{type(exc).__name__}: {exc} (raised {where}; the exception could "
                           "not be pickled)")
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(f"raised {where}:\n" + "".join(traceback.format_exception(exc)).rstrip())
    return exc


def _seed_globals(seed: int) -> None:
    """Seed the worker's global generators, so stages that draw from them (augmentations) give
    the same items for the same (seed, epoch, shard) on any worker, and again on resume."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def _shard_samples(url: str, options: UrlOptions, limit: int | None, out: _Outcome,
                   on_error: Callable[[Exception], None]) -> Iterator[dict]:
    """The first ``limit`` (all if None) samples of one shard; a ShardError goes to on_error."""
    if limit == 0:
        return
    samples = iter_shard(url, options)
    try:
        for sample in samples:
            out.raw += 1
            yield sample
            if out.raw == limit:
                return
    except ShardError as exc:
        on_error(exc)
    finally:
        getattr(samples, "close", lambda: None)()


class _TaskErrors:
    """The dataset's on_error on a worker, for the stages: ``"raise"`` raises, anything
    else keeps the error for the training process's on_error. ``count`` counts the items that
    stage handlers skipped; ``stopped`` is set when a handler ended the stream."""

    def __init__(self, raise_errors: bool, where: str):
        self.raise_errors = raise_errors
        self.where = where
        self.count = 0
        self.skipped: list[BaseException] = []
        self.stopped = False

    def __call__(self, exc: Exception) -> None:
        if self.raise_errors:
            raise exc
        self.skipped.append(_portable(exc, self.where))

    def watch(self, handler: Callable[[Exception], Any]) -> Callable[[Exception], Any]:
        """``handler``, noting when it ends the stream (returns False)."""
        def handle(exc: Exception) -> Any:
            go_on = handler(exc)
            if not go_on:
                self.stopped = True
            return go_on

        return handle


def _context(spec: _Spec, draws: tuple, errors: _TaskErrors) -> stages.StageContext:
    """How a task runs the pipeline's stages: the same stage functions, handler rules and error
    counting as local reading; stages that draw get a generator of (seed, epoch, shard, visit,
    stage)."""
    def draw(index: int) -> torch.Generator:
        return plan.draw_generator(spec.seed, spec.generator, "ray", *draws, index)

    return stages.StageContext(draw, errors, watch=errors.watch)


def _full_batches(items: Iterator, size: int, collate: Callable | None,
                  out: _Outcome) -> Iterator:
    """Batches of ``size`` items; the items after the last full one go to ``out.leftover`` (the
    trainer batches them with other shards' leftovers)."""
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield collate(batch) if collate is not None else batch
            batch = []
    out.leftover = batch


def run_shard(spec: _Spec, shard: int, epoch: int, visit: int, limit: int | None,
              skip: int) -> Iterator:
    """One task: the items (or full batches) of shard ``shard`` through the pipeline, sent as
    lists of up to ``spec.group``, leaving out the first ``skip`` (delivered before a resume);
    then an _Outcome. ``visit`` counts earlier reads of the shard in the epoch (equalize)."""
    url = spec.urls[shard]
    where = f"on a Ray worker reading shard {url}"
    draws = (epoch, shard, visit)
    _seed_globals(plan.derive_seed(spec.seed, "ray-globals", *draws))
    out = _Outcome()
    errors = _TaskErrors(spec.raise_errors, where)
    src: Iterator = _shard_samples(url, spec.options, limit, out, errors)
    ctx = _context(spec, draws, errors)
    for i, stage in enumerate(spec.stages):
        src = stage.run(src, ctx, i)
    if spec.batch is not None:
        src = _full_batches(src, spec.batch[0], spec.batch[1], out)
    group: list = []
    done = False
    try:
        while not done:
            # warnings are recorded only while the pipeline runs (not while Ray sends a group)
            # and sent to the trainer, which issues them again: a handler's warnings reach it
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                try:
                    while len(group) < spec.group:
                        unit = next(src, _END)
                        if unit is _END:
                            done = True
                            break
                        if skip:
                            skip -= 1
                            continue
                        group.append(unit)
                finally:
                    out.warned.extend(_warned(w) for w in seen)
            if group and not done:
                yield group
                group = []
    except Exception as exc:
        out.fatal = _portable(exc, where)
    finally:
        close = getattr(src, "close", None)
        if close is not None:
            close()
    if group:
        yield group
    out.handled, out.skipped, out.stopped = errors.count, errors.skipped, errors.stopped
    yield out


_END = object()


def _warned(w: warnings.WarningMessage) -> tuple[type[Warning], str]:
    """A recorded warning as (category, message), the category a picklable Warning class."""
    import pickle

    category = w.category if isinstance(w.category, type) and issubclass(w.category, Warning) \
        else UserWarning
    try:
        pickle.loads(pickle.dumps(category))
    except Exception:
        category = UserWarning
    return category, str(w.message)


# ---- the training process's side ---------------------------------------------------------------

class RayShardLoader:
    """The items of a :class:`ShardDataset` pipeline for one training process (rank), made by Ray
    tasks on a cluster.

    Each epoch, the rank's shards (``plan.worker_shards`` with one reading stream per rank, so
    all ranks together read each shard once) are each read by one Ray task, which runs the
    per-sample stages (``shuffle`` and ``rsample`` within its shard, ``decode``, ``map``,
    ``map_dict``, ``map_tuple``, ``rename``, ``select``, ``to_tuple``) and, if the pipeline ends
    in ``batched(n)``, cuts the shard's full batches. The loader hands out the tasks' items in the
    plan's order; items after a shard's last full batch are batched here with those of the next
    shards (the epoch's last batch may be short unless ``partial=False``). ``equalize`` gives
    every rank the same number of samples, as locally (one reading stream per rank).

    Errors are handled as locally: ``on_error`` applies to corrupt and truncated shards and to
    decode errors (a ``"raise"`` raises the original exception here, after the items before it;
    ``"warn"``, ``"skip"`` or a callable run here, in order, when the shard's items have been
    handed out; a task whose worker process dies, once Ray's own retries of it (``max_retries``
    in ``ray_remote_args``) are spent, is a ShardError naming its shard, after the items it
    sent: raised, or with another on_error the rest of that shard is skipped and counted),
    ``handler=`` of the stages runs on the worker (the warnings issued there are
    issued again here when the shard's items have been handed out), and ``error_count`` counts
    both.

    ``address``: the cluster (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``); None uses
    an already initialised Ray, else ``ray.init()``'s default. ``rank``/``world_size``: as for
    ShardDataset (default: the dataset's, else torch.distributed, else RANK/WORLD_SIZE).
    ``max_in_flight``: tasks running ahead of the one being handed out (default: the cluster's
    CPUs, at least 2); each holds up to one shard's output in Ray's object store.
    ``transfer_group``: items (batches, if the pipeline is batched) per object a task sends
    (default 128, or 1 for batched pipelines: a batch already amortises the transfer).
    ``ray_remote_args``: options of every task (default ``{"num_cpus": 1}``).

    ``state_dict()`` resumes exactly, mid-epoch too: it holds the task being handed out, the
    items of it already handed out and the leftover items waiting for a batch; resuming re-runs
    only that task.

    One iterator at a time: a new ``iter(loader)`` takes over the position and the older one
    raises RuntimeError if used again. Breaking off an iteration leaves its running tasks to end
    at the end of their shards (their outputs are dropped, not kept); they are not cancelled.
    """

    def __init__(self, dataset: ShardDataset, *, address: str | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 max_in_flight: int | None = None, transfer_group: int | None = None,
                 ray_remote_args: dict | None = None):
        if not isinstance(dataset, ShardDataset):
            raise TypeError(f"expected a ShardDataset, got {type(dataset).__name__}")
        _check_pipeline(dataset)
        if max_in_flight is not None:
            max_in_flight = integer(max_in_flight, "max_in_flight", minimum=1)
        if transfer_group is not None:
            transfer_group = integer(transfer_group, "transfer_group", minimum=1)
        self.dataset = dataset
        self.address = address
        self.rank = dataset.rank if rank is None else integer(rank, "rank", minimum=0)
        self.world_size = (dataset.world_size if world_size is None
                           else integer(world_size, "world_size", minimum=1))
        if self.rank is not None and self.world_size is not None:
            plan.stream_index(self.rank, self.world_size, 0, 1)  # validates
        self.max_in_flight = max_in_flight
        batched = bool(dataset.stages) and dataset.stages[-1].ray_scope == "final"
        if transfer_group is not None:
            self.transfer_group = transfer_group
        else:
            self.transfer_group = 1 if batched else DEFAULT_TRANSFER_GROUP
        self.ray_remote_args = dict(ray_remote_args) if ray_remote_args is not None \
            else {"num_cpus": 1}
        self.epoch = dataset.epoch
        self._resume: dict | None = None
        self._pos: dict = self._start_position()
        self._on_error = _ErrorPolicy(dataset.on_error)
        self._last_errors: int | None = None  # set when an epoch ends
        self._owner: object | None = None  # the token of the newest iterator

    def connect(self) -> None:
        """Connect to the cluster now (iteration does it otherwise): Ray initialised with
        ``address`` unless it already is (then a warning if ``address`` names another
        cluster than the one Ray is connected to: Ray connects once per process). Raises
        ImportError without Ray, ConnectionError naming the address when it cannot connect."""
        self._connect(stacklevel=4)

    def _connect(self, stacklevel: int) -> None:
        ray = _ray()
        if ray.is_initialized():
            _check_same_cluster(ray, self.address, stacklevel)
            return
        try:
            ray.init(address=self.address)
        except Exception as exc:
            raise ConnectionError(f"cannot connect to the Ray cluster at {self.address!r}: "
                                  f"{type(exc).__name__}: {exc}") from exc

    # ---- splitting, epochs, state ----------------------------------------------------------

    def split(self, n: int) -> list[RayShardLoader]:
        """``n`` loaders, one per rank of a world of ``n`` (to hand to ``n`` training workers):
        together they deliver every sample of an epoch once (with the dataset's ``equalize``,
        the same number each)."""
        n = integer(n, "n", minimum=1)
        if self.dataset.nodesplitter is None:
            raise ValueError("split(n) deals shards to ranks: it needs the dataset's "
                             "nodesplitter='auto' (with None the URL list is one rank's own)")
        out = []
        for r in range(n):
            part = copy.copy(self)
            part.rank, part.world_size = r, n
            part._resume = None
            part._pos = part._start_position()
            part._on_error = _ErrorPolicy(self.dataset.on_error)
            part._last_errors = None
            part._owner = None
            out.append(part)
        return out

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (from its start); epochs also advance by
        themselves when an iteration reaches the end."""
        self.epoch = integer(epoch, "epoch", minimum=0)
        self._resume = None

    @property
    def error_count(self) -> int:
        """Shards, samples and items skipped by on_error and handlers in the current (or, after
        its end, the last) epoch."""
        return self._pos["errors"] if self._last_errors is None else self._last_errors

    def _start_position(self) -> dict:
        return {"task": 0, "taken": 0, "pending": [], "raw": 0, "errors": 0}

    def state_dict(self) -> dict:
        """Epoch, seed, rank and world, the task being handed out and the items of it handed out,
        the samples read before it, the items waiting for a batch: enough to resume exactly."""
        pos = self._pos
        rank, world = self._rank_world()
        return {"version": STATE_VERSION, "kind": "ray", "epoch": self.epoch,
                "seed": self.dataset.seed, "rank": rank, "world_size": world,
                "num_shards": len(self.dataset.urls), "task": pos["task"], "taken": pos["taken"],
                "raw": pos["raw"], "pending": list(pos["pending"]), "errors": pos["errors"]}

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state`` on the next iteration."""
        if state.get("version") != STATE_VERSION or state.get("kind") != "ray":
            raise ValueError("not a RayShardLoader state (a ShardLoader's state cannot be resumed "
                             "on Ray, nor the other way round)")
        rank, world = self._rank_world()
        mine = (self.dataset.seed, len(self.dataset.urls), rank, world)
        saved = (state["seed"], state["num_shards"], state["rank"], state["world_size"])
        if saved != mine:
            raise ValueError(f"state is for seed, shards, rank, world_size = {saved}, this "
                             f"loader has {mine}")
        self.epoch = int(state["epoch"])
        self._resume = {k: state[k] for k in ("task", "taken", "raw", "errors")}
        self._resume["pending"] = list(state["pending"])
        self._pos = dict(self._resume)
        self._last_errors = None

    def __len__(self) -> int:
        if self.dataset.length is not None:
            return self.dataset.length
        raise TypeError("RayShardLoader has no length: declare it with dataset.with_length(n) "
                        "(the number of items an epoch yields on this rank)")

    def _rank_world(self) -> tuple[int, int]:
        if self.dataset.nodesplitter is None:
            return 0, 1  # the URL list is this rank's own
        return rank_and_world(self.rank, self.world_size)

    # ---- the plan of an epoch --------------------------------------------------------------

    def _plan(self, epoch: int, rank: int, world: int) -> tuple[list[int], int | None,
                                                               list[int] | None]:
        """The rank's shards, its sample quota (equalize) and the shard sizes. Task ``k`` of
        the epoch reads shard ``mine[k % len(mine)]`` (its ``k // len(mine)``-th read)."""
        ds = self.dataset
        n = len(ds.urls)
        gen = ds.generator
        mine = plan.worker_shards(n, seed=ds.seed, epoch=epoch, rank=rank, world=world,
                                  worker=0, num_workers=1, shuffle=ds.shuffle_shards,
                                  generator=gen)
        if ds.equalize is None:
            if not mine:
                warnings.warn(f"{n} shards for {world} ranks: rank {rank} gets no shard, so "
                              "ranks are uneven; use more shards, or equalize='repeat'",
                              stacklevel=4)
            return mine, None, None
        sizes = ds.ensure_shard_sizes()
        quota = plan.equal_quotas(sizes, seed=ds.seed, epoch=epoch, world=world, num_workers=1,
                                  mode=ds.equalize, shuffle=ds.shuffle_shards,
                                  generator=ds.generator)[0]
        if not mine:  # fewer shards than ranks: read the shard at the rank's position, as locally
            order = plan.shard_order(n, seed=ds.seed, epoch=epoch, shuffle=ds.shuffle_shards,
                                     generator=ds.generator)
            mine = [order[rank % n]]
        return mine, quota, sizes

    # ---- iteration ---------------------------------------------------------------------------

    def _window(self, ray: Any) -> int:
        if self.max_in_flight is not None:
            return self.max_in_flight
        return max(2, int(ray.cluster_resources().get("CPU", 1)))

    def __iter__(self) -> Iterator:
        """The items of the current epoch (or the rest of it, after ``load_state_dict``).

        One iterator at a time: a new ``iter(loader)`` takes over the loader's position, and the
        older iterator raises RuntimeError if it is used again."""
        token = object()
        self._owner = token
        return self._guarded(token)

    def _guarded(self, token: object) -> Iterator:
        inner = self._iterate()
        try:
            while True:
                if self._owner is not token:
                    raise RuntimeError("this RayShardLoader iterator was replaced by a newer "
                                       "iter(loader); a loader has one position, so only its "
                                       "newest iterator can go on (use split(n) or a second "
                                       "loader for concurrent streams)")
                try:
                    item = next(inner)
                except StopIteration:
                    return
                yield item
        finally:
            inner.close()

    def _iterate(self) -> Generator[Any, None, None]:
        self._connect(stacklevel=5)  # the warning points at the caller of next()
        ray = _ray()
        ds = self.dataset
        rank, world = self._rank_world()
        epoch = self.epoch
        resume, self._resume = self._resume, None
        pos = dict(resume) if resume is not None else self._start_position()
        pos["pending"] = list(pos["pending"])
        self._pos = pos
        self._last_errors = None
        self._on_error = _ErrorPolicy(ds.on_error)
        mine, quota, sizes = self._plan(epoch, rank, world)
        per_sample, batch, partial = _final_batch(ds.stages)
        spec = _Spec(urls=ds.urls, options=ds.options, stages=per_sample, batch=batch,
                     seed=ds.seed, generator=ds.generator, raise_errors=ds.on_error == "raise",
                     group=self.transfer_group, openers=ds.openers)
        # "streaming": each object a task yields reaches this process while the task goes on
        remote = ray.remote(run_shard).options(**{**self.ray_remote_args,
                                                  "num_returns": "streaming"})
        spec_ref = _put_spec(ray, spec)
        window = self._window(ray)
        first, skip = pos["task"], pos["taken"]
        # in flight: (task index, samples assumed read before it, its ObjectRefGenerator)
        inflight: deque = deque()
        state = {"next": first, "expected": pos["raw"]}  # next task; samples read, as planned
        idle = 0  # tasks in a row that read nothing

        def submit() -> None:
            k = state["next"]
            i = mine[k % len(mine)]
            assumed, limit = state["expected"], None
            if quota is not None:
                # as locally: a shard is read to its end unless the quota is reached in it
                limit = quota - assumed
                state["expected"] = assumed + min(cast(list, sizes)[i], limit)
            gen = remote.remote(spec_ref, i, epoch, k // len(mine), limit,
                                skip if k == first else 0)
            inflight.append((k, assumed, gen))
            state["next"] = k + 1

        def more() -> bool:
            if quota is None:
                return state["next"] < len(mine)
            if not inflight:
                state["expected"] = pos["raw"]  # what was read, whatever the sizes said
            return state["expected"] < quota

        current = None
        try:
            while True:
                while len(inflight) < window and more():
                    submit()
                if not inflight:
                    break
                k, assumed, current = inflight.popleft()
                if quota is not None and assumed != pos["raw"]:
                    # the tasks before it read another number of samples than the shard sizes
                    # say (errors): its limit is wrong; plan again from here with what was read
                    inflight.clear()
                    current = None
                    state.update(next=k, expected=pos["raw"])
                    continue
                url = ds.urls[mine[k % len(mine)]]
                outcome = yield from self._hand_out(ray, current, pos, url)
                current = None
                idle = idle + 1 if outcome.raw == 0 else 0
                # the task is done: the position moves past it before anything else is handed out
                pending = pos["pending"] + outcome.leftover
                size = batch[0] if batch is not None else 0
                ready = batch is not None and len(pending) >= size
                pos.update(task=k + 1, taken=0, raw=pos["raw"] + outcome.raw,
                           pending=pending[size:] if ready else pending)
                self._errors(outcome, pos)
                if ready and batch is not None:
                    yield _collate(batch, pending[:size])
                if outcome.stopped:
                    break
                if quota is not None and pos["raw"] < quota and idle >= len(mine):
                    raise ShardError(f"rank {rank} has no readable samples to reach its "
                                     f"equalize={ds.equalize!r} quota of {quota}")
            if batch is not None and pos["pending"] and partial:
                items, pos["pending"] = pos["pending"], []
                yield _collate(batch, items)
        finally:
            # tasks whose items will not be used are not cancelled (ray.cancel of a running
            # streaming generator task can abort the trainer inside Ray): dropping their
            # generators deletes their streams, so what they still send is freed, and they end
            # at the end of their shard
            inflight.clear()
            current = None
        self.epoch = epoch + 1
        self._last_errors = pos["errors"]
        self._pos = self._start_position()

    def _hand_out(self, ray: Any, gen: Any, pos: dict, url: str
                  ) -> Generator[Any, None, _Outcome]:
        """The items of one task, counted in ``pos`` as they are handed out; returns the task's
        _Outcome (raising its exception, if it ended with one, after its errors are applied).
        A task whose worker process died (after Ray's own retries, ``max_retries``) is a
        ShardError naming its shard, handled by on_error as a shard that breaks off there."""
        try:
            for ref in gen:
                obj = ray.get(ref)
                if isinstance(obj, _Outcome):
                    for category, message in obj.warned:
                        warnings.warn(message, category, stacklevel=4)  # at the caller of next()
                    if obj.fatal is not None:
                        self._errors(obj, pos)
                        raise obj.fatal
                    return obj
                for item in obj:
                    pos["taken"] += 1
                    yield item
        except _died(ray) as exc:
            error = ShardError(f"the Ray worker process reading it died ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''})", url)
            if self.dataset.on_error == "raise":
                raise error from exc
            return _Outcome(skipped=[error])  # the rest of the shard is skipped
        raise RuntimeError("a Ray task ended without its outcome (a bug in ember)")

    def _errors(self, outcome: _Outcome, pos: dict) -> None:
        """Count a task's handled items and apply on_error to the errors it skipped."""
        policy = self._on_error
        policy.count = pos["errors"] + outcome.handled
        for exc in outcome.skipped:
            policy(exc)
        pos["errors"] = policy.count


def _died(ray: Any) -> tuple[type[BaseException], ...]:
    """Ray's exceptions for a task whose worker process or node went away."""
    names = ("WorkerCrashedError", "NodeDiedError", "LocalRayletDiedError", "OwnerDiedError",
             "ObjectLostError")
    return tuple(getattr(ray.exceptions, n) for n in names if hasattr(ray.exceptions, n))


def _check_same_cluster(ray: Any, address: str | None, stacklevel: int) -> None:
    """Warn when ``address`` names another cluster than the one Ray is initialised with."""
    if address is None or address == "auto":
        return
    try:
        current = ray.get_runtime_context().gcs_address
    except Exception:
        current = None
    if current is not None and _host_port(address) == _host_port(current):
        return
    warnings.warn(f"RayShardLoader(address={address!r}) is not used: Ray is already initialised "
                  f"in this process (connected to {current or 'another cluster'}), and a "
                  "process connects to one cluster; call ray.shutdown() first, or leave "
                  "address=None", RuntimeWarning, stacklevel=stacklevel)


def _host_port(address: str) -> tuple[str, str]:
    """(IP, port) of a ``host:port`` address, the host resolved where it can be."""
    import socket

    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    with contextlib.suppress(OSError):
        host = socket.gethostbyname(host)
    return host, port


def _collate(batch: tuple[int, Callable | None], items: list) -> Any:
    return batch[1](items) if batch[1] is not None else items


def _put_spec(ray: Any, spec: _Spec) -> Any:
    """``spec`` in Ray's object store; a TypeError naming the stage that cannot be pickled."""
    try:
        return ray.put(spec)
    except Exception:
        culprit = _unpicklable(ray, spec)
        if culprit is None:
            raise
        raise TypeError(f"RayShardLoader sends the pipeline to the Ray workers, but {culprit[0]} "
                        f"cannot be pickled ({culprit[1]}); use functions and objects that "
                        "pickle (define them at module level, or create what they hold, such as "
                        "locks, files or connections, inside the function)") from None


def _unpicklable(ray: Any, spec: _Spec) -> tuple[str, str] | None:
    """What in ``spec`` cannot be pickled, in words, and why; None if all of it can."""
    parts: list[tuple[str, Any]] = [
        (f"stage {i} ({stage.name}{_callable_name(stage.callables())})", stage)
        for i, stage in enumerate(spec.stages)]
    if spec.batch is not None:
        parts.append((f"the collation_fn of batched{_callable_name(spec.batch)}", spec.batch))
    parts += [("the dataset's URL options", spec.options),
              ("the dataset's generator", spec.generator)]
    for what, obj in parts:
        try:
            ray.cloudpickle.dumps(obj)
        except Exception as exc:
            return what, f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def _callable_name(p: Any) -> str:
    names = [getattr(x, "__qualname__", None) for x in p if callable(x)]
    names = [n for n in names if n]
    return f" {names[0]}" if names else ""


def _check_pipeline(ds: ShardDataset) -> None:
    """Refuse what a pipeline of per-shard tasks cannot do as locally, naming it."""
    if ds.resampled:
        raise ValueError("RayShardLoader does not run resampled=True datasets (each rank reads "
                         "its share of the shards once per epoch)")
    if ds.epoch_length is not None:
        raise ValueError("RayShardLoader does not run with_epoch(n) (an epoch is one pass over "
                         "the rank's shards; use equalize= for equal ranks)")
    for name in ("nodesplitter", "workersplitter"):
        if callable(getattr(ds, name)):
            raise ValueError(f"RayShardLoader needs {name}='auto' or None (shards are dealt to "
                             "ranks by ember's plan)")
    for j, stage in enumerate(ds.stages):
        if stage.ray_scope == "final":
            _check_final(stage)
            if j != len(ds.stages) - 1:
                raise ValueError(f"RayShardLoader needs {stage.name}(n) as the last stage, got "
                                 f"{ds.stages[j + 1].name!r} after it (map the items before "
                                 "batching)")
        elif stage.ray_scope != "shard":
            runs = [c.name for c in stages.REGISTRY.values()
                    if c.ray_scope == "shard" and c.dataset_level]
            finals = [c.name for c in stages.REGISTRY.values() if c.ray_scope == "final"]
            raise ValueError(f"RayShardLoader does not run the {stage.name!r} stage (stages it "
                             f"runs: {', '.join(runs + finals)})")


def _final_batch(pipeline: list[stages.Stage]
                 ) -> tuple[list[stages.Stage], tuple[int, Callable | None] | None, bool]:
    """The stages a task runs per sample, and the final batching stage's ``(batchsize,
    collation_fn)`` (None without one) and ``partial``."""
    last = cast(Any, pipeline[-1]) if pipeline else None
    if last is None or last.ray_scope != "final":
        return pipeline, None, True
    return pipeline[:-1], (last.batchsize, last.collation_fn), last.partial  # _check_final


def _check_final(stage: stages.Stage) -> None:
    """Refuse a final-scope stage that does not say how it batches (tasks cut full batches of
    ``batchsize`` collated by ``collation_fn``; the trainer batches the rest, the last one short
    if ``partial``)."""
    size = getattr(stage, "batchsize", None)
    missing = [a for a in ("collation_fn", "partial") if not hasattr(stage, a)]
    if not isinstance(size, int) or isinstance(size, bool) or size < 1 or missing:
        raise ValueError(f"RayShardLoader runs the final-scope stage {stage.name!r} as a batching "
                         "stage: it needs the attributes batchsize (a whole number >= 1), "
                         "collation_fn and partial")
