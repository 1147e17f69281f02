"""ShardLoader's grouped worker-to-main-process transfer: same samples, the documented order,
exact resumption at any point inside or between groups."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ember.shards import ShardDataset, ShardError, ShardLoader, ShardWriter, plan
from ember.shards.loader import DEFAULT_TRANSFER_GROUP
from ember.shards.urls import expand_urls

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _key(item):
    return item["__key__"] if isinstance(item, dict) else item


def _keys(loader) -> list:
    return [_key(s) for s in loader]


def _expected_order(urls: list[str], per_shard: dict[str, list[str]], *, seed: int, epoch: int,
                    num_workers: int, group: int) -> list[str]:
    """Round robin over the workers' streams, one group of up to ``group`` samples per turn,
    skipping streams that have ended: the documented delivery order."""
    streams = []
    for w in range(num_workers):
        idx = plan.worker_shards(len(urls), seed=seed, epoch=epoch, rank=0, world=1, worker=w,
                                 num_workers=num_workers)
        streams.append([k for i in idx for k in per_shard[urls[i]]])
    out, pos = [], [0] * num_workers
    while any(p < len(s) for p, s in zip(pos, streams, strict=True)):
        for w, s in enumerate(streams):
            out += s[pos[w] : pos[w] + group]
            pos[w] = min(pos[w] + group, len(s))
    return out


def _uneven(tmp_path, sizes):
    urls, per_shard = [], {}
    for i, n in enumerate(sizes):
        path = str(tmp_path / f"g-{i:03d}.tar")
        with ShardWriter(path.replace(f"{i:03d}", "%03d"), maxcount=10**6, start_shard=i) as w:
            for j in range(n):
                w.write({"__key__": f"g{i:03d}_{j:03d}", "cls": j})
        urls.append(path)
        per_shard[path] = [f"g{i:03d}_{j:03d}" for j in range(n)]
    return urls, per_shard


@pytest.mark.parametrize("num_workers", [2, 3])
@pytest.mark.parametrize("group", [1, 3, 5, None])
def test_groups_deliver_the_same_samples_in_the_documented_order(tmp_path, num_workers, group):
    urls, per_shard = _uneven(tmp_path, [7, 12, 3, 9, 1, 10, 6, 8])
    all_keys = [k for u in urls for k in per_shard[u]]
    for epoch in range(2):
        ds = ShardDataset(urls, seed=3)
        ds.set_epoch(epoch)
        loader = ShardLoader(ds, num_workers=num_workers, transfer_group=group)
        got = _keys(loader)
        per_item = _keys(ShardLoader(ds, num_workers=num_workers, transfer_group=1))
        assert Counter(got) == Counter(per_item) == Counter(all_keys)
        size = DEFAULT_TRANSFER_GROUP if group is None else group
        assert got == _expected_order(urls, per_shard, seed=3, epoch=epoch,
                                      num_workers=num_workers, group=size)
        assert loader.epoch == epoch + 1


def test_default_group_sizes(make_shards):
    pattern, _ = make_shards(2, 4)
    ds = ShardDataset(pattern)
    assert ShardLoader(ds, num_workers=2).transfer_group == DEFAULT_TRANSFER_GROUP
    assert ShardLoader(ds.batched(4), num_workers=2).transfer_group == 1  # batches go as they are
    assert ShardLoader(ds.batched(4), num_workers=2, transfer_group=8).transfer_group == 8
    assert ShardLoader(ds, num_workers=0, transfer_group=8).transfer_group == 1
    with pytest.raises(ValueError, match="transfer_group"):
        ShardLoader(ds, num_workers=2, transfer_group=0)


@pytest.mark.parametrize("num_workers, group", [(2, 4), (3, 5), (2, None), (3, 1)])
def test_resume_inside_and_between_groups_is_exact(tmp_path, num_workers, group, stop_and_resume):
    urls, per_shard = _uneven(tmp_path, [7, 12, 3, 9, 1, 10, 6, 8])

    def make():
        return ShardDataset(urls, seed=8).shuffle(5)

    full = _keys(ShardLoader(make(), num_workers=num_workers, transfer_group=group))
    assert Counter(full) == Counter(k for u in urls for k in per_shard[u])
    rng = random.Random(7 * num_workers + (group or 0))
    size = group or DEFAULT_TRANSFER_GROUP
    # random points, group boundaries, and the last samples (streams that have ended)
    stops = set(rng.sample(range(1, len(full)), 6)) | {size, size + 1, len(full) - 1}
    for stop in sorted(s for s in stops if 0 < s < len(full)):
        head, tail, resumed, state = stop_and_resume(make, num_workers, stop, transfer_group=group)
        assert sum(state["consumed"]) == stop  # what the loop got, not what the workers sent
        assert head + tail == full, stop
        assert resumed.epoch == 1


def test_resume_twice_in_one_epoch(tmp_path):
    urls, _ = _uneven(tmp_path, [9, 4, 11, 6, 7])

    def make():
        return ShardLoader(ShardDataset(urls, seed=2).shuffle(3), num_workers=2, transfer_group=3)

    full = _keys(make())
    got, state = [], None
    for stop in (5, 11, 17):
        loader = make()
        if state is not None:
            loader.load_state_dict(state)
        for s in loader:
            got.append(_key(s))
            if len(got) == stop:
                break
        state = loader.state_dict()
    loader = make()
    loader.load_state_dict(state)
    assert got + _keys(loader) == full


def test_resume_uses_the_saved_group_size(tmp_path):
    urls, _ = _uneven(tmp_path, [9, 4, 11, 6, 7])

    def make(group):
        return ShardLoader(ShardDataset(urls, seed=2), num_workers=2, transfer_group=group)

    full = _keys(make(4))
    loader = make(4)
    head = []
    for s in loader:
        head.append(_key(s))
        if len(head) == 6:
            break
    state = loader.state_dict()
    assert state["transfer_group"] == 4
    resumed = make(16)
    resumed.load_state_dict(state)
    assert head + _keys(resumed) == full
    assert resumed.state_dict()["transfer_group"] == 16  # the next epoch uses its own


def test_batched_pipeline_resumes_exactly_with_groups(make_shards):
    pattern, keys = make_shards(7, 9)

    def make(group):
        ds = ShardDataset(pattern, seed=6).shuffle(10).map(_key).batched(4, collation_fn=None)
        return ShardLoader(ds, num_workers=3, transfer_group=group)

    for group in (None, 2):
        full = _keys(make(group))
        assert sorted(k for b in full for k in b) == sorted(keys)
        for stop in (1, 3, 7, len(full) - 1):
            loader = make(group)
            head = []
            for b in loader:
                head.append(b)
                if len(head) == stop:
                    break
            resumed = make(group)
            resumed.load_state_dict(loader.state_dict())
            assert head + _keys(resumed) == full


def test_samples_grouped_before_an_error_arrive_before_it(make_shards):
    pattern, keys = make_shards(2, 8)
    urls = expand_urls(pattern)
    with open(urls[1], "rb") as f:
        data = f.read()
    with open(urls[1], "wb") as f:
        f.write(data[: len(data) // 2 + 100])  # cut inside a member of a middle sample
    loader = ShardLoader(ShardDataset(urls, shuffle_shards=False), num_workers=2)
    got = []
    with pytest.raises(ShardError):
        for s in loader:
            got.append(s["__key__"])
    second = [k for k in got if k in keys[8:]]
    assert second == keys[8 : 8 + len(second)] and len(second) >= 3
    # the same samples as per-item transfer delivers from that shard before its error
    per_item = []
    with pytest.raises(ShardError):
        for s in ShardLoader(ShardDataset(urls, shuffle_shards=False), num_workers=2,
                             transfer_group=1):
            per_item.append(s["__key__"])
    assert [k for k in per_item if k in keys[8:]] == second


def test_error_counts_with_groups(make_shards, tmp_path):
    pattern, keys = make_shards(6, 5)
    urls = expand_urls(pattern)
    with open(urls[2], "r+b") as f:
        f.seek(600)
        f.write(b"\xff" * 512)
    loader = ShardLoader(ShardDataset(urls, shuffle_shards=False, on_error="skip"),
                         num_workers=2, transfer_group=3)
    got = _keys(loader)
    assert set(got) >= set(keys[:10]) | set(keys[15:])
    assert loader.error_count == 1


def test_a_user_final_scope_stage_sends_its_batches_one_at_a_time(make_shards):
    from ember.shards import stages as stage_module

    class _Groups(stage_module.Stage):
        name = "groups_for_group_test"
        ray_scope = "final"

        def __init__(self, size: int):
            self.batchsize, self.collation_fn, self.partial = size, None, True

        def apply(self, src, ctx, index):
            return stage_module.batched(src, self.batchsize, ctx.collate(None), True)

    pattern, _ = make_shards(2, 4)
    try:
        ds = ShardDataset(pattern).groups_for_group_test(3)
        assert ShardLoader(ds, num_workers=2).transfer_group == 1
    finally:
        stage_module.REGISTRY.pop("groups_for_group_test", None)
        delattr(ShardDataset, "groups_for_group_test")
