"""Small behaviours of ``ember shards`` through the ``ember`` entry point: sizes past any
number, flag combinations that cannot mean anything, a closed output pipe, counts in what the
command says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from test_cli_guards import ember, entry_point, one_error_line, png

from conftest import tar_bytes
from ember.shards import ShardWriter


def _shard(tmp_path, n: int = 5) -> str:
    with ShardWriter(str(tmp_path / "s-%04d.tar"), maxcount=n) as w:
        for i in range(n):
            w.write({"__key__": f"k{i}", "txt": "x"})
    return str(tmp_path / "s-0000.tar")


@pytest.mark.parametrize("size", ["1e400", "1e400MB", "9e99GiB"])
def test_a_maxsize_past_any_number_is_one_line(tmp_path, size):
    line = one_error_line(ember("split", _shard(tmp_path), "-o", str(tmp_path / "o" / "x-%03d.tar"),
                                "--maxsize", size), "split")
    assert "--maxsize" in line and size in line
    assert not (tmp_path / "o").exists()


def test_cat_into_a_pipe_closed_early_ends_quietly(tmp_path):
    with ShardWriter(str(tmp_path / "s-%04d.tar"), maxcount=5000) as w:
        for i in range(5000):  # more lines than a pipe and stdout's buffer hold
            w.write({"__key__": f"sample-{i:06d}", "txt": "x"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([*entry_point(), "shards", "cat", str(tmp_path / "s-0000.tar")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"sample-000000")
    proc.stdout.close()  # as `| head -1` does once it has its line
    try:
        err = proc.stderr.read()
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert err == b""
    assert code == 128 + signal.SIGPIPE  # as a Unix tool ended by SIGPIPE


@pytest.mark.parametrize("action", ["ls", "verify"])
def test_an_action_run_with_standard_output_closed_ends_quietly(tmp_path, action):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    # `ember shards ls x.tar >&-`: Python starts with sys.stdout None
    proc = subprocess.run(["bash", "-c", '"$@" >&-', "bash", *entry_point(), "shards", action,
                           "-q", _shard(tmp_path)], capture_output=True, timeout=300, env=env)
    assert proc.stderr == b""
    assert proc.returncode == 0


@pytest.fixture
def images(tmp_path):
    root = tmp_path / "in"
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for j in range(2):
            (root / c / f"i{j}.png").write_bytes(png(4, 4))
    return root


def test_no_shuffle_with_a_seed_is_refused(images, tmp_path):
    r = ember("create", str(images), "-o", str(tmp_path / "o" / "s-%03d.tar"), "--no-shuffle",
              "--seed", "5")
    line = one_error_line(r, "create")
    assert "--seed" in line and "--no-shuffle" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag", [["--seed", "5"], ["--no-shuffle"]])
def test_an_order_flag_for_a_list_or_a_stream_is_refused(images, tmp_path, flag):
    (images / "list.txt").write_text("a/i0.png\n")
    for source in (["--list", str(images / "list.txt")], ["-"]):
        r = ember("create", *source, "-o", str(tmp_path / "o" / "s-%03d.tar"), *flag)
        assert flag[0] in one_error_line(r, "create")
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("post", ["", "  ", "no-such-program-for-ember-tests {}"])
def test_a_post_command_that_cannot_run_is_refused_before_the_walk(images, tmp_path,
                                                                    monkeypatch, post):
    from ember.shards import cli

    walked = []
    monkeypatch.setattr(cli.os, "walk", lambda *a, **k: walked.append(a) or iter(()))
    r = ember("create", str(images), "-o", str(tmp_path / "o" / "s-%03d.tar"), "--post", post)
    line = one_error_line(r, "create")
    assert "--post" in line
    assert walked == [] and not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag", ["--json", "--values"])
def test_cat_tar_with_a_listing_flag_is_refused(tmp_path, flag):
    r = ember("cat", _shard(tmp_path), "--tar", flag)
    line = one_error_line(r, "cat")
    assert "--tar" in line and flag in line
    assert r.stdout == b""


def test_verify_counts_the_samples_read_before_a_bad_name(tmp_path):
    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes([("a.txt", b"A"), ("b.txt", b"B"), ("../e.txt", b"E")]))
    r = ember("verify", str(path), "-q")
    assert r.returncode == 1
    assert "0 of 1 shards ok, 2 samples read, 1 corrupt" in r.stdout.decode()


def test_the_create_progress_bar_ends_full_when_an_image_is_bad(images, tmp_path):
    (images / "b" / "i1.png").write_bytes(b"not a png")
    r = ember("create", str(images), "-o", str(tmp_path / "o" / "s-%03d.tar"), "--skip-bad")
    assert r.returncode == 0, r.stderr
    bars = [x for x in r.stderr.decode().replace("\r", "\n").splitlines() if "sample" in x
            and "/" in x]
    assert bars and "4/4" in bars[-1] and "100%" in bars[-1], bars


def test_merge_refuses_inputs_of_which_only_some_have_classes_json(images, tmp_path):
    r = ember("create", str(images), "-o", str(tmp_path / "c" / "s-%03d.tar"), "-q")
    assert r.returncode == 0, r.stderr
    (tmp_path / "plain").mkdir()
    plain = _shard(tmp_path / "plain")  # shards without a classes.json beside them
    for urls in ([str(tmp_path / "c" / "s-000.tar"), plain],
                 [plain, str(tmp_path / "c" / "s-000.tar")]):
        r = ember("merge", *urls, "-o", str(tmp_path / "m" / "m-%03d.tar"), "-q")
        line = one_error_line(r, "merge")
        assert "classes.json" in line and str(tmp_path / "plain") in line
        assert not (tmp_path / "m").exists()


def test_the_largest_maxsize_the_message_allows_is_taken(tmp_path):
    out = tmp_path / "o" / "x-%03d.tar"
    r = ember("split", "-q", _shard(tmp_path), "-o", str(out), "--maxsize", str(2**63 - 1))
    assert r.returncode == 0, r.stderr
    line = one_error_line(ember("split", _shard(tmp_path), "-o", str(tmp_path / "p" / "x-%03d.tar"),
                                "--maxsize", str(2**63)), "split")
    assert "--maxsize" in line


def test_a_post_command_with_an_open_quote_names_the_flag(tmp_path):
    line = one_error_line(ember("split", _shard(tmp_path), "-o",
                                str(tmp_path / "o" / "x-%03d.tar"), "--post", '"x {}'), "split")
    assert "--post" in line and "quotation" in line
    assert not (tmp_path / "o").exists()


def test_ls_says_an_unreadable_index_in_one_line(tmp_path):
    shard = _shard(tmp_path)
    (tmp_path / "s-0000.tar.idx").write_bytes(b"not an index")
    r = ember("ls", "-q", shard, process=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().splitlines()[0] == f"5\t{shard}"
    err = r.stderr.decode().strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ember shards ls: ignoring unreadable index"), err
