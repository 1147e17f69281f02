"""RayShardLoader's checks that need no Ray: what it refuses, and that Ray stays optional."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ember.shards import RayShardLoader, ShardDataset


def test_importing_ember_shards_does_not_import_ray():
    code = "import sys, ember.shards, ember.train.data; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_refuses_what_it_cannot_run_naming_it(tmp_path):
    url = str(tmp_path / "x.tar")
    with pytest.raises(ValueError, match="batched.* last stage.*'map'"):
        RayShardLoader(ShardDataset(url).batched(2).map(len))
    with pytest.raises(ValueError, match="with_epoch"):
        RayShardLoader(ShardDataset(url).with_epoch(3))
    with pytest.raises(ValueError, match="'slice' stage"):
        RayShardLoader(ShardDataset(url).slice(2))
    with pytest.raises(ValueError, match="max_in_flight must be >= 1"):
        RayShardLoader(ShardDataset(url), max_in_flight=0)
    with pytest.raises(ValueError, match="nodesplitter='auto'"):
        RayShardLoader(ShardDataset(url, nodesplitter=None)).split(2)


@pytest.mark.parametrize("call, error, name", [
    (lambda ds: RayShardLoader(ds, max_in_flight=2.5), TypeError, "max_in_flight"),
    (lambda ds: RayShardLoader(ds, transfer_group=2.5), TypeError, "transfer_group"),
    (lambda ds: RayShardLoader(ds, rank=0.5, world_size=2), TypeError, "rank"),
    (lambda ds: RayShardLoader(ds, rank=0, world_size=2.5), TypeError, "world_size"),
    (lambda ds: RayShardLoader(ds).split(2.5), TypeError, "n"),
    (lambda ds: RayShardLoader(ds).split(0), ValueError, "n"),
    (lambda ds: RayShardLoader(ds).set_epoch(1.5), TypeError, "epoch"),
])
def test_counts_are_checked_naming_the_argument(tmp_path, call, error, name):
    # these once took int(2.5) == 2 silently
    with pytest.raises(error, match=rf"\b{name}\b"):
        call(ShardDataset(str(tmp_path / "x.tar")))


def test_ember_train_refuses_workers_with_ray_address(tmp_path, capsys):
    from ember.cli import main

    pattern = str(tmp_path / "s-{000000..000001}.tar")
    code = main(["train", "--data", pattern, "--num-classes", "3", "--workers", "2",
                 "--ray-address", "auto", "--out", str(tmp_path)])
    assert code == 2
    assert "ember train: error: --workers applies to local reading" in capsys.readouterr().err


def test_split_loaders_pickle_with_their_rank(tmp_path):
    import pickle

    parts = RayShardLoader(ShardDataset(str(tmp_path / "s-{0..3}.tar"), seed=5)).split(2)
    back = pickle.loads(pickle.dumps(parts[1]))
    assert (back.rank, back.world_size, back.dataset.seed) == (1, 2, 5)
    assert back.state_dict()["rank"] == 1


def test_without_ray_a_clear_error(tmp_path, monkeypatch, capsys):
    from PIL import Image

    from ember.cli import main
    from ember.shards import ShardWriter

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    loader = RayShardLoader(ShardDataset(str(tmp_path / "x.tar")))
    with pytest.raises(ImportError, match=r"RayShardLoader needs Ray: pip install 'ember\[ray\]'"):
        iter(loader).__next__()
    with ShardWriter(str(tmp_path / "s-%06d.tar"), maxcount=10) as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", "png": Image.new("RGB", (4, 4)), "cls": i % 2})
    code = main(["train", "--data", str(tmp_path / "s-000000.tar"), "--num-classes", "2",
                 "--ray-address", "auto", "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "ember train: error: --ray-address: RayShardLoader needs Ray" in err


def test_a_final_scope_stage_must_say_how_it_batches(tmp_path):
    from ember.shards import stages as stage_module

    class _Vague(stage_module.Stage):
        name = "vague_final_for_test"
        ray_scope = "final"

    try:
        with pytest.raises(ValueError, match="vague_final_for_test.*batchsize"):
            RayShardLoader(ShardDataset(str(tmp_path / "x.tar")).vague_final_for_test())
    finally:
        stage_module.REGISTRY.pop("vague_final_for_test", None)
        delattr(ShardDataset, "vague_final_for_test")
