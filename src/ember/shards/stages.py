"""Pipeline stages: generator functions from an iterator of samples to an iterator of samples,
and the stage objects that ShardDataset's and ShardLoader's fluent methods compose.

A stage object (:class:`Stage`) holds its arguments and declares what the rest of the system asks
of it: whether it turns each item into at most one item (``one_to_one``), whether how many items
it yields depends on their content (``counts_depend_on_content``), whether it draws random
numbers (``draws``), where a Ray task can run it (``ray_scope``), whether it also runs in the
loader's main process with a state of its own (``loader_level``) and how it handles errors
(``handler``, ``errors``). The worker pipeline, the index-based resume, the Ray loader and the
loader-level stages read those attributes; stages know nothing about each other or about shards.
Defining a :class:`Stage` subclass with a ``name`` adds it to ``ShardDataset`` as a fluent method
of that name (taking the arguments of its ``build``).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import numpy as np
import torch

__all__ = ["shuffle", "map_samples", "map_dict", "map_tuple", "rename", "select", "to_tuple",
           "batched", "default_collate", "decode", "handled", "islice_stream", "rsample",
           "reraise_exception", "warn_and_continue", "ignore_and_continue", "warn_and_stop",
           "Stage", "StageContext", "Shuffle", "Decode", "Map", "MapDict", "MapTuple", "Rename",
           "Select", "ToTuple", "Slice", "RSample", "Batched", "Unbatched", "ExtractKeys",
           "REGISTRY", "on_register"]

_BLOCK = 1024


def shuffle(src: Iterable, bufsize: int, initial: int | None, generator: torch.Generator
            ) -> Iterator:
    """Shuffle through a buffer of ``bufsize`` items, starting once ``initial`` are buffered.

    Randomness comes only from ``torch.randint``/``torch.randperm`` with ``generator``.
    """
    if bufsize <= 1:
        yield from src
        return
    initial = bufsize if initial is None else max(1, min(initial, bufsize))
    buf: list = []
    draws: list[int] = []
    di = 0
    grow = False
    for item in src:
        buf.append(item)
        n = len(buf)
        if n < initial:
            continue
        if n < bufsize:  # between initial and bufsize: yield for every other input
            grow = not grow
            if grow:
                continue
        if di == len(draws):
            draws = torch.randint(0, 1 << 62, (_BLOCK,), generator=generator).tolist()
            di = 0
        j = draws[di] % n
        di += 1
        buf[j], buf[-1] = buf[-1], buf[j]
        yield buf.pop()
    for j in torch.randperm(len(buf), generator=generator).tolist():
        yield buf[j]


# ---- exception handlers (webdataset's names and meaning: return True to skip the item and go on,
# False to end the stream, or raise) --------------------------------------------------------------

def reraise_exception(exn: Exception) -> bool:
    """Handler that raises the exception again (the default of every stage)."""
    raise exn


def warn_and_continue(exn: Exception) -> bool:
    """Handler that warns with the exception and skips the item."""
    warnings.warn(f"skipped an item: {type(exn).__name__}: {exn}", stacklevel=2)
    return True


def ignore_and_continue(exn: Exception) -> bool:
    """Handler that skips the item silently (it is still counted)."""
    return True


def warn_and_stop(exn: Exception) -> bool:
    """Handler that warns with the exception and ends the stream."""
    warnings.warn(f"stream stopped: {type(exn).__name__}: {exn}", stacklevel=2)
    return False


def handled(src: Iterable, fn: Callable[[Any], Any], handler: Callable[[Exception], Any],
            count: Callable[[], None]) -> Iterator:
    """Apply ``fn`` to every item; an exception goes to ``handler``: a true result skips the
    item (``count()`` is called), a false one ends the stream, or the handler raises."""
    if not callable(handler):
        raise TypeError(f"expected handler= to be a callable taking the exception, got {handler!r}")
    for item in src:
        try:
            out = fn(item)
        except Exception as exc:
            if handler(exc):
                count()
                continue
            count()
            return
        yield out


def islice_stream(src: Iterable, start: int, stop: int | None, step: int) -> Iterator:
    """``itertools.islice(src, start, stop, step)``."""
    return itertools.islice(src, start, stop, step)


def rsample(src: Iterable, p: float, generator: torch.Generator) -> Iterator:
    """Keep each item with probability ``p``: one uniform draw from ``generator`` per item,
    whatever the item is, so the kept positions depend on the generator only."""
    draws: list[float] = []
    di = 0
    for item in src:
        if di == len(draws):
            draws = torch.rand(_BLOCK, generator=generator, dtype=torch.float64).tolist()
            di = 0
        keep = draws[di] < p
        di += 1
        if keep:
            yield item


def map_tuple(src: Iterable[tuple], fns: tuple[Callable | None, ...]) -> Iterator[tuple]:
    """Apply ``fns[i]`` to element ``i`` of every tuple (None leaves it as it is)."""
    for item in src:
        if not isinstance(item, (tuple, list)) or len(item) != len(fns):
            raise ValueError(f"map_tuple with {len(fns)} functions got an item of type "
                             f"{type(item).__name__}"
                             + (f" with {len(item)} elements" if isinstance(item, (tuple, list))
                                else ""))
        yield tuple(x if f is None else f(x) for f, x in zip(fns, item, strict=True))


def map_samples(src: Iterable, fn: Callable[[Any], Any]) -> Iterator:
    """Apply ``fn`` to every item."""
    for item in src:
        yield fn(item)


def map_dict(src: Iterable[dict], fns: dict[str, Callable]) -> Iterator[dict]:
    """Apply ``fns[field]`` to the given fields of every sample dict (missing field: KeyError)."""
    for sample in src:
        sample = dict(sample)
        for field, fn in fns.items():
            if field not in sample:
                raise KeyError(f"map_dict: sample {sample.get('__key__')!r} has no field {field!r}")
            sample[field] = fn(sample[field])
        yield sample


def rename(src: Iterable[dict], renames: dict[str, str], keep: bool = True) -> Iterator[dict]:
    """Rename fields: ``renames[new] = "old1;old2"`` takes the first old field present.

    With ``keep=False`` only the renamed fields and ``__key__``/``__url__`` remain.
    """
    table = {new: old.split(";") for new, old in renames.items()}
    for sample in src:
        out = dict(sample) if keep else {k: v for k, v in sample.items() if k[:2] == "__"}
        for new, olds in table.items():
            for old in olds:
                if old in sample:
                    if keep:
                        out.pop(old, None)
                    out[new] = sample[old]
                    break
            else:
                raise KeyError(f"rename: sample {sample.get('__key__')!r} has none of {olds}")
        yield out


def select(src: Iterable, predicate: Callable[[Any], bool]) -> Iterator:
    """Keep the items for which ``predicate`` is true."""
    for item in src:
        if predicate(item):
            yield item


def to_tuple(src: Iterable[dict], fields: tuple[str, ...], missing_ok: bool = False
             ) -> Iterator[tuple]:
    """Turn sample dicts into tuples; ``"jpg;png cls"`` means (first of jpg/png, cls)."""
    spec = [f.split(";") for field in fields for f in field.split()]
    for sample in src:
        out = []
        for alternatives in spec:
            for name in alternatives:
                if name in sample:
                    out.append(sample[name])
                    break
            else:
                if not missing_ok:
                    raise KeyError(f"to_tuple: sample {sample.get('__key__')!r} from "
                                   f"{sample.get('__url__')} has none of {alternatives}; "
                                   f"fields are {sorted(sample)}")
                out.append(None)
        yield tuple(out)


def default_collate(items: list) -> Any:
    """Collate a list of tuples/dicts/values: numbers and arrays become tensors, others lists."""
    first = items[0]
    if isinstance(first, tuple):
        for i, it in enumerate(items):
            if len(it) != len(first):
                raise ValueError(f"batched: item {i} has {len(it)} fields, item 0 has "
                                 f"{len(first)}; give items one shape or pass a collation_fn")
        return tuple(default_collate(list(col)) for col in zip(*items, strict=True))
    if isinstance(first, dict):
        for i, it in enumerate(items):
            if it.keys() != first.keys():
                diff = sorted(set(first) ^ set(it), key=str)
                raise ValueError(f"batched: item {i} and item 0 differ in the keys {diff!r}; "
                                 "give items the same keys or pass a collation_fn")
        return {k: default_collate([it[k] for it in items]) for k in first}
    if isinstance(first, torch.Tensor):
        return torch.stack(items)
    if isinstance(first, np.ndarray):
        return torch.from_numpy(np.stack(items))
    if isinstance(first, bool):
        return torch.tensor(items, dtype=torch.bool)
    if isinstance(first, int):
        return torch.tensor(items, dtype=torch.int64)
    if isinstance(first, float):
        return torch.tensor(items, dtype=torch.float64)
    return list(items)


def batched(src: Iterable, batchsize: int, collation_fn: Callable[[list], Any] | None,
            partial: bool = True) -> Iterator:
    """Group items into lists of ``batchsize`` and collate them; the last batch may be short."""
    if batchsize < 1:
        raise ValueError(f"expected batchsize >= 1, got {batchsize}")
    batch: list = []
    for item in src:
        batch.append(item)
        if len(batch) == batchsize:
            yield collation_fn(batch) if collation_fn is not None else batch
            batch = []
    if batch and partial:
        yield collation_fn(batch) if collation_fn is not None else batch


def decode(src: Iterable[dict], decoder: Callable[[dict], dict],
           on_error: Callable[[Exception], None]) -> Iterator[dict]:
    """Decode every sample; a DecodeError goes to ``on_error`` (which re-raises or skips)."""
    from ember.shards.errors import DecodeError

    for sample in src:
        try:
            out = decoder(sample)
        except DecodeError as exc:
            on_error(exc)
            continue
        yield out


# ---- stages as objects ------------------------------------------------------------------------

REGISTRY: dict[str, type[Stage]] = {}  # fluent name -> stage class
_ON_REGISTER: list[Callable[[type[Stage]], None]] = []  # told of every stage class registered


def on_register(fn: Callable[[type[Stage]], None]) -> None:
    """Call ``fn(cls)`` for every stage class registered, those already registered first (this
    is how ShardDataset gets a fluent method for each)."""
    _ON_REGISTER.append(fn)
    for cls in list(REGISTRY.values()):
        fn(cls)


class StageContext:
    """What a running pipeline gives its stages: ``draw(index)``, the generator of the stage at
    ``index`` for this stream; ``errors``, the on_error policy (called with an exception, counts
    in ``errors.count``); ``watch(handler)``, the handler as the pipeline wants it called;
    ``collate(fn)``, the collation function as the pipeline wants it called."""

    def __init__(self, draw: Callable[[int], torch.Generator], errors: Any,
                 watch: Callable[[Callable], Callable] | None = None,
                 collate: Callable[[Callable | None], Callable | None] | None = None):
        self.draw = draw
        self.errors = errors
        self.watch = watch if watch is not None else _same
        self.collate = collate if collate is not None else _same

    def count(self) -> None:
        """Count one item skipped (or stopped at) by a stage's handler."""
        self.errors.count += 1


def _same(x: Any) -> Any:
    return x


class Stage:
    """One step of a pipeline: its arguments, and what the system that runs it needs to know.

    Class attributes: ``name`` (the fluent method), ``one_to_one`` (each item in gives at most
    one item out, at once: such a stage runs item by item, around the placeholders of a resumed
    stream), ``draws`` (draws random numbers: it gets a generator per stream and stage),
    ``ray_scope`` (``"shard"``: a Ray task runs it over its one shard's items; ``"final"``: a
    batching stage with ``batchsize``, ``collation_fn`` and ``partial`` attributes: as the last
    stage, Ray tasks cut their shard's full batches and the trainer the rest, and ShardLoader's
    workers send its batches one at a time; None: not on Ray),
    ``loader_level`` (it also runs in ShardLoader's main process, with a state of its own:
    :meth:`runner`), ``dataset_level`` (it runs in a dataset's reading streams), ``errors``
    (``"handler"``: exceptions go to ``handler=`` if given; ``"on_error"``: decode errors go to
    the dataset's on_error unless a handler is given; ``"raise"``: exceptions propagate).
    """

    name: ClassVar[str] = ""
    one_to_one: ClassVar[bool] = False
    draws: ClassVar[bool] = False
    ray_scope: ClassVar[str | None] = "shard"
    loader_level: ClassVar[bool] = False
    dataset_level: ClassVar[bool] = True
    errors: ClassVar[str] = "raise"
    handler: Callable[[Exception], Any] | None = None

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if cls.name:
            REGISTRY[cls.name] = cls
            for fn in _ON_REGISTER:
                fn(cls)

    @classmethod
    def build(cls, *args: Any, **kwargs: Any) -> Stage:
        """The stage for the fluent method's arguments (checked)."""
        return cls(*args, **kwargs)

    def counts_depend_on_content(self, on_error: Any) -> bool:
        """Whether how many items this stage yields, and from which inputs, depends on what the
        items hold, or whether the stage reads items that are not one-to-one (so a resumed
        stream cannot be laid out from sample counts alone, with placeholders for the items
        delivered). True unless a stage says otherwise: a stage is taken to read its items."""
        return True

    def run(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        """The stage over ``src``, as stage ``index`` of a pipeline run by ``ctx``."""
        if self.handler is not None:
            return handled(src, self.item_fn(), ctx.watch(self.handler), ctx.count)
        return self.apply(src, ctx, index)

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        raise NotImplementedError

    def item_fn(self) -> Callable[[Any], Any]:
        """The function of item to item of a one-to-one stage (what handler= guards)."""
        return lambda item: next(iter(self.apply(iter((item,)), _NO_CONTEXT, -1)))

    def runner(self, seed: int, epoch: int, index: int, generator: Any = None) -> Any:
        """A loader-level stage's running form (``pull``, ``state``, ``load``) for one epoch;
        ``generator``: the dataset's (see ember.shards.plan.draw_generator)."""
        raise NotImplementedError(f"{self.name} does not run at the loader level")

    def callables(self) -> list[Callable]:
        """The user functions the stage holds (to name them in errors)."""
        return [x for x in vars(self).values() if callable(x)]


class _CountFree(Stage):
    """A built-in stage whose item counts follow from the counts of its inputs alone (one-to-one
    stages run around placeholders, the others never look at their items), unless a handler
    skips items."""

    def counts_depend_on_content(self, on_error: Any) -> bool:
        return self.handler is not None


def _check_handler(handler: Callable[[Exception], Any] | None) -> Callable | None:
    if handler is not None and not callable(handler):
        raise TypeError(f"expected handler= to be None or a callable taking the exception "
                        f"(e.g. warn_and_continue), got {handler!r}")
    return handler


class Shuffle(_CountFree):
    """Shuffle through a buffer of ``bufsize`` items (dataset level: once ``initial`` are
    buffered; loader level: across workers, its buffer in the loader's state)."""

    name = "shuffle"
    draws = True
    loader_level = True

    def __init__(self, bufsize: int, initial: int | None = None):
        from ember.shards.checks import integer

        self.bufsize = integer(bufsize, "bufsize", minimum=0)
        self.initial = None if initial is None else integer(initial, "initial", minimum=0)

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        return shuffle(src, self.bufsize, self.initial, ctx.draw(index))

    def runner(self, seed: int, epoch: int, index: int, generator: Any = None) -> Any:
        from ember.shards import plan, rebatch

        if plan.has_substreams(generator):  # the buffer's draws start from its substream
            g = plan.draw_generator(seed, generator, "loader", epoch, index)
            start = int(torch.randint(0, 1 << 62, (1,), generator=g).item())
        else:
            start = plan.derive_seed(seed, "loader", epoch, index)
        return rebatch._Shuffle(self.bufsize, start)


class RSample(_CountFree):
    """Keep each item with probability ``p``."""

    name = "rsample"
    draws = True

    def __init__(self, p: float = 0.5):
        from ember.shards.checks import real

        self.p = real(p, "rsample probability p", minimum=0.0, maximum=1.0)

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        return rsample(src, self.p, ctx.draw(index))


class Slice(_CountFree):
    """``itertools.islice`` on each reading stream."""

    name = "slice"
    ray_scope = None

    def __init__(self, *args: int | None):
        from ember.shards.checks import integer

        if not 1 <= len(args) <= 3:
            raise TypeError(f"slice expected 1 to 3 arguments, got {len(args)}")
        s = slice(*args)
        self.start = 0 if s.start is None else integer(s.start, "slice start", minimum=0)
        self.stop = None if s.stop is None else integer(s.stop, "slice stop", minimum=0)
        self.step = 1 if s.step is None else integer(s.step, "slice step", minimum=1)

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        return islice_stream(src, self.start, self.stop, self.step)


class Batched(_CountFree):
    """Group items into batches of ``batchsize``, collated by ``collation_fn``."""

    name = "batched"
    ray_scope = "final"
    loader_level = True

    def __init__(self, batchsize: int, collation_fn: Callable | None = default_collate,
                 partial: bool = True):
        from ember.shards.checks import integer

        self.batchsize = integer(batchsize, "batchsize", minimum=1)
        self.collation_fn = collation_fn
        self.partial = partial

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        return batched(src, self.batchsize, ctx.collate(self.collation_fn), self.partial)

    def runner(self, seed: int, epoch: int, index: int, generator: Any = None) -> Any:
        from ember.shards import rebatch

        return rebatch._Batch(self.batchsize, self.collation_fn, self.partial)


class Unbatched(_CountFree):
    """Split every item (a batch) into its items."""

    name = "unbatched"
    ray_scope = None
    loader_level = True
    dataset_level = False

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        raise NotImplementedError("unbatched() runs at the loader level (ShardLoader)")

    def runner(self, seed: int, epoch: int, index: int, generator: Any = None) -> Any:
        from ember.shards import rebatch

        return rebatch._Unbatch()


class Decode(_CountFree):
    """Decode fields by extension (a Decoder); decode errors go to ``handler`` if given, else
    to the dataset's on_error."""

    name = "decode"
    one_to_one = True
    errors = "on_error"

    def __init__(self, decoder: Callable[[dict], dict],
                 handler: Callable[[Exception], Any] | None = None):
        self.decoder = decoder
        self.handler = _check_handler(handler)

    def counts_depend_on_content(self, on_error: Any) -> bool:
        return self.handler is not None or on_error != "raise"

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        return decode(src, self.decoder, ctx.errors)

    def item_fn(self) -> Callable[[Any], Any]:
        return self.decoder


class Map(_CountFree):
    """Apply ``fn`` to every item."""

    name = "map"
    one_to_one = True
    errors = "handler"

    def __init__(self, fn: Callable[[Any], Any],
                 handler: Callable[[Exception], Any] | None = None):
        self.fn = fn
        self.handler = _check_handler(handler)

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        return map_samples(src, self.fn)

    def item_fn(self) -> Callable[[Any], Any]:
        return self.fn


class MapDict(_CountFree):
    """Apply ``fns[field]`` to those fields of every sample dict."""

    name = "map_dict"
    one_to_one = True
    errors = "handler"

    def __init__(self, fns: dict[str, Callable],
                 handler: Callable[[Exception], Any] | None = None):
        self.fns = fns
        self.handler = _check_handler(handler)

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        return map_dict(src, self.fns)

    def callables(self) -> list[Callable]:
        return list(self.fns.values()) + super().callables()


class MapTuple(_CountFree):
    """Apply ``fns[i]`` to element ``i`` of every tuple item."""

    name = "map_tuple"
    one_to_one = True
    errors = "handler"

    def __init__(self, fns: tuple[Callable | None, ...],
                 handler: Callable[[Exception], Any] | None = None):
        if not fns or not all(f is None or callable(f) for f in fns):
            raise TypeError(f"expected map_tuple(*fns) with callables or None, got {fns!r}")
        self.fns = tuple(fns)
        self.handler = _check_handler(handler)

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        return map_tuple(src, self.fns)

    def callables(self) -> list[Callable]:
        return [f for f in self.fns if f is not None] + super().callables()


class Rename(_CountFree):
    """Rename fields, ``new="old1;old2"``."""

    name = "rename"
    one_to_one = True

    def __init__(self, renames: dict[str, str], keep: bool = True):
        self.renames = renames
        self.keep = keep

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        return rename(src, self.renames, self.keep)


class Select(Stage):
    """Keep the items for which ``predicate`` is true."""

    name = "select"
    one_to_one = True

    def __init__(self, predicate: Callable[[Any], bool]):
        self.predicate = predicate

    def counts_depend_on_content(self, on_error: Any) -> bool:
        return True

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        return select(src, self.predicate)


class ToTuple(_CountFree):
    """Turn sample dicts into tuples of fields."""

    name = "to_tuple"
    one_to_one = True
    errors = "handler"

    def __init__(self, fields: tuple[str, ...], missing_ok: bool = False,
                 handler: Callable[[Exception], Any] | None = None):
        self.fields = fields
        self.missing_ok = missing_ok
        self.handler = _check_handler(handler)

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        return to_tuple(src, self.fields, self.missing_ok)


class ExtractKeys(_CountFree):
    """Turn sample dicts into tuples of the fields whose names match glob patterns."""

    name = "extract_keys"
    one_to_one = True
    errors = "handler"

    def __init__(self, patterns: tuple[list[str], ...], duplicate_is_error: bool,
                 ignore_missing: bool, handler: Callable[[Exception], Any] | None):
        self.patterns = patterns
        self.duplicate_is_error = duplicate_is_error
        self.ignore_missing = ignore_missing
        self.handler = _check_handler(handler)

    @classmethod
    def build(cls, *patterns: str | list[str], duplicate_is_error: bool = True,
              ignore_missing: bool = False,
              handler: Callable[[Exception], Any] | None = None) -> Stage:
        """Turn every sample dict into a tuple holding, for each pattern, the value of the field
        whose name matches it, as webdataset's ``extract_keys``: a pattern is a glob matched
        against the field name and against ``"." + name`` (``"*.jpg"`` matches ``jpg`` and
        ``x.jpg``); ``"a;b"`` or a list gives alternatives. A pattern that matches no field
        raises ValueError, or with ``ignore_missing`` is left out of the tuple; one that
        matches several raises ValueError, or with ``duplicate_is_error=False`` takes the first
        in the sample's order. ``handler`` as in ``map`` (e.g. to skip samples missing a
        field)."""
        if not patterns or not all(isinstance(p, (str, list, tuple)) for p in patterns):
            raise TypeError(f"expected extract_keys(*patterns) with glob strings (or lists of "
                            f"them), got {patterns!r}")
        alternatives = tuple(p.split(";") if isinstance(p, str) else list(p) for p in patterns)
        return cls(alternatives, bool(duplicate_is_error), bool(ignore_missing), handler)

    def apply(self, src: Iterator, ctx: StageContext, index: int) -> Iterator:
        from fnmatch import fnmatch

        for sample in src:
            out = []
            for globs in self.patterns:
                found = [k for k in sample
                         if any(fnmatch(k, g) or fnmatch("." + k, g) for g in globs)]
                if not found:
                    if self.ignore_missing:
                        continue
                    raise ValueError(f"extract_keys: sample {sample.get('__key__')!r} has no "
                                     f"field matching {globs}; fields are {sorted(sample)}")
                if len(found) > 1 and self.duplicate_is_error:
                    raise ValueError(f"extract_keys: fields {found} of sample "
                                     f"{sample.get('__key__')!r} all match {globs}")
                out.append(sample[found[0]])
            yield tuple(out)


_NO_CONTEXT = StageContext(draw=lambda index: torch.Generator(), errors=reraise_exception)
