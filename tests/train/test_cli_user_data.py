"""``ember train`` on a user's own data through the ``ember`` entry point: images of
different sizes and modes train; bad data, bad options and an existing run end with one line
``ember train: error: ...`` and exit status 2, and nothing is overwritten. Shards are written by
the ``webdataset`` package and by GNU tar. The README's flow and one case of each kind run the
command in a fresh process (``process=True``); the other cases call ``ember.cli.main`` in this
process, the same code without the cost of importing torch again."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

Image = pytest.importorskip("PIL.Image")
wds = pytest.importorskip("webdataset")

# (class, key, width, height, PIL mode, format): sizes and modes as in a real photo folder
IMAGES = [
    ("cat", "c0", 12, 9, "RGB", "JPEG"), ("cat", "c1", 7, 15, "L", "PNG"),
    ("cat", "c2", 10, 10, "RGBA", "PNG"), ("dog", "d0", 16, 8, "P", "PNG"),
    ("dog", "d1", 9, 13, "RGB", "PNG"), ("dog", "d2", 11, 11, "RGB", "JPEG"),
]


def image_bytes(width: int, height: int, mode: str, fmt: str, seed: int = 0) -> bytes:
    """A small image with some structure (a gradient), encoded as ``fmt``."""
    img = Image.linear_gradient("L").resize((width, height)).point(lambda v: (v + 40 * seed) % 256)
    if mode == "P":
        img = img.convert("RGB").convert("P")
    elif mode != "L":
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()



def entry_point() -> list[str]:
    """The installed ``ember`` command (the console script beside this interpreter, as pip
    installs it), or ``python -m ember.cli`` where ember runs from a source tree uninstalled."""
    script = shutil.which("ember", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "ember.cli"]


def ember(*args: str, process: bool = False, timeout: int = 300) -> subprocess.CompletedProcess:
    """The ``ember`` command: ``ember.cli.main`` in this process (stdout and stderr captured,
    argparse's exits turned into statuses), or with ``process`` the real entry point in a fresh
    process with this process's PYTHONPATH (slower: it imports torch again)."""
    if process:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        env.pop("WORLD_SIZE", None)
        env.pop("RANK", None)
        return subprocess.run([*entry_point(), *args], capture_output=True,
                              text=True, timeout=timeout, env=env)
    from ember.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The single stderr line of a refused command (exit status 2)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ember train: error: "), lines[0]
    return lines[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): digest(p) for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _samples(bad: str | None) -> list[dict]:
    samples = []
    for i, (cls, key, w, h, mode, fmt) in enumerate(IMAGES):
        ext = "jpg" if fmt == "JPEG" else "png"
        samples.append({"__key__": key, ext: image_bytes(w, h, mode, fmt, i),
                        "cls": str(int(cls == "dog")).encode()})
    if bad == "text-image":
        samples[2] = {"__key__": "c2", "png": b"just some text, not a PNG\n", "cls": b"0"}
    elif bad == "no-cls":
        del samples[2]["cls"]
    return samples


def write_with_webdataset(folder: Path, bad: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train-000000.tar"
    with wds.TarWriter(str(path)) as w:
        for s in _samples(bad):
            w.write(s)
    return path


def _gnu_tar() -> str | None:
    tar = shutil.which("tar")
    if tar is None:
        return None
    out = subprocess.run([tar, "--version"], capture_output=True, text=True).stdout
    return tar if "GNU tar" in out else None


def write_with_tar(folder: Path, bad: str | None = None) -> Path:
    """``tar cf shard.tar --sort=name -C files .``: the layout GNU tar writes (``./`` names)."""
    tar = _gnu_tar()
    if tar is None:
        pytest.skip("needs GNU tar")
    files = folder / "files"
    files.mkdir(parents=True, exist_ok=True)
    for s in _samples(bad):
        for ext, data in s.items():
            if ext != "__key__":
                (files / f"{s['__key__']}.{ext}").write_bytes(data)
    path = folder / "train-000000.tar"
    subprocess.run([tar, "cf", str(path), "--sort=name", "-C", str(files), "."], check=True)
    return path


WRITERS = {"webdataset": write_with_webdataset, "tar": write_with_tar}


@pytest.fixture
def photo_folder(tmp_path) -> Path:
    """An ImageFolder of images of different sizes and modes (JPEG and PNG)."""
    root = tmp_path / "photos"
    for i, (cls, key, w, h, mode, fmt) in enumerate(IMAGES):
        (root / cls).mkdir(parents=True, exist_ok=True)
        (root / cls / f"{key}.{'jpg' if fmt == 'JPEG' else 'png'}").write_bytes(
            image_bytes(w, h, mode, fmt, i))
    return root


def test_a_folder_of_mixed_sizes_trains_after_shards_create(photo_folder, tmp_path):
    done = ember("shards", "create", str(photo_folder), "-o", str(tmp_path / "sh" / "t-%03d.tar"),
                 "-q", process=True)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "run"
    done = ember("train", "--data", str(tmp_path / "sh" / "t-000.tar"), "--epochs", "1",
                 "--batch-size", "4", "--image-size", "8", "--out", str(out), "--no-progress",
                 "--eval-data", str(tmp_path / "sh" / "t-000.tar"), process=True)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    # per-class accuracy under the class names; 3 images of each class, so their mean is the
    # overall accuracy of the same evaluation
    per_class = summary["eval_accuracy_per_class"]
    assert sorted(per_class) == ["cat", "dog"]
    assert all(3 * v == round(3 * v) for v in per_class.values())
    assert sum(per_class.values()) / 2 == pytest.approx(summary["history"][-1]["eval_accuracy"])
    # --num-classes and the class names came from the classes.json that create wrote
    assert summary["classes"] == ["cat", "dog"] and summary["image_size"] == [8, 8]
    assert "0=cat, 1=dog" in done.stdout
    import torch

    weights = torch.load(out / "model.pt", weights_only=True)
    assert weights["1.weight"].shape[1] == 3 * 8 * 8  # every image resized to 3 x 8 x 8
    assert weights["5.weight"].shape[0] == 2


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_mixed_sizes_train_with_the_first_images_size_by_default(writer, tmp_path):
    shard = WRITERS[writer](tmp_path / "data")
    out = tmp_path / "run"
    done = ember("train", "--data", str(shard), "--num-classes", "2", "--epochs", "1",
                 "--batch-size", "3", "--shuffle-buffer", "0", "--out", str(out), "--no-progress",
                 "--eval-data", str(shard))
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["image_size"] == [9, 12]  # the first sample: 12 wide, 9 high
    assert summary["history"][0]["batches"] == 2 and summary["skipped_bad"] == 0


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("bad, words", [
    ("text-image", ["c2'", "not an image"]),  # key c2 (./c2 from tar)
    ("no-cls", ["c2'", ".cls"]),
    ("truncated", ["train-000000.tar", "byte"]),
    ("corrupt", ["train-000000.tar", "byte 0", "checksum"]),
])
def test_bad_data_is_one_line_naming_shard_and_sample(writer, bad, words, tmp_path):
    shard = WRITERS[writer](tmp_path / "data", bad if bad in ("text-image", "no-cls") else None)
    if bad == "truncated":
        shard.write_bytes(shard.read_bytes()[:2000])
    elif bad == "corrupt":
        data = bytearray(shard.read_bytes())
        data[:512] = b"\x07" * 512  # the first header is garbage
        shard.write_bytes(bytes(data))
    before = digest(shard)
    out = tmp_path / "run"
    proc = ember("train", "--data", str(shard), "--num-classes", "2", "--epochs", "1",
                 "--batch-size", "2", "--out", str(out), "--no-progress",
                 process=bad == "text-image")
    line = one_error_line(proc)
    assert str(shard) in line
    for word in words:
        assert word in line
    assert "Traceback" not in proc.stderr
    assert digest(shard) == before
    assert not (out / "model.pt").exists() and not (out / "summary.json").exists()


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_skip_bad_skips_and_counts(writer, tmp_path):
    shard = WRITERS[writer](tmp_path / "data", "text-image")
    out = tmp_path / "run"
    done = ember("train", "--data", str(shard), "--num-classes", "2", "--epochs", "1",
                 "--batch-size", "2", "--out", str(out), "--no-progress", "--skip-bad")
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_bad"] == 1
    assert summary["history"][0]["batches"] == 3  # 5 good samples, batches of 2 (last partial)
    assert "skipped 1 bad" in done.stdout


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no request log on stderr
        pass


def test_http_404_is_one_line(tmp_path):
    handler = functools.partial(_Quiet, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/missing-000000.tar"
        line = one_error_line(ember("train", "--data", url, "--num-classes", "2",
                                    "--out", str(tmp_path / "run"), "--no-progress",
                                    process=True))
    finally:
        server.shutdown()
        server.server_close()
    assert url in line and "404" in line


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_skip_bad_skips_a_shard_whose_header_is_garbage(writer, tmp_path):
    good = WRITERS[writer](tmp_path / "data")
    corrupt = tmp_path / "data" / "train-000001.tar"
    data = bytearray(good.read_bytes())
    data[:512] = b"\x07" * 512  # the first header is garbage
    corrupt.write_bytes(bytes(data))
    out = tmp_path / "run"
    done = ember("train", "--data", str(tmp_path / "data" / "train-{000000..000001}.tar"),
                 "--num-classes", "2", "--epochs", "1", "--batch-size", "2", "--out", str(out),
                 "--no-progress", "--skip-bad")
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_bad"] == 1  # the shard, counted once
    assert summary["history"][0]["batches"] == 3  # the good shard's 6 samples in batches of 2


def test_skip_bad_skips_a_shard_missing_over_http(tmp_path):
    write_with_webdataset(tmp_path / "served")  # train-000000.tar; train-000001.tar is missing
    handler = functools.partial(_Quiet, directory=str(tmp_path / "served"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    out = tmp_path / "run"
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/train-{{000000..000001}}.tar"
        done = ember("train", "--data", url, "--num-classes", "2", "--epochs", "1",
                     "--batch-size", "2", "--out", str(out), "--no-progress", "--skip-bad")
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_bad"] == 1 and summary["history"][0]["batches"] == 3


def test_an_existing_run_is_not_overwritten(tmp_path):
    shard = write_with_webdataset(tmp_path / "data")
    out = tmp_path / "run"
    base = ["train", "--data", str(shard), "--num-classes", "2", "--epochs", "1",
            "--batch-size", "3", "--out", str(out), "--no-progress"]
    assert ember(*base).returncode == 0
    before = snapshot(out)
    assert {"model.pt", "summary.json", "metrics.jsonl", "checkpoints/last.pt"} <= set(before)
    line = one_error_line(ember(*base, "--seed", "7", process=True))
    assert "already holds a run" in line and "--force" in line and "--resume" in line
    assert snapshot(out) == before
    # --force replaces it: one run's records in metrics.jsonl, not two appended
    assert ember(*base, "--seed", "7", "--force").returncode == 0
    events = [json.loads(r)["event"] for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert events.count("start") == 1
    assert snapshot(out)["model.pt"] != before["model.pt"]


@pytest.fixture(scope="module")
def good_shard(tmp_path_factory) -> Path:
    return write_with_webdataset(tmp_path_factory.mktemp("good"))


@pytest.mark.parametrize("extra, words, absent", [
    (["--seed", "1" * 30], ["--seed", "2**63"], []),
    (["--lr", "nan"], ["--lr", "finite"], []),
    (["--lr", "inf"], ["--lr", "finite"], []),
    (["--momentum", "-0.5"], ["--momentum"], []),
    (["--swa-start", "5"], ["--swa-start", "--epochs"], ["swa_start"]),
    (["--image-size", "0"], ["--image-size"], []),
    (["--image-size", "big"], ["--image-size"], []),
    (["--num-classes", "1"], ["--num-classes"], []),
])
def test_bad_options_are_one_line_in_flag_terms(good_shard, tmp_path, extra, words, absent):
    args = ["train", "--data", str(good_shard), "--num-classes", "2", "--epochs", "1",
            "--out", str(tmp_path / "run"), "--no-progress"]
    # the later --num-classes wins, as argparse does
    line = one_error_line(ember(*args, *extra))
    for word in words:
        assert word in line
    for word in absent:
        assert word not in line
    assert not (tmp_path / "run" / "model.pt").exists()


def test_resume_of_a_file_that_is_not_a_checkpoint(good_shard, tmp_path):
    bogus = tmp_path / "notes.pt"
    bogus.write_text("not a checkpoint")
    line = one_error_line(ember("train", "--data", str(good_shard), "--num-classes", "2",
                                "--out", str(tmp_path / "run"), "--resume", str(bogus),
                                "--no-progress"))
    assert str(bogus) in line and "not an ember checkpoint" in line


def test_unwritable_out(good_shard, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    line = one_error_line(ember("train", "--data", str(good_shard), "--num-classes", "2",
                                "--out", str(blocker / "run"), "--no-progress"))
    assert "--out" in line and "cannot write" in line
    assert blocker.read_text() == "x"


def test_too_low_dp_epsilon(good_shard, tmp_path):
    pytest.importorskip("opacus")
    line = one_error_line(ember("train", "--data", str(good_shard), "--num-classes", "2",
                                "--epochs", "1", "--out", str(tmp_path / "run"), "--no-progress",
                                "--dp-epsilon", "0.0001", "--dp-delta", "1e-5",
                                "--max-grad-norm", "1"))
    assert "--dp-epsilon" in line and "epsilon=" not in line.replace("--dp-epsilon=", "")


def test_data_pointing_at_an_image_folder_points_to_shards_create(photo_folder, tmp_path):
    line = one_error_line(ember("train", "--data", str(photo_folder), "--num-classes", "2",
                                "--out", str(tmp_path / "run")))
    assert "ember shards create" in line and str(photo_folder) in line


def test_pipe_urls_are_refused_in_the_commands_terms(tmp_path):
    line = one_error_line(ember("train", "--data", "pipe:cat x.tar", "--num-classes", "2",
                                "--out", str(tmp_path / "run")))
    assert "pipe:" in line and "allow_pipe" not in line


def test_progress_bar_has_a_total(good_shard, tmp_path):
    done = ember("train", "--data", str(good_shard), "--num-classes", "2", "--epochs", "1",
                 "--batch-size", "2", "--out", str(tmp_path / "run"), process=True)
    assert done.returncode == 0, done.stderr
    assert "3/3" in done.stderr  # 6 samples in batches of 2: a total, so a percentage and ETA
    assert re.search(r"100%.*3/3 \[\d\d:\d\d<\d\d:\d\d", done.stderr), done.stderr  # [spent<left


def test_help_and_version_do_not_import_torch():
    code = ("import sys, contextlib, io\n"
            "from ember.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    for argv in (['--help'], ['--version'], ['train', '--help']):\n"
            "        try:\n"
            "            main(argv)\n"
            "        except SystemExit as e:\n"
            "            assert e.code == 0, (argv, e.code)\n"
            "print('torch' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    from ember import __version__

    version = ember("--version", process=True)
    assert version.returncode == 0
    assert version.stdout.startswith(f"ember {__version__} (torch ")


def test_fit_refuses_an_empty_loader_and_a_foreign_optimizer():
    import torch
    from torch import nn

    from ember.train import ConfigError, TrainConfig, fit

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="no batches in epoch 0"):
        fit(model, opt, [], TrainConfig(epochs=1, progress=False))
    other = nn.Linear(4, 2)
    batches = [(torch.randn(3, 4), torch.tensor([0, 1, 0]))]
    with pytest.raises(ConfigError, match="none of the model's parameters"):
        fit(model, torch.optim.SGD(other.parameters(), lr=0.1), batches,
            TrainConfig(epochs=1, progress=False))



def test_demo_help_shows_a_plain_percent_and_unwritable_out_is_one_line(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    helptext = " ".join(ember("demo", "--help").stdout.split())
    assert "(40% of the training labels wrong)" in helptext and "%%" not in helptext
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    proc = ember("demo", "--out", str(blocker / "out"), "--quick", "--no-progress")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("ember demo: error: --out") and "cannot write" in proc.stderr
    assert blocker.read_text() == "x"


def test_bad_data_read_by_worker_processes_is_one_line_too(tmp_path):
    """A DataLoader worker's exception comes back with its traceback in the message; the
    command still prints only the error itself."""
    good = write_with_webdataset(tmp_path / "a")
    bad = write_with_webdataset(tmp_path / "b", "text-image")
    data = tmp_path / "data"
    data.mkdir()
    good.rename(data / "train-000000.tar")
    bad.rename(data / "train-000001.tar")
    line = one_error_line(ember("train", "--data", str(data / "train-{000000..000001}.tar"),
                                "--num-classes", "2", "--epochs", "1", "--workers", "2",
                                "--out", str(tmp_path / "run"), "--no-progress"))
    assert "train-000001.tar" in line and "'c2'" in line and "not an image" in line
    assert "Traceback" not in line


@pytest.mark.parametrize("message, expected", [
    ("swa_start must be an epoch in [0, epochs=10), got 12",
     "--swa-start must be an epoch in [0, --epochs=10), got 12"),
    ("TrainConfig.swa_lr is set but swa_start is None", "--swa-lr is set but --swa-start is None"),
    ("epochs must be an integer >= 1, got 0", "--epochs must be an integer >= 1, got 0"),
    ("resume: no checkpoint at x", "--resume: no checkpoint at x"),
    ("the number of epochs is 3", "the number of epochs is 3"),  # prose stays prose
    ("noise_seed is for tests", "noise_seed is for tests"),  # not an option of the command
])
def test_config_errors_are_put_in_flag_terms(message, expected):
    from ember.train.cli import _in_flag_terms

    assert _in_flag_terms(message) == expected
