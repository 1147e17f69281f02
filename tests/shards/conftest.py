"""Shared helpers for the ember.shards tests: small shards written in a temp directory."""

from __future__ import annotations

import os

import pytest

from ember.shards import ShardWriter


def write_shards(directory, nshards: int, per_shard: int, *, prefix: str = "s",
                 payload: int = 16, index: bool = False) -> tuple[str, list[str]]:
    """Write ``nshards`` shards of ``per_shard`` samples (with ``.idx`` files if ``index``);
    returns (brace pattern, all keys)."""
    keys = []
    with ShardWriter(os.path.join(directory, f"{prefix}-%03d.tar"), maxcount=per_shard,
                     index=index) as w:
        for i in range(nshards * per_shard):
            key = f"{prefix}{i:05d}"
            keys.append(key)
            w.write({"__key__": key, "cls": i, "bin": bytes([i % 256]) * payload})
    pattern = os.path.join(directory, f"{prefix}-{{000..{nshards - 1:03d}}}.tar")
    return pattern, keys


@pytest.fixture
def make_shards(tmp_path):
    """``make_shards(nshards, per_shard, prefix=..., payload=..., index=...)`` -> (pattern, keys)."""
    return lambda *a, **k: write_shards(tmp_path, *a, **k)


@pytest.fixture
def shards(tmp_path):
    """Six shards of ten samples each."""
    return write_shards(tmp_path, 6, 10)
