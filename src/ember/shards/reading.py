"""Reading the raw samples of shards: one shard's samples from its URL (:func:`iter_shard`, or
from a sample's byte offset taken from the shard's index), the rank and world size a dataset
splits over (:func:`rank_and_world`), and the error policy (``on_error``) that skips and counts
unreadable shards and samples.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ember.shards.errors import ShardError
from ember.shards.format import group_samples
from ember.shards.tar import iter_members, open_tar_source
from ember.shards.urls import UrlOptions, open_url, parsed_to_end

__all__ = ["iter_shard", "rank_and_world"]


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
            src.finish()  # after the last sample: a gzip trailer cut short is an error too
        finally:
            src.close()
        parsed_to_end(stream)
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
