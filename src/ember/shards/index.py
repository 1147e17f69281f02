"""Per-shard index files: the byte span of every sample, for counting, random access and
re-sharding without decoding.

An index is a small JSON file next to the shard (``shard.tar`` -> ``shard.tar.idx``) holding the
shard's size and, per sample, its key and the byte span [start, end) of its members in the
(uncompressed) tar stream. An index whose size no longer matches its shard is stale and ignored;
:func:`index_mismatch` checks single spans against the shard before anything relies on them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

from ember.shards.errors import FormatError, ShardError
from ember.shards.format import group_samples, split_name, unsafe_name
from ember.shards.tar import iter_members, memory_source, open_tar_source, scan_members
from ember.shards.urls import UrlOptions, local_path, open_url, parsed_to_end, sibling_url

__all__ = ["build_index", "make_index", "write_index", "read_index", "index_path",
           "index_mismatch", "sample_count", "read_sample", "INDEX_SUFFIX"]

INDEX_SUFFIX = ".idx"
_FORMAT = "ember-shard-index"


def _spans(url: str, options: UrlOptions | None) -> Iterator[tuple[str, int, int]]:
    """Yield (key, start, end) per sample by scanning headers only."""
    stream = open_url(url, options)
    try:
        src = open_tar_source(stream, url)
        try:
            key = None
            start = end = 0
            for name, s, e in scan_members(src, url):
                kx = split_name(name)
                if kx is None:
                    continue
                if kx[0] != key and unsafe_name(kx[0]):
                    raise FormatError(f"member name {name!r} is unsafe ({unsafe_name(kx[0])})",
                                      url, s)
                if kx[0] != key:
                    if key is not None:
                        yield key, start, end
                    key, start = kx[0], s
                end = e
            if key is not None:
                yield key, start, end
            src.finish()
        finally:
            src.close()
        parsed_to_end(stream)
    finally:
        stream.close()


def make_index(url: str, samples: list[list], size: int | None) -> dict:
    """The index of shard ``url`` from its ``[key, start, end]`` spans and its size in bytes."""
    return {"format": _FORMAT, "version": 1, "shard": Path(url).name, "size": size,
            "samples": samples}


def build_index(url: str, options: UrlOptions | None = None) -> dict:
    """Scan a shard and return its index (keys and byte spans of every sample)."""
    samples = [[k, s, e] for k, s, e in _spans(url, options)]
    path = local_path(url)
    return make_index(url, samples, path.stat().st_size if path is not None else None)


def index_path(url: str) -> Path:
    """Where the index of a local shard lives."""
    path = local_path(url)
    if path is None:
        raise ValueError(f"index files are written next to local shards only, not {url}")
    return path.with_name(path.name + INDEX_SUFFIX)


def write_index(url: str, options: UrlOptions | None = None) -> Path:
    """Build the index of a local shard and write it next to the shard."""
    out = index_path(url)
    index = build_index(url, options)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(index, separators=(",", ":")))
    tmp.replace(out)
    return out


def read_index(url: str, options: UrlOptions | None = None) -> dict | None:
    """The index of a shard if one exists, else None.

    The index of a local shard must match the shard's size; a stale one is ignored with a
    warning, and so is one that is not an ember index (garbage, a server's HTML page), naming
    the file: the shard is then counted by a header scan.
    """
    path = local_path(url)
    try:
        if path is not None:
            where = str(index_path(url))
            if not os.path.exists(where):
                return None
            text = _read_local(where)
            try:
                size: int | None = path.stat().st_size
            except OSError:
                return None  # the shard itself is missing: reading it reports that
        else:
            found = sibling_url(url, INDEX_SUFFIX)
            if found is None:
                return None  # no file lies beside a command's output
            where, size = found, None
            text = _read_remote(where, options)
    except ShardError:
        return None
    index, problem = _parse_index(text)
    if index is None:
        warnings.warn(f"ignoring unreadable index {where}: {problem}; counting by a header scan")
        return None
    if size is not None and index.get("size") not in (None, size):
        warnings.warn(f"ignoring stale index {where}: the shard is {size} bytes, the index "
                      f"was made for {index.get('size')} bytes")
        return None
    return index


def _read_local(where: str) -> bytes:
    try:
        with open(where, "rb") as f:
            return f.read()
    except OSError as exc:
        warnings.warn(f"ignoring unreadable index {where}: {exc}; counting by a header scan")
        raise ShardError(f"cannot read its index: {exc}", where) from None


def _read_remote(where: str, options: UrlOptions | None) -> bytes:
    """An optional file: one attempt, never cached (a failure means a header scan)."""
    options = dataclasses.replace(options or UrlOptions(), retries=0, cache_dir=None,
                                  cache_size=None)
    stream = open_url(where, options)
    try:
        return stream.read()
    finally:
        stream.close()


def _is_span(entry: object) -> bool:
    return (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
            and all(type(x) is int for x in entry[1:]))


def _parse_index(text: bytes) -> tuple[dict | None, str]:
    """The index in ``text``, or None and why it is not one."""
    try:
        index = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"not JSON ({exc})"
    if not isinstance(index, dict) or index.get("format") != _FORMAT:
        return None, "not an ember shard index"
    samples = index.get("samples")
    if not isinstance(samples, list) or not all(_is_span(e) for e in samples):
        return None, "its samples are not a list of [key, start, end]"
    return index, ""


def index_mismatch(url: str, index: dict, positions: Iterable[int]) -> str | None:
    """Why ``index`` does not describe the local shard ``url`` at the given sample positions, or
    None if the sample at each position is where the index says and has the indexed key."""
    spans = index["samples"]
    for j in positions:
        key, start, end = spans[j]
        try:
            found = read_sample(url, (start, end))["__key__"]
        except (ShardError, OSError) as exc:
            return f"sample {j} ({key!r}) is not at bytes [{start}, {end}): {exc}"
        if found != key:
            return f"sample {j} at byte {start} is {found!r}, the index says {key!r}"
    return None


def sample_count(url: str, options: UrlOptions | None = None) -> int:
    """Number of samples in a shard: from its index if present, else by a header scan."""
    index = read_index(url, options)
    if index is not None:
        return len(index["samples"])
    return sum(1 for _ in _spans(url, options))


def read_sample(url: str, span: tuple[int, int]) -> dict:
    """Read the one sample stored in byte span [start, end) of a local uncompressed shard."""
    path = local_path(url)
    if path is None:
        raise ValueError(f"random access needs a local shard, not {url}")
    start, end = span
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    if len(data) != end - start:
        raise ShardError(f"sample span [{start}, {end}) is past the end of the shard", url, start)
    samples = list(group_samples(iter_members(memory_source(data, url), url, whole=False), url))
    if len(samples) != 1:
        raise ShardError(f"span [{start}, {end}) holds {len(samples)} samples, expected 1", url,
                         start)
    return samples[0]
