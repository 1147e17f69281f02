"""``ember train``: --skip-bad with a progress bar, evaluation
shards of other classes, SIGTERM during --force, 16-bit images, absurd float options, split
samples, skip counts at the end of the data, resume hints, option messages in flag terms."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from test_cli_failures_and_limits import _args, _png, _shard
from test_cli_user_data import Image, ember, one_error_line, snapshot

import processes


def _good(folder: Path, n: int = 4, name: str = "good.tar") -> Path:
    return _shard(folder / name, [(f"g{i:03d}", _png(8, 8, i % 5), str(i % 2).encode())
                                  for i in range(n)])


def _truncated(folder: Path) -> Path:
    whole = _shard(folder / "whole.tar", [(f"t{i:03d}", _png(8, 8, i), b"1") for i in range(6)])
    data = whole.read_bytes()
    whole.unlink()
    bad = folder / "trunc.tar"
    bad.write_bytes(data[: len(data) // 2 + 100])
    return bad


def test_skip_bad_skips_a_truncated_shard_with_the_progress_bar_on(tmp_path):
    _good(tmp_path)
    _truncated(tmp_path)
    done = ember("train", "--data", str(tmp_path / "{good,trunc}.tar"), "--num-classes", "2",
                 "--epochs", "1", "--batch-size", "2", "--out", str(tmp_path / "run"),
                 "--skip-bad")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["skipped_bad"] >= 1


def test_a_bad_shard_at_the_end_after_a_full_batch_is_counted(tmp_path):
    _good(tmp_path, 4)
    (tmp_path / "zero.tar").write_bytes(b"")
    done = ember("train", "--data", str(tmp_path / "{good,zero}.tar"), "--num-classes", "2",
                 "--epochs", "1", "--batch-size", "4", "--shuffle-buffer", "0",
                 "--out", str(tmp_path / "run"), "--skip-bad", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["skipped_bad"] == 1
    assert "skipped 1 bad" in done.stdout


def test_eval_data_of_other_classes_is_refused(tmp_path):
    train, test = tmp_path / "train", tmp_path / "test"
    _good(train)
    _good(test)
    (train / "classes.json").write_text(json.dumps({"classes": ["bird", "cat"]}))
    (test / "classes.json").write_text(json.dumps({"classes": ["cat", "dog"]}))
    line = one_error_line(ember("train", "--data", str(train / "good.tar"), "--epochs", "1",
                                "--eval-data", str(test / "good.tar"),
                                "--out", str(tmp_path / "run"), "--no-progress"))
    assert "--eval-data" in line and "classes.json" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM to a child process is POSIX")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_force_run_ended_by_a_signal_puts_the_old_run_back(sig, tmp_path):
    shard = _shard(tmp_path / "d" / "s.tar", [(f"k{i:04d}", _png(8, 8, i % 7), str(i % 2).encode())
                                              for i in range(400)])
    out = tmp_path / "run"
    assert ember(*_args(shard, out)).returncode == 0
    before = snapshot(out)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = processes.popen([sys.executable, "-m", "ember.cli", *_args(
        shard, out, "--epochs", "1000", "--batch-size", "4", "--force", "--checkpoint-every",
        "5")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def training() -> bool:  # the old run moved aside and the new one writing its log
        aside = [p for p in out.iterdir() if p.name.startswith(".ember-replaced")]
        return bool(aside) and (out / "metrics.jsonl").exists()

    processes.wait_for(training, proc, "the new run to start training")
    time.sleep(1.0)
    proc.send_signal(getattr(signal, sig))
    _, err = processes.communicate(proc, f"ember train to end after {sig}")
    lines = err.strip().splitlines()
    assert proc.returncode == (143 if sig == "SIGTERM" else 130), err
    assert len(lines) == 1 and lines[0].startswith("ember train: interrupted"), err
    assert "earlier run" in lines[0] and "--resume" not in lines[0], err
    assert snapshot(out) == before
    assert not [p for p in out.iterdir() if p.name.startswith(".ember-replaced")]


def _image_shard(path: Path, images: list[tuple[str, Image.Image, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, img, fmt in images:
            buf = io.BytesIO()
            img.save(buf, format=fmt)
            for name, data in [(f"{key}.{fmt.lower()}", buf.getvalue()), (f"{key}.cls", b"0")]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_sixteen_bit_grayscale_reads_as_its_eight_bit_copy(tmp_path):
    from ember.train.data import image_class_loader

    ramp = np.tile(np.arange(32, dtype=np.uint16) * 8, (32, 1))  # 0 .. 248
    eight = Image.fromarray(ramp.astype(np.uint8))
    sixteen = Image.fromarray(ramp * 257)  # the same picture in 16 bits
    assert sixteen.mode.startswith("I")
    shard = _image_shard(tmp_path / "s.tar", [("a", eight, "PNG"), ("b", sixteen, "PNG")])
    for grayscale in (False, True):
        batches = list(image_class_loader(str(shard), 2, shuffle=0, grayscale=grayscale))
        (x, _), = batches
        assert torch_equal(x[0], x[1]), (x[0].mean(), x[1].mean())


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_float_images_are_a_data_error_not_white(tmp_path):
    f = Image.fromarray(np.full((8, 8), 0.5, dtype=np.float32))
    shard = _image_shard(tmp_path / "f.tar", [("a", f, "TIFF")])
    line = one_error_line(ember("train", "--data", str(shard), "--num-classes", "2", "--epochs",
                                "1", "--out", str(tmp_path / "run"), "--no-progress"))
    assert "'a'" in line and "32-bit" in line


@pytest.mark.parametrize("flag", ["--lr", "--swa-lr", "--momentum", "--weight-decay"])
def test_float_options_too_large_for_float32_are_one_line(flag, tmp_path):
    _good(tmp_path)
    extra = ["--swa-start", "0"] if flag == "--swa-lr" else []
    line = one_error_line(ember(*_args(tmp_path / "good.tar", tmp_path / "run", flag, "1e300",
                                       *extra)))
    assert flag in line and "1e+300" in line


@pytest.mark.skipif(tarfile.GNU_FORMAT is None, reason="tarfile")
def test_a_sample_whose_files_are_apart_names_the_cause(tmp_path):
    shard = tmp_path / "p.tar"
    with tarfile.open(shard, "w") as tar:  # directory order: every image, then every label
        for name, data in [("./k0.png", _png(8, 8)), ("./k1.png", _png(8, 8, 1)),
                           ("./k0.cls", b"0"), ("./k1.cls", b"1")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    line = one_error_line(ember("train", "--data", str(shard), "--num-classes", "2", "--epochs",
                                "1", "--out", str(tmp_path / "run"), "--no-progress"))
    assert "not adjacent" in line and "--sort=name" in line


def test_interrupt_hint_names_no_checkpoint_of_a_discarded_run(tmp_path):
    from ember.train import cli

    last = tmp_path / "checkpoints" / "last.pt"
    last.parent.mkdir()
    last.write_bytes(b"x")
    assert "--resume" not in cli._interrupted_message(tmp_path, restored=True, checkpoint=last)
    assert "--resume auto" in cli._interrupted_message(tmp_path, restored=False, checkpoint=last)
    assert "--resume" not in cli._interrupted_message(tmp_path, restored=False,
                                                      checkpoint=tmp_path / "none.pt")


@pytest.mark.parametrize("extra, words", [
    (["--dp-epsilon", "1", "--dp-delta", "2", "--max-grad-norm", "1"], ["--dp-delta"]),
    (["--dp-epsilon", "-1", "--dp-delta", "1e-5", "--max-grad-norm", "1"], ["--dp-epsilon"]),
    (["--dp-epsilon", "1", "--dp-delta", "1e-5", "--max-grad-norm", "0"], ["--max-grad-norm"]),
    (["--swa-lr", "0.1"], ["--swa-lr", "--swa-start"]),
    (["--swag-rank", "3"], ["--swag-rank", "--swa-start"]),
])
def test_option_messages_name_flags_only(extra, words, tmp_path):
    _good(tmp_path)
    line = one_error_line(ember(*_args(tmp_path / "good.tar", tmp_path / "run", *extra)))
    for w in words:
        assert w in line
    for python in ("privacy", "None", "_"):
        assert python not in line.split("error: ", 1)[1].replace(str(tmp_path), ""), line


def test_resume_of_a_file_that_is_not_a_checkpoint_says_so(tmp_path):
    _good(tmp_path)
    junk = tmp_path / "passwd"
    junk.write_text("root:x:0:0:root:/root:/bin/bash\n")
    line = one_error_line(ember(*_args(tmp_path / "good.tar", tmp_path / "run", "--resume",
                                       str(junk))))
    assert "not an ember checkpoint" in line and "torch.load" not in line


def test_resume_of_the_run_folder_finds_its_checkpoint(tmp_path):
    _good(tmp_path, 8)
    out = tmp_path / "run"
    assert ember(*_args(tmp_path / "good.tar", out)).returncode == 0
    done = ember(*_args(tmp_path / "good.tar", out, "--resume", str(out), "--epochs", "2"))
    assert done.returncode == 0, done.stderr
    assert len(json.loads((out / "summary.json").read_text())["history"]) == 2
