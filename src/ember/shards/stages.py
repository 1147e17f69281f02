"""Pipeline stages: generator functions from an iterator of samples to an iterator of samples.

Stages know nothing about each other or about shards; ShardDataset's fluent methods compose them.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["shuffle", "map_samples", "map_dict", "map_tuple", "rename", "select", "to_tuple",
           "batched", "default_collate", "decode", "handled", "islice_stream", "rsample",
           "reraise_exception", "warn_and_continue", "ignore_and_continue", "warn_and_stop"]

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
