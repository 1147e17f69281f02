"""cache_dir=: remote shards are kept on local disk after their first read (served here by a
local HTTP server on 127.0.0.1), atomically, bounded in size, safe with several workers."""

from __future__ import annotations

import os

import pytest
import webdataset as wds
from test_remote import _http

from ember.shards import ShardDataset, ShardError, ShardLoader
from ember.shards.cache import PART, cache_path

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _wds_files(tmp_path, nshards=4, per_shard=5, payload=100):
    files, keys = {}, []
    for i in range(nshards):
        path = tmp_path / f"c-{i:03d}.tar"
        with wds.TarWriter(str(path)) as w:
            for j in range(per_shard):
                key = f"c{i}_{j}"
                keys.append(key)
                w.write({"__key__": key, "bin": bytes([j]) * payload, "cls": j})
        files[f"/{path.name}"] = path.read_bytes()
    return files, keys


def _keys(ds):
    return [s["__key__"] for s in ds]


def _cache_files(cache):
    return sorted(os.listdir(cache)) if os.path.isdir(cache) else []


def test_second_epoch_reads_the_cache_and_makes_no_requests(tmp_path):
    files, keys = _wds_files(tmp_path)
    cache = tmp_path / "cache"
    with _http(files) as (base, hits):
        urls = [base + p for p in sorted(files)]
        ds = ShardDataset(urls, shuffle_shards=False, cache_dir=cache, timeout=5, retries=2)
        assert _keys(ds) == keys
        assert hits == {p: 1 for p in files}
        assert _keys(ds) == keys  # epoch 1: from disk
        loader = ShardLoader(ShardDataset(urls, seed=1, cache_dir=cache), num_workers=2)
        assert sorted(s["__key__"] for s in loader) == sorted(keys)
        assert hits == {p: 1 for p in files}
    for p, data in files.items():
        assert cache_path(cache, base + p).read_bytes() == data
    assert not [n for n in _cache_files(cache) if n.endswith(PART)]


def test_a_dropped_connection_is_resumed_and_cached_whole(tmp_path):
    files, keys = _wds_files(tmp_path, nshards=1)
    (p, data), = files.items()
    cache = tmp_path / "cache"
    with _http(files, drop={p: 2}) as (base, hits):
        assert _keys(ShardDataset([base + p], cache_dir=cache, timeout=5, retries=3)) == keys
        assert hits[p] == 3
    assert cache_path(cache, base + p).read_bytes() == data


def test_a_failed_download_leaves_no_partial_cache_file(tmp_path):
    files, _ = _wds_files(tmp_path, nshards=1)
    (p, _data), = files.items()
    cache = tmp_path / "cache"
    with _http(files, drop={p: -1}) as (base, hits):
        with pytest.raises(ShardError, match="c-000.tar"):
            _keys(ShardDataset([base + p], cache_dir=cache, timeout=5, retries=2))
        assert hits[p] >= 2
    assert _cache_files(cache) == []  # neither a final copy nor a temporary file
    # a third of the shard arrives (and is written to the temporary file), then every retry
    # fails without progress: the temporary file goes too
    with _http(files, drop={p: 10**6}, honour_range=False) as (base, hits):
        with pytest.raises(ShardError, match="c-000.tar"):
            _keys(ShardDataset([base + p], cache_dir=cache, timeout=5, retries=2))
        assert hits[p] >= 2
    assert _cache_files(cache) == []
    # and a later successful read caches it
    with _http(files) as (base2, _):
        _keys(ShardDataset([base2 + p], cache_dir=cache))
    assert len(_cache_files(cache)) == 1


def test_an_abandoned_read_is_not_cached(tmp_path):
    files, keys = _wds_files(tmp_path, nshards=1, per_shard=8, payload=300_000)  # > 1 MiB left
    (p, data), = files.items()
    cache = tmp_path / "cache"
    with _http(files) as (base, _):
        for _sample in ShardDataset([base + p], cache_dir=cache):
            break
        assert _cache_files(cache) == []
        assert _keys(ShardDataset([base + p], cache_dir=cache)) == keys
    assert cache_path(cache, base + p).read_bytes() == data


def test_cache_size_evicts_the_least_recently_used(tmp_path):
    files, _ = _wds_files(tmp_path, nshards=4, payload=2000)
    size = max(len(d) for d in files.values())
    cache = tmp_path / "cache"
    names = sorted(files)
    with _http(files) as (base, hits):
        urls = [base + p for p in names]
        ds = ShardDataset(urls, shuffle_shards=False, cache_dir=cache, cache_size=int(2.5 * size))
        _keys(ds)
        kept = _cache_files(cache)
        assert len(kept) == 2
        assert sum(os.path.getsize(cache / n) for n in kept) <= 2.5 * size
        assert {cache_path(cache, u).name for u in urls[2:]} == set(kept)  # the latest two
        _keys(ShardDataset(urls[3:], cache_dir=cache, cache_size=int(2.5 * size)))
        assert hits[names[3]] == 1  # still cached
    with pytest.raises(ValueError, match="cache_size= needs cache_dir="):
        ShardDataset(urls, cache_size=10)


def test_workers_caching_the_same_shards_at_once(tmp_path):
    files, keys = _wds_files(tmp_path, nshards=3, payload=50_000)
    cache = tmp_path / "cache"
    with _http(files) as (base, _):
        urls = [base + p for p in sorted(files)]
        # every worker reads every shard: the copies are written concurrently
        ds = ShardDataset(urls, seed=0, workersplitter=None, cache_dir=cache)
        got = [s["__key__"] for s in ShardLoader(ds, num_workers=3)]
    assert sorted(got) == sorted(keys * 3)
    assert len(_cache_files(cache)) == 3
    for p, data in files.items():
        assert cache_path(cache, base + p).read_bytes() == data


def test_equalize_over_http_without_indexes_warns(tmp_path):
    files, keys = _wds_files(tmp_path, nshards=2)
    with _http(files) as (base, hits):
        urls = [base + p for p in sorted(files)]
        with pytest.warns(UserWarning, match=r"has no index file .*downloaded once more"):
            got = _keys(ShardDataset(urls, equalize="drop", timeout=5))
        assert sorted(got) == sorted(keys)
        assert all(hits[p] == 2 for p in files)  # the count, then the read
        # with cache_dir the counting download is the one that fills the cache
        cache = tmp_path / "cache"
        before = dict(hits)
        ds = ShardDataset(urls, equalize="drop", cache_dir=cache)
        assert sorted(_keys(ds)) == sorted(keys)
        assert all(hits[p] == before[p] + 1 for p in files)


@pytest.mark.parametrize("bad", ["cut", "garbage"])
def test_a_cut_short_or_garbage_download_is_not_cached(tmp_path, bad):
    # the server sends a complete HTTP response whose body is not the whole shard: the first
    # part of it (cut at a sample boundary, Content-Length matching), or garbage
    files, keys = _wds_files(tmp_path, nshards=1, per_shard=6)
    (p, data), = files.items()
    first = data[: 512 * 5] if bad == "cut" else b"<html>not a tar</html>" * 50
    cache = tmp_path / "cache"
    with _http({p: [first, data]}) as (base, hits):
        ds = ShardDataset([base + p], cache_dir=cache, on_error="skip")
        assert len(_keys(ds)) < len(keys)
        assert ds.error_count == 1
        assert _cache_files(cache) == []  # neither a final copy nor a temporary file
        assert _keys(ShardDataset([base + p], cache_dir=cache)) == keys  # downloaded again
        assert hits[p] == 2
        assert _keys(ShardDataset([base + p], cache_dir=cache)) == keys  # now from the copy
        assert hits[p] == 2
    assert cache_path(cache, base + p).read_bytes() == data
