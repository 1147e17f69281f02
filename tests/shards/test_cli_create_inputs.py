"""``ember shards create`` on awkward inputs, through the ``ember`` entry point: a tar stream on
standard input holding a class webdataset reserves and hidden members, links that lead nowhere
or to themselves, and files that are not regular files."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
import tarfile

import pytest
from test_cli_create_folders import _folder
from test_cli_guards import ember, entry_point, one_error_line, png

from ember.shards import iter_shard

wds = pytest.importorskip("webdataset")


def _ember_waiting(*args: str, deadline: float = 120) -> subprocess.CompletedProcess:
    """``ember shards ...`` in a fresh process, which must end within ``deadline`` seconds
    (a run that waits on a FIFO never ends; a loaded machine needs seconds to start one)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run([*entry_point(), "shards", *args], capture_output=True,
                          timeout=deadline, env=env, stdin=subprocess.DEVNULL)


def _keys(out_dir) -> list[str]:
    return [s["__key__"] for p in sorted(out_dir.glob("*.tar")) for s in iter_shard(str(p))]


def _tar_of(root, names: list[str], prefix: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name in names:
            tar.add(str(root / name), arcname=prefix + name, recursive=False)
    return buf.getvalue()


@pytest.mark.parametrize("prefix", ["", "./"])
def test_a_stream_keeps_a_reserved_class_and_leaves_hidden_members_out(tmp_path, prefix):
    root = _folder(tmp_path / "in", {"__background__": 3, "cat": 3})
    (root / "cat" / "._i0.png").write_bytes(b"macOS resource fork")
    (root / ".DS_Store").write_bytes(b"finder")
    by_folder = ember("create", str(root), "-o", str(tmp_path / "f" / "s-%03d.tar"), "-q",
                      "--no-shuffle")
    assert by_folder.returncode == 0, by_folder.stderr
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    r = ember("create", "-", "-o", str(tmp_path / "out" / "s-%03d.tar"), "-q",
              stdin=_tar_of(root, names, prefix))
    assert r.returncode == 0, r.stderr
    ours = _keys(tmp_path / "out")
    assert sorted(ours) == sorted(_keys(tmp_path / "f"))  # the keys the folder path writes
    assert len(ours) == 6
    theirs = [s["__key__"] for s in wds.WebDataset(str(tmp_path / "out" / "s-000.tar"),
                                                   shardshuffle=False)]
    assert theirs == ours
    err = r.stderr.decode().splitlines()
    left_out = [x for x in err if "left out" in x]
    assert len(left_out) == 1 and "2 hidden" in left_out[0], err
    assert any("_background__" in x and "differ" in x for x in err), err


def test_a_stream_with_both_a_reserved_class_and_its_new_name_is_refused(tmp_path):
    root = _folder(tmp_path / "in", {"__background__": 1, "_background__": 1})
    r = ember("create", "-", "-o", str(tmp_path / "out" / "s-%03d.tar"), "-q",
              stdin=_tar_of(root, ["__background__/i0.png", "_background__/i0.png"], ""))
    assert "__background__" in one_error_line(r, "create")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("link", ["nowhere.png", "self.png"])  # missing target; a loop (ELOOP)
def test_a_broken_link_is_listed_with_skip_bad_and_stops_the_run_without(tmp_path, link):
    root = _folder(tmp_path / "in", {"a": 2})
    os.symlink(link, root / "a" / "self.png")
    out = tmp_path / "out"
    line = one_error_line(ember("create", str(root), "-o", str(out / "s-%03d.tar"), "-q"),
                          "create")
    assert str(root / "a" / "self.png") in line and "symlink" in line
    assert not out.exists()
    r = ember("create", str(root), "-o", str(out / "s-%03d.tar"), "-q", "--skip-bad")
    assert r.returncode == 0, r.stderr
    assert sorted(_keys(out)) == ["a/i0", "a/i1"]
    summary = [x for x in r.stderr.decode().splitlines() if "bad" in x]
    assert len(summary) == 1 and str(root / "a" / "self.png") in summary[0], summary


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("skip_bad", [[], ["--skip-bad"]])
def test_a_fifo_named_like_an_image_is_left_out_unopened(tmp_path, skip_bad):
    root = _folder(tmp_path / "in", {"a": 2})
    os.mkfifo(root / "a" / "fifo.png")  # opening it for reading would wait for a writer
    out = tmp_path / "out"
    r = _ember_waiting("create", str(root), "-o", str(out / "s-%03d.tar"), "-q", *skip_bad)
    assert r.returncode == 0, r.stderr
    assert sorted(_keys(out)) == ["a/i0", "a/i1"]
    note = [x for x in r.stderr.decode().splitlines() if "left out" in x]
    assert len(note) == 1 and "not a regular file" in note[0], note
    assert str(root / "a" / "fifo.png") in note[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_listed_fifo_is_refused_unopened(tmp_path):
    root = _folder(tmp_path / "in", {"a": 1})
    os.mkfifo(root / "a" / "fifo.png")
    (root / "list.txt").write_text("a/i0.png\na/fifo.png\n")
    r = _ember_waiting("create", "--list", str(root / "list.txt"), "-o",
                       str(tmp_path / "o" / "s-%03d.tar"), "-q")
    assert "not a regular file" in one_error_line(r, "create")


def _linked_tar(root) -> bytes:
    """GNU tar's way: a second name of a file is a hard-link member naming the first."""
    (root / "dog").mkdir(parents=True)
    (root / "cat").mkdir()
    for name, (w, h) in {"dog/0.png": (4, 3), "dog/2.png": (5, 3), "cat/1.png": (6, 3)}.items():
        (root / name).write_bytes(png(w, h))
    os.link(root / "dog/0.png", root / "cat/0.png")
    os.symlink("../cat/1.png", root / "dog/1.png")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name in ["dog/0.png", "dog/2.png", "dog/1.png", "cat/0.png", "cat/1.png"]:
            tar.add(str(root / name), arcname=name, recursive=False)
    return buf.getvalue()


def test_a_stream_s_hard_link_takes_its_target_s_data_and_a_symlink_is_named(tmp_path):
    stream = _linked_tar(tmp_path / "in")
    with tarfile.open(fileobj=io.BytesIO(stream)) as tar:
        kinds = [m.type for m in tar]
    assert kinds.count(tarfile.LNKTYPE) == 1 and kinds.count(tarfile.SYMTYPE) == 1
    r = ember("create", "-", "-o", str(tmp_path / "out" / "s-%03d.tar"), "-q", stdin=stream)
    assert r.returncode == 0, r.stderr
    samples = {s["__key__"]: s for s in wds.WebDataset(str(tmp_path / "out" / "s-000.tar"),
                                                       shardshuffle=False)}
    assert sorted(samples) == ["cat/0", "cat/1", "dog/0", "dog/2"]
    assert samples["cat/0"]["png"] == (tmp_path / "in" / "dog/0.png").read_bytes()  # as tar -x
    left_out = [x for x in r.stderr.decode().splitlines() if "left out" in x]
    assert len(left_out) == 1 and "1 symlink" in left_out[0] and "dog/1.png" in left_out[0]


def test_a_stream_s_hard_link_to_no_earlier_member_is_one_line(tmp_path):
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat/1.png").write_bytes(png(4, 3))
    info = tarfile.TarInfo("cat/9.png")
    info.type, info.linkname = tarfile.LNKTYPE, "cat/missing.png"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        tar.add(str(tmp_path / "cat/1.png"), arcname="cat/1.png")
        tar.addfile(info)
    r = ember("create", "-", "-o", str(tmp_path / "out" / "s-%03d.tar"), "-q",
              stdin=buf.getvalue())
    assert "cat/9.png -> cat/missing.png" in one_error_line(r, "create")
    assert not (tmp_path / "out").exists()


def test_a_gzip_stream_cut_in_its_trailer_is_refused(tmp_path):
    root = _folder(tmp_path / "in", {"cat": 2, "dog": 2})
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    whole = gzip.compress(_tar_of(root, names, ""))
    assert ember("create", "-", "-o", str(tmp_path / "ok" / "s-%03d.tar"), "-q",
                 stdin=whole).returncode == 0
    r = ember("create", "-", "-o", str(tmp_path / "out" / "s-%03d.tar"), "-q", stdin=whole[:-4])
    line = one_error_line(r, "create")
    assert "gzip" in line or "ends" in line, line
    assert not (tmp_path / "out").exists()


def _stream_of(root, names: list[str]) -> bytes:
    """A tar of ``png`` files under the given member names (any name, ``..`` ones too)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            data = png(4, 3)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_class_with_three_leading_underscores_is_renamed_alike_from_a_folder_or_a_stream(
        tmp_path):
    root = _folder(tmp_path / "in", {"___x__": 1, "cat": 1})
    outs = {}
    for how, source, stdin in [("folder", str(root), None),
                               ("stream", "-", _tar_of(root, ["___x__/i0.png", "cat/i0.png"],
                                                       ""))]:
        r = ember("create", source, "-o", str(tmp_path / how / "s-%03d.tar"), "-q", stdin=stdin)
        assert r.returncode == 0, r.stderr
        assert "'_x__/i0'" in r.stderr.decode()  # the note names the key written
        outs[how] = sorted(s["__key__"] for s in wds.WebDataset(
            str(tmp_path / how / "s-000.tar"), shardshuffle=False))
    assert outs["folder"] == outs["stream"] == ["_x__/i0", "cat/i0"]  # webdataset reads both


def test_a_stream_with_two_reserved_classes_that_would_meet_is_refused(tmp_path):
    r = ember("create", "-", "-o", str(tmp_path / "out" / "s-%03d.tar"), "-q",
              stdin=_stream_of(tmp_path, ["__x__/0.png", "___x__/0.png"]))
    assert "___x__" in one_error_line(r, "create")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["../cat/0.png", "cat/../0.png", "/abs/0.png"])
def test_a_stream_member_that_climbs_out_is_unsafe(tmp_path, name):
    r = ember("create", "-", "-o", str(tmp_path / "out" / "s-%03d.tar"), "-q",
              stdin=_stream_of(tmp_path, ["cat/1.png", name]))
    line = one_error_line(r, "create")
    assert "unsafe" in line and name in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("names", [[], [".DS_Store"]])
def test_a_stream_without_samples_is_refused(tmp_path, names):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        folder = tarfile.TarInfo("cat")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
    stream = _stream_of(tmp_path, names) if names else buf.getvalue()
    r = ember("create", "-", "-o", str(tmp_path / "out" / "s-%03d.tar"), "-q", stdin=stream)
    assert "no samples" in one_error_line(r, "create")
    assert not (tmp_path / "out").exists()
