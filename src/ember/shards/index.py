"""Per-shard index files: the byte span of every sample, for counting, random access and
re-sharding without decoding.

An index is a small JSON file next to the shard (``shard.tar`` -> ``shard.tar.idx``) holding the
shard's size and, per sample, its key and the byte span [start, end) of its members in the
(uncompressed) tar stream. An index whose size no longer matches its shard is stale and ignored;
:func:`index_mismatch` checks single spans against the shard before anything relies on them.
"""

from __future__ import annotations

import json
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

    The index of a local shard must match the shard's size; a stale one is ignored with a warning.
    """
    try:
        path = local_path(url)
        if path is not None:
            p = index_path(url)
            if not p.exists():
                return None
            index = json.loads(p.read_text())
            try:
                size = path.stat().st_size
            except OSError:
                return None  # the shard itself is missing: reading it reports that
            if index.get("size") not in (None, size):
                warnings.warn(f"ignoring stale index {p}: the shard is {size} bytes, the index "
                              f"was made for {index.get('size')} bytes")
                return None
        else:
            where = sibling_url(url, INDEX_SUFFIX)
            if where is None:
                return None  # no file lies beside a command's output
            stream = open_url(where, options)
            try:
                index = json.loads(stream.read())
            finally:
                stream.close()
    except ShardError:
        return None
    if index.get("format") != _FORMAT:
        raise ShardError("not an ember shard index", url + INDEX_SUFFIX)
    return index


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
