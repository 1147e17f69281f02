"""ShardLoader(persistent_workers=True): the workers are kept across epochs, every epoch has its
own order (the same as with fresh workers), set_epoch reaches them, and resume stays exact."""

from __future__ import annotations

import pytest

from ember.shards import ShardDataset, ShardLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def sample_key(s):
    return s["__key__"]


def _make(urls):
    return ShardDataset(urls, seed=4).shuffle(10).map(sample_key)


@pytest.mark.parametrize("group", [1, 8])
def test_persistent_epochs_differ_and_match_fresh_workers(make_shards, group):
    urls, _ = make_shards(6, 10)
    fresh = ShardLoader(_make(urls), num_workers=2, transfer_group=group)
    kept = ShardLoader(_make(urls), num_workers=2, transfer_group=group, persistent_workers=True)
    want = [list(fresh) for _ in range(3)]
    got = [list(kept) for _ in range(3)]
    assert got == want
    assert len({tuple(e) for e in got}) == 3 and all(sorted(e) == sorted(got[0]) for e in got)
    workers = kept._kept[0]._iterator._workers
    list(kept)
    assert kept._kept[0]._iterator._workers is workers  # the same worker processes
    kept.set_epoch(1)
    assert list(kept) == want[1]
    assert kept.epoch == 2


def test_persistent_resume_and_break_are_exact(make_shards, stop_and_resume):
    urls, _ = make_shards(6, 10)
    fresh = ShardLoader(_make(urls), num_workers=2)
    epochs = [list(fresh) for _ in range(2)]
    head, rest, resumed, state = stop_and_resume(lambda: _make(urls), 2, 23,
                                                 persistent_workers=True)
    assert head + rest == epochs[0]
    assert list(resumed) == epochs[1]  # the next epoch through new persistent workers
    kept = ShardLoader(_make(urls), num_workers=2, persistent_workers=True)
    for i, _ in enumerate(kept):
        if i == 5:
            break
    assert list(kept) == epochs[0]  # a break does not advance the epoch
    with pytest.raises(ValueError, match="num_workers >= 1"):
        ShardLoader(_make(urls), persistent_workers=True)


@pytest.mark.parametrize("resampled", [False, True])
def test_persistent_with_epoch_continues_like_fresh_workers(make_shards, resampled):
    urls, _ = make_shards(4, 10)

    def make():
        return ShardDataset(urls, seed=1, shuffle_shards=False, resampled=resampled) \
            .map(sample_key).with_epoch(7)

    fresh = ShardLoader(make(), num_workers=2)
    kept = ShardLoader(make(), num_workers=2, persistent_workers=True)
    want = [list(fresh) for _ in range(4)]
    assert [list(kept) for _ in range(4)] == want
    # epochs differ (resampled: drawn, two may draw the same shards)
    assert all(len(e) == 14 for e in want) and len({tuple(e) for e in want}) >= 3 - resampled


def test_persistent_loader_level_stages_resume(make_shards):
    urls, _ = make_shards(4, 10)

    def loader(persistent):
        ds = ShardDataset(urls, seed=3).map(sample_key).batched(4, collation_fn=list)
        return ShardLoader(ds, num_workers=2, persistent_workers=persistent) \
            .unbatched().shuffle(7).batched(5, collation_fn=list)

    fresh = loader(False)
    want = [list(fresh) for _ in range(3)]
    kept = loader(True)
    assert [list(kept) for _ in range(2)] == want[:2] and want[0] != want[1]
    it = iter(kept)  # epoch 2, broken off after 3 batches
    head = [next(it) for _ in range(3)]
    state = kept.state_dict()
    it.close()
    resumed = loader(True)
    resumed.load_state_dict(state)
    assert head + list(resumed) == want[2]
