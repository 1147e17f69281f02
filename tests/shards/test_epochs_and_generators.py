"""Epoch numbers that count full passes (loader-level stages draining after the workers), and
shuffles drawn from a generator's own stream (ember.csprng generators, OS-keyed or seeded)."""

from __future__ import annotations

import pytest
import webdataset as wds

from ember.shards import ShardDataset, ShardLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

EPOCHS = 3


def _shards(tmp_path, nshards=4, per_shard=6):
    urls = []
    for i in range(nshards):
        url = str(tmp_path / f"e-{i:03d}.tar")
        with wds.TarWriter(url) as w:
            for j in range(per_shard):
                w.write({"__key__": f"e{i:03d}_{j:03d}", "cls": i * per_shard + j})
        urls.append(url)
    return urls


def _pair(sample):
    return sample["__key__"], int(sample["cls"])


def _rebatching(urls, num_workers):
    # the loader's shuffle buffer holds a whole epoch: every batch comes out after the workers end
    ds = ShardDataset(urls, seed=4).map(_pair).batched(3)
    return ShardLoader(ds, num_workers=num_workers).unbatched().shuffle(64).batched(4)


def _keys(batch):
    return tuple(batch[0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epoch_stays_while_loader_stages_drain(tmp_path, num_workers):
    loader = _rebatching(_shards(tmp_path), num_workers)
    seen = []
    for _batch in loader:
        seen.append((loader.epoch, loader.state_dict()["epoch"]))
    assert len(seen) == 6 and seen == [(0, 0)] * 6
    assert loader.epoch == 1 and loader.state_dict()["epoch"] == 1
    for _batch in loader:
        assert loader.epoch == 1 and loader.state_dict()["epoch"] == 1
    assert loader.epoch == 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_loop_over_epochs_skips_no_epoch(tmp_path, num_workers):
    urls = _shards(tmp_path)
    ref = _rebatching(urls, num_workers)
    full = [_keys(b) for _ in range(EPOCHS) for b in ref]
    assert len(full) == 6 * EPOCHS
    for stop in (1, 3, 5, 6):
        loader = _rebatching(urls, num_workers)
        head = []
        for batch in loader:
            head.append(_keys(batch))
            if len(head) == stop:
                break
        state = loader.state_dict()
        resumed = _rebatching(urls, num_workers)
        resumed.load_state_dict(state)
        rest = [_keys(b) for _ in range(state["epoch"], EPOCHS) for b in resumed]
        assert head + rest == full, stop
        # a state saved while draining by an older ember named the next epoch
        older = {k: v for k, v in state.items() if k != "loader_epoch"}
        older["epoch"] += 1
        resumed = _rebatching(urls, num_workers)
        resumed.load_state_dict(older)
        assert resumed.epoch == state["epoch"]
        assert [_keys(b) for b in resumed] == full[stop:6], stop
