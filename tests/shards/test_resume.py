"""Splitting over ranks and workers, per-epoch shuffling, exact mid-epoch resumption, equalize."""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest

from ember.shards import ShardDataset, ShardLoader, ShardWriter, plan

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

WORKERS = 3
WORLD = 2


def _key(sample) -> str:
    return sample["__key__"]


def _loader_keys(ds: ShardDataset, num_workers: int) -> list[str]:
    return [s["__key__"] for s in ShardLoader(ds, num_workers=num_workers)]


def _stop_and_resume(make, num_workers: int, stop: int) -> tuple[list[str], list[str], ShardLoader]:
    """Keys read before stopping after ``stop`` samples, the keys a loader resumed from there
    reads, and that loader."""
    loader = ShardLoader(make(), num_workers=num_workers)
    head = []
    for s in loader:
        head.append(_key(s))
        if len(head) == stop:
            break
    state = loader.state_dict()
    resumed = ShardLoader(make(), num_workers=num_workers)
    resumed.load_state_dict(state)
    return head, [_key(s) for s in resumed], resumed


@pytest.fixture
def twelve(make_shards):
    """12 shards of 8 samples."""
    return make_shards(12, 8)


def _uneven(tmp_path, sizes):
    urls, keys = [], []
    for i, n in enumerate(sizes):
        path = str(tmp_path / f"u-{i:03d}.tar")
        with ShardWriter(path.replace(f"{i:03d}", "%03d"), maxcount=10**6, start_shard=i) as w:
            for j in range(n):
                key = f"u{i:03d}_{j:03d}"
                keys.append(key)
                w.write({"__key__": key, "cls": j})
        urls.append(path)
    return urls, keys


# (shards, samples per shard, samples per rank): 6 streams (2 ranks x 3 workers) deal the epoch's
# shard order round-robin, stream s = worker * 2 + rank taking positions s, s + 6, ...; with 13
# shards rank 0's streams 0, 2, 4 get 3 + 2 + 2 shards and rank 1's streams 1, 3, 5 get 2 each
@pytest.mark.parametrize("nshards, per_shard, per_rank", [(12, 8, [48, 48]), (13, 5, [35, 30])])
def test_every_sample_once_per_epoch_2_ranks_3_workers(make_shards, nshards, per_shard,
                                                        per_rank):
    pattern, keys = make_shards(nshards, per_shard)
    for epoch in range(2):
        seen = []
        got_per_rank = []
        for rank in range(WORLD):
            ds = ShardDataset(pattern, seed=5, rank=rank, world_size=WORLD).shuffle(20)
            ds.set_epoch(epoch)
            got = _loader_keys(ds, WORKERS)
            got_per_rank.append(got)
            seen += got
        assert Counter(seen) == Counter(keys)  # each exactly once
        assert set(got_per_rank[0]).isdisjoint(got_per_rank[1])
        assert [len(g) for g in got_per_rank] == per_rank


def test_direct_iteration_splits_like_the_plan(twelve):
    pattern, keys = twelve
    shard_of = {k: int(k[1:]) // 8 for k in keys}
    for rank in range(WORLD):
        ds = ShardDataset(pattern, seed=1, rank=rank, world_size=WORLD)
        got = [_key(s) for s in ds]
        shards_read = list(dict.fromkeys(shard_of[k] for k in got))
        order = plan.shard_order(12, seed=1, epoch=0)
        assert shards_read == order[rank::WORLD]


def test_shard_order_and_shuffle_change_per_epoch_and_reproduce(twelve):
    pattern, keys = twelve

    def run(seed, epoch):
        ds = ShardDataset(pattern, seed=seed).shuffle(30)
        ds.set_epoch(epoch)
        return [_key(s) for s in ds]

    e0, e1 = run(3, 0), run(3, 1)
    assert sorted(e0) == sorted(e1) == sorted(keys)
    assert e0 != e1
    assert run(3, 0) == e0 and run(3, 1) == e1  # reproducible from the seed
    assert run(4, 0) != e0
    # shard order alone (no sample shuffle) also changes per epoch
    orders = [plan.shard_order(12, seed=3, epoch=e) for e in range(3)]
    assert all(sorted(o) == list(range(12)) for o in orders)
    assert len({tuple(o) for o in orders}) == 3
    # samples really are shuffled within the buffer, not only shard-ordered
    unshuffled = [_key(s) for s in ShardDataset(pattern, seed=3)]
    assert e0 != unshuffled and sorted(e0) == sorted(unshuffled)


def test_direct_iteration_advances_epoch(twelve):
    pattern, _ = twelve
    ds = ShardDataset(pattern, seed=2).shuffle(10)
    a = [_key(s) for s in ds]
    assert ds.epoch == 1
    b = [_key(s) for s in ds]
    ref = ShardDataset(pattern, seed=2).shuffle(10)
    ref.set_epoch(1)
    assert b == [_key(s) for s in ref] and a != b


def test_loader_with_workers_is_reproducible(twelve):
    pattern, _ = twelve
    ds = ShardDataset(pattern, seed=9).shuffle(16)
    assert _loader_keys(ds, WORKERS) == _loader_keys(ds, WORKERS)


def test_direct_state_dict_resume(twelve):
    pattern, keys = twelve
    full = [_key(s) for s in ShardDataset(pattern, seed=11).shuffle(25)]
    for stop in (0, 1, 37, 95):
        ds = ShardDataset(pattern, seed=11).shuffle(25)
        it = iter(ds)
        head = [_key(next(it)) for _ in range(stop)]
        state = ds.state_dict()
        it.close()
        resumed = ShardDataset(pattern, seed=11).shuffle(25)
        resumed.load_state_dict(state)
        tail = [_key(s) for s in resumed]
        assert head + tail == full, stop


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_loader_state_dict_resume_at_random_points(twelve, num_workers):
    pattern, keys = twelve
    rng = random.Random(1234 + num_workers)

    def make(rank):
        return ShardDataset(pattern, seed=21, rank=rank, world_size=WORLD).shuffle(12)

    for rank in range(WORLD):
        full = _loader_keys(make(rank), num_workers)
        assert len(full) == 48
        for stop in sorted(rng.sample(range(1, len(full)), 3)):
            head, tail, resumed = _stop_and_resume(lambda rank=rank: make(rank), num_workers, stop)
            assert Counter(head + tail) == Counter(full), (rank, stop)  # nothing lost or repeated
            assert head + tail == full, (rank, stop)  # and in the same order
            assert resumed.epoch == 1


def test_loader_resume_then_next_epoch_matches(twelve):
    pattern, _ = twelve
    ref = ShardLoader(ShardDataset(pattern, seed=4).shuffle(8), num_workers=2)
    ep0 = [_key(s) for s in ref]
    ep1 = [_key(s) for s in ref]
    loader = ShardLoader(ShardDataset(pattern, seed=4).shuffle(8), num_workers=2)
    head = []
    for s in loader:
        head.append(_key(s))
        if len(head) == 50:
            break
    state = loader.state_dict()
    again = ShardLoader(ShardDataset(pattern, seed=4).shuffle(8), num_workers=2)
    again.load_state_dict(state)
    assert head + [_key(s) for s in again] == ep0
    assert [_key(s) for s in again] == ep1 and ep0 != ep1


def test_resume_rejects_mismatched_state(twelve):
    pattern, _ = twelve
    loader = ShardLoader(ShardDataset(pattern, seed=4), num_workers=2)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="workers"):
        ShardLoader(ShardDataset(pattern, seed=4), num_workers=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        ShardLoader(ShardDataset(pattern, seed=5), num_workers=2).load_state_dict(state)


@pytest.mark.parametrize("mode", ["drop", "repeat"])
def test_equalize_gives_every_rank_the_same_count(tmp_path, mode):
    sizes = [3, 9, 4, 12, 5, 7, 2]  # 42 samples, 7 shards: uneven over 2 ranks x 2 workers
    urls, keys = _uneven(tmp_path, sizes)
    for epoch in range(2):
        per_rank = []
        for rank in range(WORLD):
            ds = ShardDataset(urls, seed=8, rank=rank, world_size=WORLD, equalize=mode)
            ds.set_epoch(epoch)
            per_rank.append(_loader_keys(ds, 2))
        # unequalized counts, computed from the plan and the known shard sizes
        raw = []
        for rank in range(WORLD):
            n = 0
            for w in range(2):
                idx = plan.worker_shards(7, seed=8, epoch=epoch, rank=rank, world=WORLD, worker=w,
                                         num_workers=2)
                n += sum(sizes[i] for i in idx)
            raw.append(n)
        assert len(per_rank[0]) == len(per_rank[1])
        seen = Counter(per_rank[0] + per_rank[1])
        if mode == "drop":
            assert max(seen.values()) == 1 and set(seen) <= set(keys)
            assert len(per_rank[0]) <= min(raw)
        else:
            assert set(seen) == set(keys)  # nothing dropped
            assert len(per_rank[0]) >= max(raw)


def test_equalize_uses_index_files(tmp_path):
    from ember.shards.index import write_index

    urls, _ = _uneven(tmp_path, [3, 5, 6])
    for u in urls:
        write_index(u)
    ds = ShardDataset(urls, rank=0, world_size=2, equalize="drop")
    assert ds.ensure_shard_sizes() == [3, 5, 6]
    os.remove(urls[0] + ".idx")
    ds2 = ShardDataset(urls, rank=0, world_size=2, equalize="drop")
    assert ds2.ensure_shard_sizes() == [3, 5, 6]  # scanned


def test_with_epoch_fixed_length(twelve):
    pattern, keys = twelve
    ds = ShardDataset(pattern, seed=0).with_epoch(130)
    got = [_key(s) for s in ds]
    assert len(got) == 130
    assert Counter(got[:96]) == Counter(keys)  # the first pass covers everything once


def test_loader_resume_with_uneven_workers(tmp_path):
    """Workers run out at different times (uneven shards); resumption stays exact after that."""
    sizes = [2, 11, 5, 1, 9, 4, 6]
    urls, keys = _uneven(tmp_path, sizes)

    def make():
        return ShardDataset(urls, seed=13, shuffle_shards=False).shuffle(4)

    full = _loader_keys(make(), WORKERS)
    assert Counter(full) == Counter(keys)
    rng = random.Random(99)
    stops = sorted(set(rng.sample(range(1, len(full)), 4)) | {len(full) - 3, len(full) - 1})
    for stop in stops:
        head, tail, _ = _stop_and_resume(make, WORKERS, stop)
        assert Counter(head + tail) == Counter(full), stop
        assert head + tail == full, stop
