"""``ember shards`` writing commands are all or nothing: a failed or interrupted run (``--force``
too) leaves the files that were there byte for byte; Ctrl-C is one line and status 130; refusals
are the only line on stderr; ``create`` leaves hidden files out and refuses an empty class
folder; ``-o`` under a file is one line."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import processes
from ember.cli import main
from ember.shards import iter_shard

Image = pytest.importorskip("PIL.Image")
wds = pytest.importorskip("webdataset")


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((4, 4, 3), value % 256, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def ember(*args: str) -> tuple[int, str, str]:
    """``ember shards ARGS`` in this process: (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["shards", *args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def one_error_line(err: str, action: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ember shards {action}: error: "), lines[0]
    return lines[0]


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry of ``folder`` (hidden temporary folders too) and its bytes' hash."""
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(folder.iterdir())}


@pytest.fixture
def big(tmp_path) -> Path:
    """30 small PNGs in 3 classes."""
    root = tmp_path / "big"
    for i in range(30):
        cls = root / "abc"[i % 3]
        cls.mkdir(parents=True, exist_ok=True)
        (cls / f"{i:03d}.png").write_bytes(_png(i))
    return root


@pytest.fixture
def old_output(big, tmp_path) -> tuple[Path, dict[str, str]]:
    """15 shards from ``big`` with their .idx files and classes.json, and their snapshot."""
    out = tmp_path / "cs"
    assert ember("create", str(big), "-o", str(out / "t-%03d.tar"), "--maxcount", "2", "-q")[0] == 0
    assert ember("index", str(out / "t-{000..014}.tar"), "-q")[0] == 0
    before = snapshot(out)
    assert len(before) == 31  # 15 shards, 15 .idx, classes.json
    return out, before


def test_failed_create_force_keeps_every_old_file(big, old_output, tmp_path):
    out, before = old_output
    bad = tmp_path / "big_bad"
    (bad / "a").mkdir(parents=True)
    (bad / "b").mkdir()
    for i in range(30):
        (bad / "ab"[i % 2] / f"{i:03d}.png").write_bytes(_png(i + 1))
    (bad / "b" / "zzz.png").write_text("garbage\n")  # sorted last: found after 15 new shards
    code, _, err = ember("create", str(bad), "-o", str(out / "t-%03d.tar"), "--maxcount", "2",
                         "--force", "-q")
    assert code == 2
    assert "zzz.png" in one_error_line(err, "create")
    assert snapshot(out) == before  # shards, .idx files and classes.json (other classes) intact


@pytest.mark.parametrize("action", ["split", "merge", "shuffle", "create"])
def test_failing_post_after_the_new_shards_are_in_place_restores_the_old(big, old_output,
                                                                          action, tmp_path):
    # --post runs on the shards in their final place: its failure must put the old set back
    out, before = old_output
    inputs = [str(big)] if action == "create" else [_copies(out, tmp_path / "src")]
    fail_on_third = shlex.join([sys.executable, "-c", "import sys; sys.exit(sys.argv[1]"
                                ".endswith('t-002.tar') and 4)", "{}"])
    code, _, err = ember(action, *inputs, "-o", str(out / "t-%03d.tar"), "--maxcount", "3",
                         "--force", "-q", "--post", fail_on_third)
    assert code == 2
    assert "exit status 4" in one_error_line(err, action)
    assert snapshot(out) == before


def test_a_failure_halfway_through_moving_into_place_restores_the_old(big, old_output,
                                                                      monkeypatch):
    out, before = old_output
    real, failed = os.replace, []

    def flaky(src, dst):
        if Path(dst) == out / "t-009.tar" and not failed:  # the old files are aside by now
            failed.append(src)
            raise OSError("disk trouble")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", flaky)
    code, _, err = ember("create", str(big), "-o", str(out / "t-%03d.tar"), "--maxcount", "1",
                         "--force", "-q")
    assert code == 2 and "disk trouble" in one_error_line(err, "create")
    assert failed and ".ember-writing-" in failed[0]
    monkeypatch.undo()
    assert snapshot(out) == before


def test_successful_force_replaces_the_whole_set(big, old_output):
    out, _ = old_output
    code, stdout, err = ember("create", str(big), "-o", str(out / "t-%03d.tar"), "--maxcount",
                              "7", "--force", "-q")
    assert code == 0, err
    assert "replaced 30 files" in stdout
    # five new shards; the old ten past them and every old .idx are gone; no temporary folder
    assert sorted(snapshot(out)) == ["classes.json"] + [f"t-{i:03d}.tar" for i in range(5)]
    assert sum(1 for s in iter_shard(str(out / "t-004.tar"))) == 2


def _copies(out: Path, folder: Path) -> str:
    """The shards of ``out`` copied into ``folder``: inputs that -o may replace."""
    folder.mkdir()
    for shard in sorted(out.glob("t-*.tar")):
        (folder / shard.name).write_bytes(shard.read_bytes())
    return str(folder / "t-{000..014}.tar")


@pytest.mark.parametrize("action", ["create", "split", "merge", "shuffle"])
def test_keyboard_interrupt_is_one_line_and_status_130(big, old_output, action, tmp_path,
                                                       monkeypatch):
    out, before = old_output
    import ember.shards.cli as cli

    def interrupted(shards, keys):
        assert shards  # new shards were written (under temporary names) when Ctrl-C came
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_check_written", interrupted)
    inputs = str(big) if action == "create" else _copies(out, tmp_path / "src")
    code, _, err = ember(action, inputs, "-o", str(out / "t-%03d.tar"), "--maxcount", "3",
                         "--force", "-q")
    assert code == 130
    assert err.splitlines() == [f"ember shards {action}: interrupted; nothing was written, the "
                                "earlier shards are unchanged"]
    assert snapshot(out) == before
    code, _, err = ember(action, inputs, "-o", str(tmp_path / "new" / "n-%03d.tar"), "-q")
    assert code == 130
    assert err.splitlines() == [f"ember shards {action}: interrupted; nothing was written"]
    assert not (tmp_path / "new").exists()  # not even the folder the run made


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to another process is POSIX")
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_during_create_force_leaves_the_old_shards_intact(sig, big, old_output,
                                                                    tmp_path):
    out, before = old_output
    started = tmp_path / "post-started"
    # --post runs once the new shards are in place: Ctrl-C there must still restore the old set
    post = shlex.join([sys.executable, "-c", f"import time; open({str(started)!r}, 'w'); "
                       "time.sleep(60)", "{}"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = processes.popen([sys.executable, "-m", "ember.cli", "shards", "create", str(big),
                            "-o", str(out / "t-%03d.tar"), "--maxcount", "4", "--force", "-q",
                            "--post", post], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    processes.wait_for(started.exists, proc, "the --post command to start")
    signum = getattr(signal, sig)
    proc.send_signal(signum)
    _, err = processes.communicate(proc, f"ember shards create to end after {sig}")
    assert proc.returncode == 128 + signum, err.decode()
    assert err.decode().splitlines() == ["ember shards create: interrupted; nothing was written, "
                                         "the earlier shards are unchanged"]
    assert snapshot(out) == before


def test_refusal_without_force_is_the_only_line(big, old_output):
    out, before = old_output
    (big / "a" / "notes.txt").write_text("not an image")
    (big / "b" / "x.y.png").write_bytes(_png(3))  # a key that differs from the file name
    code, _, err = ember("create", str(big), "-o", str(out / "t-%03d.tar"))  # progress bar on
    assert code == 2
    assert "--force" in one_error_line(err, "create")
    assert snapshot(out) == before


def test_ls_of_a_missing_shard_prints_the_error_alone(tmp_path):
    code, _, err = ember("ls", str(tmp_path / "nonexist.tar"))  # progress bar on
    assert code == 2
    assert "nonexist.tar" in one_error_line(err, "ls")


def test_create_leaves_hidden_files_and_folders_out(big, tmp_path):
    (big / "a" / "._000.png").write_bytes(b"\x00\x05\x16\x07AppleDouble")  # macOS metadata
    (big / "b" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (big / "c" / ".hidden.png").write_bytes(_png(1))
    (big / "c" / ".thumbs").mkdir()
    (big / "c" / ".thumbs" / "t.png").write_bytes(_png(2))
    (big / ".ipynb_checkpoints").mkdir()  # hidden: not a class
    (big / ".ipynb_checkpoints" / "z.png").write_bytes(_png(3))
    out = tmp_path / "o"
    code, _, err = ember("create", str(big), "-o", str(out / "t-%03d.tar"), "-q")
    assert code == 0, err
    assert err.splitlines() == [
        f"ember shards create: left out 5 files or folders: 5 hidden (name starting with '.') "
        f"(first: {big / '.ipynb_checkpoints'})"]
    keys = [s["__key__"] for s in iter_shard(str(out / "t-000.tar"))]
    assert len(keys) == 30 and all("." not in k for k in keys)
    assert (out / "classes.json").read_text() == '{"classes": ["a", "b", "c"]}'


def test_create_refuses_an_empty_class_folder(big, tmp_path):
    # torchvision's ImageFolder raises FileNotFoundError for a class without a valid file
    (big / "d_empty").mkdir()
    (big / "d_empty" / "readme.txt").write_text("no images here")
    out = tmp_path / "o"
    code, _, err = ember("create", str(big), "-o", str(out / "t-%03d.tar"), "-q")
    assert code == 2
    line = one_error_line(err, "create")
    assert str(big / "d_empty") in line and "no image files" in line
    assert not out.exists() or not list(out.iterdir())


def test_one_renamed_key_reads_differs(big, tmp_path):
    (big / "a" / "x.y.png").write_bytes(_png(3))
    code, _, err = ember("create", str(big), "-o", str(tmp_path / "o" / "t-%03d.tar"), "-q")
    assert code == 0
    assert "1 sample key differs from the file name " in err
    (big / "a" / "u.v.png").write_bytes(_png(4))
    code, _, err = ember("create", str(big), "-o", str(tmp_path / "p" / "t-%03d.tar"), "-q")
    assert "2 sample keys differ from the file names " in err


@pytest.mark.parametrize("action", ["create", "split"])
def test_output_under_a_file_is_one_line(big, old_output, tmp_path, action):
    out, _ = old_output
    blocker = tmp_path / "passwd"
    blocker.write_text("root:x:0:0\n")
    src = str(big) if action == "create" else str(out / "t-000.tar")
    for target in (blocker / "t-%03d.tar", blocker / "deeper" / "t-%03d.tar"):
        code, _, err = ember(action, src, "-o", str(target), "-q")
        assert code == 2
        assert one_error_line(err, action) == (f"ember shards {action}: error: -o: {blocker} is a "
                                               "file, not a folder")
    assert blocker.read_text() == "root:x:0:0\n"
