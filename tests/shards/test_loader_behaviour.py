"""Loader behaviour that webdataset users rely on: epochs with plain DataLoaders (persistent
workers too), with_epoch continuing the streams, fewer shards than streams, per-rank URL lists
and custom splitters, collate_fn/batch_size, len()."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import webdataset as wds
from torch.utils.data import DataLoader

from ember.shards import ShardDataset, ShardLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _key(s):
    return s["__key__"]


def _reference(pattern, epoch, num_workers, **kw):
    """The epoch's order as ShardLoader (per-item transfer, like DataLoader) delivers it."""
    ds = ShardDataset(pattern, seed=4, **kw).shuffle(7).map(_key)
    ds.set_epoch(epoch)
    if num_workers == 0:
        return list(ds)
    return list(ShardLoader(ds, num_workers=num_workers, transfer_group=1))


@pytest.mark.parametrize("persistent", [False, True])
def test_plain_dataloader_gets_a_new_order_every_epoch(make_shards, persistent):
    pattern, keys = make_shards(6, 5)
    ds = ShardDataset(pattern, seed=4).shuffle(7).map(_key)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)
    epochs = [list(loader) for _ in range(3)]
    for e, got in enumerate(epochs):
        assert Counter(got) == Counter(keys)
        assert got == _reference(pattern, e, 2)
    assert epochs[0] != epochs[1] != epochs[2]
    # set_epoch reaches the (persistent) workers
    ds.set_epoch(7)
    assert list(loader) == _reference(pattern, 7, 2)
    assert list(loader) == _reference(pattern, 8, 2)


def test_direct_iteration_and_dataloader_follow_the_same_rule(make_shards):
    pattern, _ = make_shards(6, 5)
    direct = ShardDataset(pattern, seed=4).shuffle(7).map(_key)
    single = DataLoader(ShardDataset(pattern, seed=4).shuffle(7).map(_key), batch_size=None)
    for e in range(3):
        assert list(direct) == list(single) == _reference(pattern, e, 0)
    # an iteration broken off early still counts as that epoch: the next one moves on
    it = iter(direct)
    next(it)
    del it
    assert list(direct) == _reference(pattern, 4, 0)


def test_with_epoch_continues_the_streams_across_epochs(make_shards):
    pattern, keys = make_shards(10, 20)  # 200 samples
    ds = ShardDataset(pattern, shuffle_shards=False).with_epoch(20)
    seen = [[_key(s) for s in ds] for _ in range(3)]
    assert [k for e in seen for k in e] == keys[:60]  # 60 distinct, where the last epoch stopped
    # the same through fresh workers (ShardLoader) and a plain DataLoader with persistent workers
    # (each worker continues its own stream: worker w reads shards w, w + 2, ...)
    base = ShardDataset(pattern, shuffle_shards=False).with_epoch(15).map(_key)
    per_worker = {w: [k for i in range(w, 10, 2) for k in keys[i * 20:(i + 1) * 20]]
                  for w in (0, 1)}
    loader = ShardLoader(base, num_workers=2, transfer_group=1)
    persistent = DataLoader(base, batch_size=None, num_workers=2, persistent_workers=True)
    for e in range(3):
        want = [per_worker[i % 2][e * 15 + i // 2] for i in range(30)]
        assert list(loader) == want
        assert list(persistent) == want
    # a stream that reaches its end goes on with its next pass
    long = [_key(s) for s in ShardDataset(pattern, shuffle_shards=False).with_epoch(150)]
    long2 = [_key(s) for s in ShardDataset(pattern, shuffle_shards=False).with_epoch(150)]
    ds2 = ShardDataset(pattern, shuffle_shards=False).with_epoch(150)
    list(ds2)
    assert long == long2 == keys[:150]
    assert [_key(s) for s in ds2] == keys[150:] + keys[:100]


def test_with_epoch_resumes_exactly_across_epochs(make_shards, stop_and_resume):
    pattern, _ = make_shards(5, 12, index=True)

    def make():
        return ShardDataset(pattern, seed=2).shuffle(9).map(_key).with_epoch(17)

    for stop in (3, 20, 33):
        loader = ShardLoader(make(), num_workers=2, transfer_group=4)
        list(loader)
        list(loader)  # two epochs: the third continues from item 34 of each stream
        full = list(loader)
        loader2 = ShardLoader(make(), num_workers=2, transfer_group=4)
        list(loader2)
        list(loader2)
        head = []
        for k in loader2:
            head.append(k)
            if len(head) == stop:
                break
        resumed = ShardLoader(make(), num_workers=2, transfer_group=4)
        resumed.load_state_dict(loader2.state_dict())
        assert head + list(resumed) == full


def test_fewer_shards_than_streams(make_shards):
    pattern, keys = make_shards(1, 6)
    # equalize="repeat" and with_epoch: every stream gets its items, no error
    ds = ShardDataset(pattern, equalize="repeat").map(_key).with_epoch(10)
    got = list(ShardLoader(ds, num_workers=2))
    assert len(got) == 20 and set(got) == set(keys)
    ds = ShardDataset(pattern, equalize="repeat", rank=1, world_size=2).map(_key)
    assert len(list(ds)) == 6  # rank 1 repeats the shard to match rank 0
    # plain: each sample once, with a warning naming the problem
    with pytest.warns(UserWarning, match=r"1 shards for 2 reading streams \(1 ranks x 2 workers"):
        got = list(ShardLoader(ShardDataset(pattern, seed=8).map(_key), num_workers=2))
    assert sorted(got) == keys


def test_fewer_shards_than_ranks_warns(make_shards):
    pattern, keys = make_shards(1, 4)
    with pytest.warns(UserWarning, match=r"1 shards for 2 reading streams \(2 ranks x 1 workers"
                      r".*uneven"):
        got = [list(ShardDataset(pattern, seed=9, rank=r, world_size=2)) for r in (1,)]
    assert got == [[]]


def test_a_url_list_split_per_rank_is_not_split_again(make_shards, monkeypatch):
    pattern, keys = make_shards(4, 3)
    urls = wds.shardlists.expand_urls(pattern)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    mine = urls[2:]  # this rank's own list
    split_again = [_key(s) for s in ShardDataset(mine, seed=0)]
    assert len(split_again) == 3  # the default deals the list over the 2 ranks
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        own = [_key(s) for s in ShardDataset(mine, seed=0, nodesplitter=None)]
    assert sorted(own) == keys[6:]


def test_custom_splitters_webdataset_style(make_shards):
    pattern, keys = make_shards(6, 3)

    def odd_shards(src):  # a webdataset-style node splitter: dicts with "url" in and out
        for i, item in enumerate(src):
            if i % 2 == 1:
                yield item

    ds = ShardDataset(pattern, shuffle_shards=False, nodesplitter=odd_shards)
    assert [_key(s) for s in ds] == [k for i in (1, 3, 5) for k in keys[i * 3:(i + 1) * 3]]
    # webdataset's own split_by_worker, in DataLoader workers: every sample once
    ds = ShardDataset(pattern, seed=1, workersplitter=wds.split_by_worker).map(_key)
    got = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert sorted(got) == keys
    # no worker split: every worker reads every shard
    ds = ShardDataset(pattern, seed=1, workersplitter=None).map(_key)
    assert Counter(DataLoader(ds, batch_size=None, num_workers=2)) == Counter(keys * 2)
    with pytest.raises(ValueError, match="equalize= needs ember's own splitting"):
        ShardDataset(pattern, nodesplitter=None, equalize="drop")
    with pytest.raises(ValueError, match="nodesplitter='auto', None or a callable"):
        ShardDataset(pattern, nodesplitter="rank")
    with pytest.raises(TypeError, match="nodesplitter must yield URL strings"):
        list(ShardDataset(pattern, nodesplitter=lambda src: [1]))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_collate_fn_gets_what_a_dataloader_user_expects(make_shards, num_workers):
    pattern, keys = make_shards(4, 5)
    seen = []

    def batch_keys(batch):
        assert isinstance(batch, list) and all(isinstance(s, dict) for s in batch)
        return [s["__key__"] for s in batch]

    loader = ShardLoader(ShardDataset(pattern, seed=0), num_workers=num_workers, batch_size=3,
                         collate_fn=batch_keys)
    for b in loader:
        seen.extend(b)
        assert 1 <= len(b) <= 3
    assert sorted(seen) == keys
    # drop_last as in DataLoader: per worker stream, the short last batch is left out
    loader = ShardLoader(ShardDataset(pattern, seed=0), num_workers=num_workers, batch_size=3,
                         collate_fn=batch_keys, drop_last=True)
    assert all(len(b) == 3 for b in loader)
    # batch_size=None (the default), as in DataLoader: collate_fn sees each sample
    loader = ShardLoader(ShardDataset(pattern, seed=0), num_workers=num_workers,
                         collate_fn=lambda s: (s["__key__"], int(s["cls"])))
    got = list(loader)
    assert sorted(k for k, _ in got) == keys and all(isinstance(c, int) for _, c in got)


def test_len(make_shards):
    pattern, _ = make_shards(4, 5)
    ds = ShardDataset(pattern)
    with pytest.raises(TypeError, match=r"with_length\(n\)"):
        len(ShardLoader(ds))
    with pytest.raises(TypeError, match=r"with_length\(n\)"):
        len(ds)
    assert len(ds.with_length(20)) == 20
    assert len(ShardLoader(ds.with_length(20), num_workers=2)) == 20
    loader = ShardLoader(ds.with_epoch(7), num_workers=2)
    assert len(loader) == 14 == len(list(loader))
    rebatched = ShardLoader(ds.batched(2), num_workers=2).unbatched().batched(5)
    with pytest.raises(TypeError, match=r"loader.with_length\(n\)"):
        len(rebatched)
    assert len(rebatched.with_length(4)) == 4


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_items_arrive_as_the_pipeline_made_them(make_shards, num_workers):
    import numpy as np

    pattern, _ = make_shards(2, 3)
    ds = ShardDataset(pattern).map(lambda s: (s["__key__"], np.zeros(2), [1]))
    for item in ShardLoader(ds, num_workers=num_workers):
        # DataLoader's default_convert would make the tuple a list and the array a tensor
        assert type(item) is tuple and isinstance(item[1], np.ndarray) and item[2] == [1]


def test_epochs_reach_spawned_persistent_workers(make_shards):
    # spawn (the macOS/Windows default) pickles the dataset into each worker: the epoch counter
    # must travel as shared memory, not as a copy
    pattern, keys = make_shards(4, 3)
    ds = ShardDataset(pattern, seed=4).shuffle(7).map(_key)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="spawn")
    first, second = list(loader), list(loader)
    ds.set_epoch(5)
    fifth = list(loader)
    assert first == _reference(pattern, 0, 2) and second == _reference(pattern, 1, 2)
    assert fifth == _reference(pattern, 5, 2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_bad_shard_after_a_streams_last_item_is_counted(make_shards, tmp_path, num_workers):
    # the error comes after the last item the stream hands out (a full batch just before it):
    # the count must still reach the loader, and the items must be those without the bad shard
    pattern, keys = make_shards(2, 4)
    (tmp_path / "s-zzz.tar").write_bytes(b"")
    (tmp_path / "s-zzy.tar").write_bytes(b"not a tar archive at all" * 30)
    urls = [pattern.replace("{000..001}", n) for n in ("000", "001")]
    urls += [str(tmp_path / "s-zzy.tar"), str(tmp_path / "s-zzz.tar")]
    ds = ShardDataset(urls, shuffle_shards=False, on_error="skip").to_tuple("__key__").batched(4)
    loader = ShardLoader(ds, num_workers=num_workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = [k for batch in loader for k in batch[0]]
    assert sorted(got) == keys
    assert loader.error_count == 2
