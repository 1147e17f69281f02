"""SWAP (ember.swa.swap averaging, ember.train.recipes.swap training) with 2 CPU processes
(gloo on loopback) launched by torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ember.swa import swap_average_, swap_world_size
from ember.train.recipes import swap_fit

pytestmark = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

JOB = Path(__file__).with_name("swap_job.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], timeout: float = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    for _ in range(3):  # the free port can be taken before torchrun binds it: retry that only
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if "address already in use" not in (proc.stdout + proc.stderr).lower():
            break
    return proc


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("swap")
    proc = _torchrun([str(JOB), str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _flat(tensors: list[list[float]]) -> torch.Tensor:
    return torch.cat([torch.tensor(t, dtype=torch.float64) for t in tensors])


def test_after_phase3_every_rank_holds_the_mean_of_the_phase2_weights(two_ranks):
    assert [r["world_size"] for r in two_ranks] == [2, 2]
    mean = (_flat(two_ranks[0]["phase2"]) + _flat(two_ranks[1]["phase2"])) / 2
    final0, final1 = _flat(two_ranks[0]["final"]), _flat(two_ranks[1]["final"])
    assert torch.equal(final0, final1)
    torch.testing.assert_close(final0, mean, rtol=0, atol=1e-6)


def test_phase1_is_in_sync_and_phase2_weights_differ_between_ranks(two_ranks):
    # phase 1 (DDP) ends with the same parameters on both ranks, after 2 epochs of 4 steps
    assert [r["phase1_steps"] for r in two_ranks] == [8, 8]
    assert torch.equal(_flat(two_ranks[0]["phase1"]), _flat(two_ranks[1]["phase1"]))
    diff = (_flat(two_ranks[0]["phase2"]) - _flat(two_ranks[1]["phase2"])).abs().max()
    assert diff > 1e-3
    assert two_ranks[0]["phase2_losses"] != two_ranks[1]["phase2_losses"]


def test_batchnorm_statistics_recomputed_equal_on_every_rank_and_pooled_exactly(two_ranks):
    assert [r["bn_batches"] for r in two_ranks] == [10, 10]
    assert two_ranks[0]["bn_mean"] == two_ranks[1]["bn_mean"]
    assert two_ranks[0]["bn_var"] == two_ranks[1]["bn_var"]
    assert min(two_ranks[0]["bn_var"]) > 0
    # averaging the ranks' statistics equals update_bn on both ranks' batches together
    for key in ("bn_mean", "bn_var"):
        torch.testing.assert_close(torch.tensor(two_ranks[0][key]),
                                   torch.tensor(two_ranks[0][key + "_all_batches"]),
                                   rtol=1e-5, atol=1e-6)


def test_without_a_process_group_swap_refuses():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="at least 2 processes"):
        swap_average_(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="at least 2 processes"):
        swap_fit(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), [], [])


def test_world_size_one_is_a_clear_error():
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="world size of at least 2, got 1"):
            swap_world_size()
        with pytest.raises(RuntimeError, match="world size of at least 2, got 1"):
            swap_average_(nn.Linear(2, 2))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def digits_shards(tmp_path_factory) -> dict:
    pytest.importorskip("sklearn")
    from ember.demo import write_digits_shards

    return write_digits_shards(Path(tmp_path_factory.mktemp("digits")), noise_rate=0.0,
                               maxcount=200)


def test_ember_train_with_swap_flags_under_torchrun_writes_the_averaged_model(digits_shards,
                                                                              tmp_path):
    out = tmp_path / "out"
    proc = _torchrun(["-m", "ember.cli", "train", "--data", digits_shards["train"],
                      "--eval-data", digits_shards["test"], "--num-classes", "10", "--grayscale",
                      "--model", "mlp", "--hidden", "64", "--epochs", "2", "--batch-size", "64",
                      "--swap-phase2-epochs", "1", "--swap-batch-size", "16", "--swap-lr", "0.02",
                      "--swap-bn-batches", "5", "--out", str(out), "--no-progress"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    swap = summary["swap"]
    assert summary["world_size"] == 2 and swap["phase2_batch_size"] == 16
    assert swap["ranks_equal"] and len(swap["rank_digests"]) == 2
    # the ranks refined on different data orders, so their phase-2 losses differ
    assert swap["phase2_losses"][0] != swap["phase2_losses"][1]
    assert 0.5 < swap["eval_accuracy"] <= 1.0  # 10 classes: chance is 0.1
    state = torch.load(out / "model.pt", weights_only=True)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 10))
    model.load_state_dict(state)
    assert "SWAP average of 2 ranks" in proc.stdout


def test_ember_train_swap_in_one_process_is_a_clear_error(digits_shards, tmp_path, capsys):
    from ember.cli import main

    env = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK") if k in os.environ}
    try:
        code = main(["train", "--data", digits_shards["train"], "--num-classes", "10",
                     "--grayscale", "--epochs", "1", "--swap-phase2-epochs", "1",
                     "--out", str(tmp_path), "--no-progress"])
    finally:
        os.environ.update(env)
    assert code == 2
    assert "needs at least 2 processes, got a world size of 1" in capsys.readouterr().err


def test_ember_train_swap_flag_errors(digits_shards, tmp_path, capsys):
    from ember.cli import main

    base = ["train", "--data", digits_shards["train"], "--num-classes", "10", "--out",
            str(tmp_path), "--no-progress"]
    assert main(base + ["--swap-phase2-epochs", "0"]) == 2
    assert "--swap-phase2-epochs must be >= 1" in capsys.readouterr().err
    assert main(base + ["--swap-phase2-epochs", "1", "--swa-start", "0"]) == 2
    assert "cannot be combined with --swa-start" in capsys.readouterr().err
    assert main(base + ["--swap-lr", "0.1"]) == 2
    assert "need --swap-phase2-epochs" in capsys.readouterr().err


def test_bench_experiment_quick_one_seed_has_every_row_with_finite_metrics(monkeypatch):
    pytest.importorskip("sklearn")
    import importlib

    # importable by name, so that the spawned SWAP processes import it too
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "bench"))
    # another test may have loaded a stand-in under this name; import the real file
    monkeypatch.delitem(sys.modules, "swa_family_swap", raising=False)
    bench = importlib.import_module("swa_family_swap")
    assert "SWAP" in bench.PROTOCOL
    rows = bench.experiment(quick=True, seeds=[0])
    assert {(r["method"], r["test_set"]) for r in rows} == {
        (m, t) for m in bench.METHODS for t in ("clean", "pixel noise", "rotation")}
    for r in rows:
        assert r["experiment"] == "swap" and r["n_seeds"] == 1
        for metric in ("accuracy", "nll", "ece"):
            assert torch.isfinite(torch.tensor([r[f"{metric}_mean"], r[f"{metric}_std"]])).all()
        assert 0.0 <= r["accuracy_mean"] <= 1.0
    timed = {r["method"] for r in rows if "wall_s_mean" in r}
    assert timed == {"small-batch SGD (cosine)", "SWAP (2 processes)"}
    assert all(r["wall_s_mean"] > 0 for r in rows if "wall_s_mean" in r)
