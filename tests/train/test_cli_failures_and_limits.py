"""``ember train`` on users' data: nothing lost with --force,
a sensible default image size, no silent divergence, labels checked per sample, --resume that
does not fit, Ctrl-C, failed runs that block nothing, --skip-bad counts, absurd numbers."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_user_data import (
    Image,
    ember,
    one_error_line,
    snapshot,
    wds,
    write_with_webdataset,
)

import processes


def _png(width: int, height: int, seed: int = 0) -> bytes:
    img = Image.linear_gradient("L").resize((width, height)).point(lambda v: (v + 30 * seed) % 256)
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def _shard(path: Path, samples: list[tuple[str, bytes, bytes]]) -> Path:
    """A webdataset-written shard of (key, png bytes, cls bytes) samples."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as w:
        for key, png, cls in samples:
            w.write({"__key__": key, "png": png, "cls": cls})
    return path


def _args(shard: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(shard), "--num-classes", "2", "--epochs", "1",
            "--batch-size", "3", "--out", str(out), "--no-progress", *extra]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_with_webdataset(tmp_path_factory.mktemp("good"))


def test_force_keeps_the_old_run_when_the_new_one_fails(good, tmp_path):
    out = tmp_path / "run"
    assert ember(*_args(good, out)).returncode == 0
    before = snapshot(out)
    bad = _shard(tmp_path / "bad" / "b.tar", [("a", b"not an image", b"0"), ("b", _png(8, 8), b"1")])
    line = one_error_line(ember(*_args(bad, out, "--force")))
    assert "'a'" in line and "b.tar" in line
    assert snapshot(out) == before  # the earlier run is back, nothing of the failed one is left
    assert not [p for p in out.iterdir() if p.name.startswith(".ember-replaced")]
    # and a good --force run does replace it, leaving no copy behind
    assert ember(*_args(good, out, "--force", "--seed", "3")).returncode == 0
    assert snapshot(out)["model.pt"] != before["model.pt"]
    assert not [p for p in out.iterdir() if p.name.startswith(".ember-replaced")]


def test_large_photos_default_to_64_pixels(tmp_path):
    shard = _shard(tmp_path / "d" / "p.tar",
                   [(f"k{i}", _png(300 + 10 * i, 200, i), str(i % 2).encode()) for i in range(4)])
    out = tmp_path / "run"
    done = ember(*_args(shard, out))
    assert done.returncode == 0, done.stderr
    assert "300x" not in done.stderr
    assert "64x64" in done.stdout and "--image-size" in done.stdout
    assert json.loads((out / "summary.json").read_text())["image_size"] == [64, 64]


def test_a_model_too_large_to_be_meant_is_refused_before_allocation(good, tmp_path):
    out = tmp_path / "run"
    line = one_error_line(ember(*_args(good, out, "--image-size", "4000", "--hidden", "4096")))
    assert "--image-size" in line and "--hidden" in line and "parameters" in line
    line = one_error_line(ember(*_args(good, out, "--model", "cnn", "--image-size", "30000",
                                       "--batch-size", "64")))
    assert "--batch-size" in line and "GiB" in line
    assert not out.exists()  # nothing left behind that would block the next command


def test_diverging_loss_stops_with_one_line(good, tmp_path):
    out = tmp_path / "run"
    line = one_error_line(ember(*_args(good, out, "--lr", "1e30", "--epochs", "3")))
    assert "--lr" in line and ("nan" in line or "inf" in line)
    assert not (out / "model.pt").exists()


@pytest.mark.parametrize("label", [b"99999999999999999999", b"7", b"-1"])
def test_out_of_range_labels_name_shard_and_sample_and_are_skippable(label, tmp_path):
    shard = _shard(tmp_path / "d" / "lab.tar", [("ok0", _png(8, 8), b"0"), ("odd", _png(8, 8), label),
                                                 ("ok1", _png(8, 8, 1), b"1")])
    out = tmp_path / "run"
    line = one_error_line(ember(*_args(shard, out)))
    assert "lab.tar" in line and "'odd'" in line and ".cls" in line
    assert "Traceback" not in line
    done = ember(*_args(shard, out, "--skip-bad"))
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "summary.json").read_text())["skipped_bad"] == 1


def test_resume_of_a_different_model_is_one_line(good, tmp_path):
    first = tmp_path / "a"
    assert ember(*_args(good, first, "--hidden", "16")).returncode == 0
    line = one_error_line(ember(*_args(good, tmp_path / "b", "--hidden", "32", "--epochs", "2",
                                       "--resume", str(first / "checkpoints" / "last.pt"))))
    assert "--resume" in line and "--hidden 32" in line and "differs" in line


def test_resume_of_a_finished_run_says_so(good, tmp_path):
    first = tmp_path / "a"
    assert ember(*_args(good, first)).returncode == 0
    line = one_error_line(ember(*_args(good, tmp_path / "b", "--resume",
                                       str(first / "checkpoints"))))
    assert "already finished 1 of --epochs 1" in line
    # with more epochs it trains on
    done = ember(*_args(good, tmp_path / "b", "--epochs", "2", "--resume",
                        str(first / "checkpoints")))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["history"][-1]["epoch"] == 1


def test_a_run_failing_at_its_first_sample_does_not_block_the_next(tmp_path):
    bad = _shard(tmp_path / "d" / "b.tar", [("x", b"garbage", b"0")] * 1 + [("y", _png(8, 8), b"1")])
    out = tmp_path / "run"
    args = _args(bad, out, "--shuffle-buffer", "0")
    one_error_line(ember(*args))
    assert not out.exists() or not any(out.rglob("*"))
    line = one_error_line(ember(*args))
    assert "already holds a run" not in line


def test_skip_bad_counts_evaluation_skips(tmp_path):
    train = _shard(tmp_path / "t" / "t.tar", [(f"k{i}", _png(8, 8, i), str(i % 2).encode())
                                              for i in range(4)])
    test = _shard(tmp_path / "e" / "e.tar", [("e0", _png(8, 8), b"0"), ("e1", b"junk", b"1"),
                                             ("e2", _png(8, 8, 2), b"1")])
    out = tmp_path / "run"
    done = ember(*_args(train, out, "--skip-bad", "--eval-data", str(test)))
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_bad"] == 0 and summary["skipped_bad_eval"] == 1
    assert "1 in each pass over --eval-data" in done.stdout


@pytest.mark.parametrize("flag", ["--workers", "--accumulate", "--hidden", "--batch-size",
                                  "--epochs", "--shuffle-buffer"])
def test_absurdly_large_numbers_are_one_line(flag, good, tmp_path):
    line = one_error_line(ember(*_args(good, tmp_path / "run"), flag, str(10**30)))
    assert flag in line and "<=" in line and "31 digits" in line


def test_empty_out_is_refused(good, tmp_path):
    line = one_error_line(ember(*_args(good, tmp_path / "x"), "--out", ""))
    assert "--out" in line and "empty" in line


def test_workers_beyond_the_shards_are_said_in_flag_terms(good, tmp_path):
    done = ember(*_args(good, tmp_path / "run", "--workers", "2"))
    assert done.returncode == 0, done.stderr
    assert "--workers 2 but only 1 shard(s)" in done.stdout
    assert "equalize" not in done.stderr and "with_epoch" not in done.stderr


def test_ray_address_with_dp_is_one_line(good, tmp_path):
    line = one_error_line(ember(*_args(good, tmp_path / "run", "--ray-address", "auto",
                                       "--dp-epsilon", "5", "--dp-delta", "1e-5",
                                       "--max-grad-norm", "1")))
    assert "--ray-address" in line and "--dp-epsilon" in line


def test_no_bar_is_drawn_without_its_total(good, tmp_path):
    done = ember("train", "--data", str(good), "--num-classes", "2", "--epochs", "2",
                 "--batch-size", "2", "--out", str(tmp_path / "run"), "--eval-data", str(good))
    assert done.returncode == 0, done.stderr
    # a bar without its total read "0batch [00:00, ?batch/s]"; a rate such as "209.90batch/s" is fine
    assert not re.search(r"(?<![\d.])0batch", done.stderr), done.stderr
    assert "3/3" in done.stderr, done.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
def test_ctrl_c_is_one_line_and_keeps_the_checkpoint(tmp_path):
    shard = _shard(tmp_path / "d" / "s.tar", [(f"k{i:04d}", _png(8, 8, i % 7), str(i % 2).encode())
                                              for i in range(400)])
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = processes.popen([sys.executable, "-m", "ember.cli", *_args(
        shard, out, "--epochs", "1000", "--batch-size", "4")], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env)
    processes.wait_for((out / "checkpoints" / "last.pt").exists, proc, "the first checkpoint")
    proc.send_signal(signal.SIGINT)
    _, err = processes.communicate(proc, "ember train to end after SIGINT")
    lines = err.strip().splitlines()
    assert proc.returncode == 130, err
    assert len(lines) == 1 and lines[0].startswith("ember train: interrupted"), err
    assert "--resume auto" in lines[0]
    assert (out / "checkpoints" / "last.pt").exists()
