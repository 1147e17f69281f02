"""Per-shard index files: the byte span of every sample, for counting, random access and
re-sharding without decoding.

An index is a small JSON file next to the shard (``shard.tar`` -> ``shard.tar.idx``) holding the
shard's size and, per sample, its key and the byte span [start, end) of its members in the
(uncompressed) tar stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ember.shards.errors import ShardError
from ember.shards.format import group_samples, split_name
from ember.shards.tar import iter_members, memory_source, open_tar_source, scan_members
from ember.shards.urls import UrlOptions, local_path, open_url

__all__ = ["build_index", "write_index", "read_index", "sample_count", "read_sample",
           "INDEX_SUFFIX"]

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
                if kx[0] != key:
                    if key is not None:
                        yield key, start, end
                    key, start = kx[0], s
                end = e
            if key is not None:
                yield key, start, end
        finally:
            src.close()
    finally:
        stream.close()


def build_index(url: str, options: UrlOptions | None = None) -> dict:
    """Scan a shard and return its index (keys and byte spans of every sample)."""
    samples = [[k, s, e] for k, s, e in _spans(url, options)]
    size = None
    path = local_path(url)
    if path is not None:
        size = path.stat().st_size
    return {"format": _FORMAT, "version": 1, "shard": Path(url).name, "size": size,
            "samples": samples}


def index_path(url: str) -> Path:
    """Where the index of a local shard lives."""
    path = local_path(url)
    if path is None:
        raise ValueError(f"index files are written next to local shards only, not {url}")
    return path.with_name(path.name + INDEX_SUFFIX)


def write_index(url: str, options: UrlOptions | None = None) -> Path:
    """Build the index of a local shard and write it next to the shard."""
    index = build_index(url, options)
    out = index_path(url)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(index, separators=(",", ":")))
    tmp.replace(out)
    return out


def read_index(url: str, options: UrlOptions | None = None) -> dict | None:
    """The index of a shard if one exists (and matches a local shard's size), else None."""
    try:
        if local_path(url) is not None:
            p = index_path(url)
            if not p.exists():
                return None
            index = json.loads(p.read_text())
            if index.get("size") not in (None, local_path(url).stat().st_size):
                return None  # stale: the shard changed after indexing
        else:
            stream = open_url(url + INDEX_SUFFIX, options)
            try:
                index = json.loads(stream.read())
            finally:
                stream.close()
    except ShardError:
        return None
    if index.get("format") != _FORMAT:
        raise ShardError("not an ember shard index", url + INDEX_SUFFIX)
    return index


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
