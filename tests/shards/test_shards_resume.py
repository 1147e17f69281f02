"""Splitting over ranks/workers, per-epoch shuffling, equalizing, and exact resumption."""

from __future__ import annotations

import random
import subprocess
import tarfile

import pytest

from ember.shards import ShardDataset, ShardLoader, ShardWriter


def _keys(items):
    return [s["__key__"] for s in items]


def test_every_sample_once_per_epoch_across_2_ranks_x_3_workers(make_shards):
    pattern, keys = make_shards(13, 5)
    for epoch in (0, 1):
        seen = []
        for rank in (0, 1):
            ds = ShardDataset(pattern, seed=7, rank=rank, world_size=2).shuffle(8)
            loader = ShardLoader(ds, num_workers=3)
            loader.epoch = epoch
            seen += _keys(loader)
        assert sorted(seen) == sorted(keys)


def test_shuffle_changes_per_epoch_and_is_reproducible(shards):
    pattern, keys = shards
    ds = ShardDataset(pattern, seed=3).shuffle(20)
    e0, e1 = _keys(ds), _keys(ds)  # direct iteration advances the epoch
    again = ShardDataset(pattern, seed=3).shuffle(20)
    assert _keys(again) == e0
    assert e0 != e1 and sorted(e0) == sorted(e1) == sorted(keys)


@pytest.mark.parametrize("mode", ["drop", "repeat"])
def test_equalize_gives_every_rank_the_same_count(make_shards, mode):
    pattern, keys = make_shards(5, 7)
    counts, seen = [], []
    for rank in (0, 1):
        ds = ShardDataset(pattern, seed=1, rank=rank, world_size=2, equalize=mode)
        got = _keys(ShardLoader(ds, num_workers=2))
        counts.append(len(got))
        seen += got
    assert counts[0] == counts[1]
    if mode == "repeat":
        assert set(seen) == set(keys)
    else:
        assert len(set(seen)) == len(seen)


@pytest.mark.parametrize("workers", [0, 3])
def test_resume_at_random_points_yields_exactly_the_rest(make_shards, workers):
    pattern, _ = make_shards(7, 6)

    def make():
        return ShardDataset(pattern, seed=11).shuffle(10).map(lambda s: s["__key__"])

    full = list(ShardLoader(make(), num_workers=workers))
    rng = random.Random(workers)
    for stop in sorted(rng.sample(range(1, len(full)), 3)):
        loader = ShardLoader(make(), num_workers=workers)
        head = []
        for item in loader:
            head.append(item)
            if len(head) == stop:
                state = loader.state_dict()
                break
        resumed = ShardLoader(make(), num_workers=workers)
        resumed.load_state_dict(state)
        assert head + list(resumed) == full


def test_dataset_state_dict_resumes_direct_iteration(shards):
    pattern, _ = shards
    ds = ShardDataset(pattern, seed=5).shuffle(7)
    full = _keys(ShardDataset(pattern, seed=5).shuffle(7))
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(23)]
    state = ds.state_dict()
    ds2 = ShardDataset(pattern, seed=5).shuffle(7)
    ds2.load_state_dict(state)
    assert head + _keys(ds2) == full


def test_writer_output_is_readable_by_tar_tarfile_and_webdataset(tmp_path):
    import numpy as np

    with ShardWriter(str(tmp_path / "w-%02d.tar"), maxcount=3) as w:
        for i in range(7):
            w.write({"__key__": f"dir/{'n' * 120}{i}", "txt": f"t{i}", "cls": i,
                     "json": {"i": i}, "npy": np.arange(i, dtype=np.int32),
                     "png": np.full((4, 5, 3), i, dtype=np.uint8)})
    assert len(w.shards) == 3
    listing = subprocess.run(["tar", "-tf", w.shards[0]], capture_output=True, text=True,
                             check=True).stdout.split()
    assert listing[0] == f"dir/{'n' * 120}0.cls"
    with tarfile.open(w.shards[0]) as tf:
        assert tf.extractfile(f"dir/{'n' * 120}1.txt").read() == b"t1"
    import webdataset as wds

    got = list(wds.WebDataset(str(tmp_path / "w-{00..02}.tar"), shardshuffle=False).decode("rgb8"))
    assert [int(s["cls"]) for s in got] == list(range(7))
    ours = list(ShardDataset(str(tmp_path / "w-{00..02}.tar"), shuffle_shards=False)
                .decode("rgb8"))
    for i, s in enumerate(ours):
        assert s["txt"] == f"t{i}" and s["json"] == {"i": i}
        assert (s["npy"] == np.arange(i)).all() and (s["png"] == i).all()
