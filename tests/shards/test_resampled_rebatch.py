"""Ported webdataset pipelines on shards written by the webdataset package: resampled streams
with with_epoch and exact resume at random points; loader-level unbatched/shuffle/batched
across workers with exact resume."""

from __future__ import annotations

import random
from collections import Counter
from itertools import islice

import pytest
import torch
import webdataset as wds

from ember.shards import ShardDataset, ShardLoader
from ember.shards.index import write_index

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _wds_shards(tmp_path, nshards=6, per_shard=10, index=False):
    """Shards written by webdataset's TarWriter; returns (urls, keys)."""
    urls, keys = [], []
    for i in range(nshards):
        url = str(tmp_path / f"w-{i:03d}.tar")
        with wds.TarWriter(url) as w:
            for j in range(per_shard):
                key = f"w{i:03d}_{j:03d}"
                keys.append(key)
                w.write({"__key__": key, "cls": i * per_shard + j, "txt": key})
        if index:
            write_index(url)
        urls.append(url)
    return urls, keys


def _k(s):
    return s["__key__"]


def test_resampled_draws_shards_with_replacement_deterministically(tmp_path):
    urls, keys = _wds_shards(tmp_path)
    ds = ShardDataset(urls, resampled=True, seed=3).map(_k)
    got = list(islice(iter(ds), 600))  # endless: more than the 60 samples
    assert set(got) <= set(keys) and len(got) == 600
    shard_runs = [got[i][:4] for i in range(0, 600, 10)]  # shards are read whole, in draws
    assert all(len(set(got[i:i + 10])) == 10 for i in range(0, 600, 10))
    counts = Counter(shard_runs)
    assert len(counts) == 6 and max(counts.values()) > 10  # drawn with replacement (60 draws)
    assert counts.most_common(1)[0][1] < 25  # and not stuck on one shard
    again = ShardDataset(urls, resampled=True, seed=3).map(_k)
    assert list(islice(iter(again), 600)) == got
    epoch1 = ShardDataset(urls, resampled=True, seed=3).map(_k)
    epoch1.set_epoch(1)
    assert list(islice(iter(epoch1), 600)) != got
    with pytest.raises(ValueError, match="equalize= does not apply to resampled=True"):
        ShardDataset(urls, resampled=True, equalize="drop")


def test_resampled_workers_and_ranks_draw_differently(tmp_path):
    urls, _ = _wds_shards(tmp_path)
    ds = ShardDataset(urls, resampled=True, seed=5).map(_k).with_epoch(40)
    got = list(ShardLoader(ds, num_workers=2, transfer_group=40))
    assert len(got) == 80 and got[:40] != got[40:]
    r0 = list(ShardDataset(urls, resampled=True, seed=5, rank=0, world_size=2).with_epoch(40))
    r1 = list(ShardDataset(urls, resampled=True, seed=5, rank=1, world_size=2).with_epoch(40))
    assert [_k(s) for s in r0] != [_k(s) for s in r1]


@pytest.mark.parametrize("index", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resampled_with_epoch_resumes_exactly_at_random_points(tmp_path, index, num_workers,
                                                              stop_and_resume):
    urls, _ = _wds_shards(tmp_path, index=index)

    def make():
        return (ShardDataset(urls, resampled=True, seed=11).shuffle(15).map(_k)
                .with_epoch(45))

    full_loader = ShardLoader(make(), num_workers=num_workers, transfer_group=8)
    epochs = [list(full_loader) for _ in range(2)]
    assert epochs[0] != epochs[1] and len(epochs[1]) == 45 * max(1, num_workers)
    rng = random.Random(num_workers * 2 + index)
    for stop in sorted(rng.sample(range(1, len(epochs[0])), 3)):
        head, rest, resumed, state = stop_and_resume(make, num_workers, stop, transfer_group=8)
        assert head + rest == epochs[0]
        assert list(resumed) == epochs[1]  # and the next epoch is the uninterrupted one's


def _pairs(ds):
    return ds.map(lambda s: (s["__key__"], int(s["cls"])))


def _keys_of_batches(batches):
    return [k for keys, _ in batches for k in keys]


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_loader_level_rebatching_across_workers(tmp_path, num_workers):
    urls, keys = _wds_shards(tmp_path, nshards=7, per_shard=9)
    base = _pairs(ShardDataset(urls, seed=2)).batched(4)
    loader = ShardLoader(base, num_workers=num_workers).unbatched().shuffle(20).batched(6)
    e0, e1 = list(loader), list(loader)
    for e in (e0, e1):
        assert Counter(_keys_of_batches(e)) == Counter(keys)
        assert [len(b[0]) for b in e] == [6] * 10 + [3]
        assert all(isinstance(b[1], torch.Tensor) and b[1].shape == (len(b[0]),) for b in e)
        assert all(int(c) == keys.index(k) for keys_, cs in e for k, c in zip(keys_, cs, strict=True))
    assert _keys_of_batches(e0) != _keys_of_batches(e1)
    plain = ShardLoader(base, num_workers=num_workers).unbatched().batched(6)
    assert _keys_of_batches(list(plain)) != _keys_of_batches(e0)  # the shuffle does shuffle
    again = ShardLoader(base, num_workers=num_workers).unbatched().shuffle(20).batched(6)
    assert _keys_of_batches(list(again)) == _keys_of_batches(e0)
    whole = ShardLoader(base, num_workers=num_workers).unbatched().batched(6, partial=False)
    assert [len(b[0]) for b in whole] == [6] * 10


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_level_rebatching_resumes_exactly(tmp_path, num_workers):
    urls, _ = _wds_shards(tmp_path, nshards=5, per_shard=8, index=True)

    def make():
        return ShardLoader(_pairs(ShardDataset(urls, seed=6)).batched(3),
                           num_workers=num_workers).unbatched().shuffle(12).batched(5)

    ref = make()
    full = [_keys_of_batches([b]) for b in ref]
    nxt = [_keys_of_batches([b]) for b in ref]
    # every stop point, including the last batches, made from the buffer after the workers ended
    for stop in range(1, len(full)):
        loader = make()
        head = []
        for b in loader:
            head.append(_keys_of_batches([b]))
            if len(head) == stop:
                break
        state = loader.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        assert head + [_keys_of_batches([b]) for b in resumed] == full, stop
        assert [_keys_of_batches([b]) for b in resumed] == nxt, stop
    with pytest.raises(ValueError, match="loader-level stages"):
        ShardLoader(_pairs(ShardDataset(urls, seed=6)),
                    num_workers=num_workers).load_state_dict(state)


def test_unbatched_refuses_what_is_not_a_batch(tmp_path):
    urls, _ = _wds_shards(tmp_path, nshards=1, per_shard=2)
    loader = ShardLoader(ShardDataset(urls).map(lambda s: 3)).unbatched()
    with pytest.raises(TypeError, match="unbatched\\(\\) needs batches"):
        list(loader)
