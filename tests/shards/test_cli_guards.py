"""``ember shards`` on a user's own files through the ``ember`` entry point:
``create`` decodes every image, no command writes over existing shards without ``--force``,
``-`` works where help says so, sizes and units read as what they are, and every refusal is one
line ``ember shards ACTION: error: ...`` with exit status 2. The tar pipe and one refusal of
each kind run in a fresh process (``process=True``); the rest call ``ember.cli.main`` here."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ember.shards import iter_shard

Image = pytest.importorskip("PIL.Image")
wds = pytest.importorskip("webdataset")



def entry_point() -> list[str]:
    """The installed ``ember`` command (the console script beside this interpreter, as pip
    installs it), or ``python -m ember.cli`` where ember runs from a source tree uninstalled."""
    script = shutil.which("ember", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "ember.cli"]


def ember(*args: str, stdin: bytes | None = None, process: bool = False
          ) -> subprocess.CompletedProcess:
    """``ember shards ...``: ``ember.cli.main`` in this process (standard streams swapped for
    buffers, argparse's exits turned into statuses), or with ``process`` the real entry point in
    a fresh process with this process's PYTHONPATH (slower: it imports torch again)."""
    if process:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        return subprocess.run([*entry_point(), "shards", *args], input=stdin,
                              capture_output=True, timeout=300, env=env)
    from ember.cli import main

    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin or b""))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["shards", *args])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        sys.stdin = old_stdin
    return subprocess.CompletedProcess(list(args), code, out.getvalue().encode(),
                                       err.getvalue().encode())


def one_error_line(proc: subprocess.CompletedProcess, action: str) -> str:
    err = proc.stderr.decode()
    lines = err.strip().splitlines()
    assert proc.returncode == 2, proc.stdout.decode() + err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ember shards {action}: error: "), lines[0]
    return lines[0]


def png(width: int, height: int, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.linear_gradient("L").resize((width, height)).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def jpeg(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.linear_gradient("L").resize((width, height)).convert("RGB").save(buf, format="JPEG")
    return buf.getvalue()


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.is_file()}


@pytest.fixture
def photos(tmp_path) -> Path:
    root = tmp_path / "photos"
    for cls, files in {"cat": [("a.png", png(9, 7)), ("b.jpg", jpeg(12, 5))],
                       "dog": [("c.png", png(6, 11, "L")), ("d.png", png(8, 8, "RGBA"))]}.items():
        (root / cls).mkdir(parents=True)
        for name, data in files:
            (root / cls / name).write_bytes(data)
    return root


def test_create_refuses_a_file_that_is_not_an_image(photos, tmp_path):
    (photos / "dog" / "x.png").write_text("a text file named x.png\n")
    out = tmp_path / "out"
    line = one_error_line(ember("create", str(photos), "-o", str(out / "t-%03d.tar"), "-q",
                                process=True), "create")
    assert str(photos / "dog" / "x.png") in line and "not an image" in line
    assert not out.exists() or not list(out.iterdir())  # no shards, no classes.json


def test_create_refuses_a_truncated_image(photos, tmp_path):
    data = jpeg(40, 30)
    (photos / "cat" / "cut.jpg").write_bytes(data[: len(data) // 2])
    line = one_error_line(ember("create", str(photos), "-o", str(tmp_path / "o" / "t-%03d.tar"),
                                "-q"), "create")
    assert "cut.jpg" in line and "does not decode" in line


def test_create_does_not_write_over_shards_without_force(photos, tmp_path):
    out = tmp_path / "out"
    pattern = str(out / "t-%03d.tar")
    assert ember("create", str(photos), "-o", pattern, "--maxcount", "1", "-q").returncode == 0
    assert ember("index", str(out / "t-{000..003}.tar"), "-q").returncode == 0
    before = snapshot(out)
    assert len([n for n in before if n.endswith(".idx")]) == 4
    line = one_error_line(ember("create", str(photos), "-o", pattern, "--maxcount", "2", "-q",
                                process=True), "create")
    assert "t-000.tar" in line and "--force" in line
    assert snapshot(out) == before
    # the same refusal for split, merge and shuffle
    for action in ("split", "merge", "shuffle"):
        other = tmp_path / f"in-{action}"
        other.mkdir()
        with wds.TarWriter(str(other / "s.tar")) as w:
            w.write({"__key__": "k", "png": png(3, 3), "cls": b"0"})
        one_error_line(ember(action, str(other / "s.tar"), "-o", pattern, "-q"), action)
        assert snapshot(out) == before
    # --force: two new shards; the two old ones past them and every old .idx are gone
    done = ember("create", str(photos), "-o", pattern, "--maxcount", "2", "-q", "--force")
    assert done.returncode == 0, done.stderr.decode()
    assert sorted(snapshot(out)) == ["classes.json", "t-000.tar", "t-001.tar"]


def test_create_refuses_a_classes_json_naming_other_classes(photos, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "classes.json").write_text('{"classes": ["apple", "pear"]}')
    line = one_error_line(ember("create", str(photos), "-o", str(out / "t-%03d.tar"), "-q"),
                          "create")
    assert "classes.json" in line and "--force" in line
    assert (out / "classes.json").read_text() == '{"classes": ["apple", "pear"]}'


def test_tar_piped_into_create_gives_keys_without_dot_slash(photos, tmp_path):
    tar = shutil.which("tar")
    if tar is None or b"GNU tar" not in subprocess.run([tar, "--version"],
                                                       capture_output=True).stdout:
        pytest.skip("needs GNU tar")
    files = tmp_path / "files"
    files.mkdir()
    for key in ("s0", "s1"):
        (files / f"{key}.png").write_bytes(png(4, 5))
        (files / f"{key}.cls").write_text("1")
    stream = subprocess.run([tar, "cf", "-", "--sort=name", "-C", str(files), "."],
                            capture_output=True, check=True).stdout
    done = ember("create", "-", "-o", str(tmp_path / "o-%02d.tar"), "-q", stdin=stream,
                 process=True)
    assert done.returncode == 0, done.stderr.decode()
    assert [s["__key__"] for s in iter_shard(str(tmp_path / "o-00.tar"))] == ["s0", "s1"]
    # and a text file named .png in the stream is refused, naming the sample
    (files / "s1.png").write_text("text")
    stream = subprocess.run([tar, "cf", "-", "--sort=name", "-C", str(files), "."],
                            capture_output=True, check=True).stdout
    line = one_error_line(ember("create", "-", "-o", str(tmp_path / "p-%02d.tar"), "-q",
                                stdin=stream), "create")
    assert "'s1'" in line and "not an image" in line


def test_maxsize_takes_units(photos, tmp_path):
    done = ember("create", str(photos), "-o", str(tmp_path / "a" / "t-%03d.tar"), "-q",
                 "--maxsize", "1GB")
    assert done.returncode == 0, done.stderr.decode()
    assert b"wrote 4 samples to 1 shard" in done.stdout
    # 1kB holds one small sample per shard
    done = ember("create", str(photos), "-o", str(tmp_path / "b" / "t-%03d.tar"), "-q",
                 "--maxsize", "2kB")
    assert done.returncode == 0, done.stderr.decode()
    assert b"wrote 4 samples to 4 shards" in done.stdout
    line = one_error_line(ember("create", str(photos), "-o", str(tmp_path / "c" / "t-%03d.tar"),
                                "--maxsize", "1GQ", "-q"), "create")
    assert "--maxsize" in line
    line = one_error_line(ember("create", str(photos), "-o", str(tmp_path / "c" / "t-%03d.tar"),
                                "--maxcount", "3e9.5", "-q"), "create")
    assert "--maxcount" in line and "maxcount=" not in line


@pytest.mark.parametrize("action", ["create", "split", "merge", "shuffle"])
def test_an_output_without_a_shard_number_is_named_as_given(photos, tmp_path, action):
    # the message named the hidden staging folder ('.../.ember-writing-<hex>/shards')
    source = [str(photos)] if action == "create" else [str(_webdataset_shard(tmp_path / "w.tar"))]
    out = str(tmp_path / "out" / "shards")
    line = one_error_line(ember(action, *source, "-o", out, "-q"), action)
    assert f"-o {out} has no shard number" in line and ".ember-writing" not in line
    assert not (tmp_path / "out").exists()


def _webdataset_shard(path: Path) -> Path:
    with wds.TarWriter(str(path)) as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "png": png(2 + i, 3), "cls": str(i).encode()})
    return path


def test_cat_labels_sizes_as_bytes(tmp_path):
    shard = _webdataset_shard(tmp_path / "w.tar")
    done = ember("cat", str(shard), "-n", "1")
    assert done.returncode == 0
    size = len(png(2, 3))
    assert done.stdout.decode().splitlines() == [f"k0  cls: 1 bytes, png: {size} bytes"]


def test_ls_reads_standard_input(tmp_path):
    shard = _webdataset_shard(tmp_path / "w.tar")
    done = ember("ls", "-", "-q", stdin=shard.read_bytes(), process=True)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().splitlines() == ["3\t-", "3\ttotal"]


@pytest.mark.parametrize("action", ["index", "shuffle"])
def test_index_and_shuffle_neither_offer_nor_take_stdin(tmp_path, action):
    helptext = ember(action, "--help").stdout.decode()
    assert "standard input" not in helptext
    shard = _webdataset_shard(tmp_path / "w.tar")
    args = [action, "-", "-q"] + (["-o", str(tmp_path / "o-%02d.tar")] if action == "shuffle"
                                  else [])
    line = one_error_line(ember(*args, stdin=shard.read_bytes()), action)
    assert "'-'" in line
    assert sorted(os.listdir(tmp_path)) == ["w.tar"]


@pytest.mark.parametrize("action", ["ls", "cat", "stats", "verify", "split", "merge"])
def test_dash_reads_standard_input_where_help_says_so(tmp_path, action):
    helptext = ember(action, "--help").stdout.decode()
    assert "'-' reads a tar stream from standard input" in " ".join(helptext.split())
    shard = _webdataset_shard(tmp_path / "w.tar")
    args = [action, "-", "-q"] + (["-o", str(tmp_path / "o-%02d.tar")]
                                  if action in ("split", "merge") else [])
    done = ember(*args, stdin=shard.read_bytes())
    assert done.returncode == 0, done.stderr.decode()


def test_pipe_error_names_the_flag(tmp_path):
    line = one_error_line(ember("ls", "pipe:cat x.tar", "-q"), "ls")
    assert "--allow-pipe" in line and "allow_pipe=True" not in line
