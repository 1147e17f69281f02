"""DistributedDataParallel with 2 CPU processes (gloo, loopback) launched by torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], timeout: float = 150) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2`` on loopback; ``args`` start with ``-m module`` or a script.

    The free port is found before torchrun binds it, so another process can take it in between:
    that one failure (and only it) is retried with a new port.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    for _ in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if "address already in use" not in (proc.stdout + proc.stderr).lower():
            break
    return proc


def test_two_process_ddp_keeps_ranks_in_sync_with_per_rank_streams(digits_shards, tmp_path):
    out = tmp_path / "out"
    args = ["-m", "ember.cli", "train", "--data", digits_shards["train"], "--num-classes", "10",
            "--grayscale",
            "--epochs", "2", "--batch-size", "32", "--accumulate", "2", "--clip-grad-norm", "1",
            "--swa-start", "1", "--swag-rank", "2",
            "--checkpoint-every", "5", "--out", str(out), "--no-progress"]
    proc = _torchrun(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    # DDP averaged the gradients: identical weights ...
    assert summary["ranks_in_sync"] and len(summary["rank_digests"]) == 2
    # ... although each rank drew from its own ember.csprng substream (fold_in(rank))
    assert summary["rank_streams"][0] != summary["rank_streams"][1]
    # each rank read its own half of the shards: half the batches of one process per epoch
    per_epoch = summary["history"][0]["batches"]
    assert 0 < per_epoch * 32 * 2 <= digits_shards["n_train"]
    assert (out / "checkpoints" / "last.pt").is_file() and (out / "swa.pt").is_file()
    assert "trained" in proc.stdout and "2 process(es)" in proc.stdout


def test_two_process_ddp_killed_and_resumed_is_bit_identical(digits_shards, tmp_path):
    job = str(Path(__file__).with_name("ddp_resume_job.py"))
    urls = digits_shards["train_small"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    for d in (ref, cut):
        d.mkdir()
    proc = _torchrun([job, urls, str(ref), "0", ""])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _torchrun([job, urls, str(cut), "9", ""])  # both ranks stop at step 9, after step 8's save
    assert proc.returncode != 0 and not (cut / "result.json").exists()
    saved = torch.load(cut / "ckpt" / "last.pt", weights_only=True)
    assert saved["progress"]["step"] == 8 and saved["world_size"] == 2  # the resume is real
    proc = _torchrun([job, urls, str(cut), "0", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = json.loads((ref / "result.json").read_text())
    b = json.loads((cut / "result.json").read_text())
    assert a["steps"] > 9
    assert len(set(a["digests"])) == 1
    assert a == b


def test_two_process_dp_sgd_under_torchrun(digits_shards, tmp_path):
    out = tmp_path / "out"
    args = ["-m", "ember.cli", "train", "--data", digits_shards["train"], "--num-classes", "10",
            "--grayscale", "--epochs", "2", "--batch-size", "16", "--swag-rank", "0",
            "--dp-epsilon", "8", "--dp-delta", "1e-5", "--max-grad-norm", "1",
            "--out", str(out), "--no-progress"]
    proc = _torchrun(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks_in_sync"]
    report = summary["privacy"]
    # every rank samples its half of all the examples; 16 per process: 32 a step in expectation
    assert report["world_size"] == 2 and report["dataset_size"] == digits_shards["n_train"]
    assert report["expected_batch_size"] == pytest.approx(32, rel=0.05)
    assert report["steps"] == 2 * round(1 / report["sample_rate"])
    assert 0 < report["epsilon"] <= 8
    assert "epoch 2/2: epsilon" in proc.stdout
