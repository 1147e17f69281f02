"""The ``ember shards`` command, driven through ember.cli.main."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest

from ember.cli import main
from ember.shards import TarWriter, iter_shard
from ember.shards.urls import expand_urls


def _keys(pattern: str) -> list[str]:
    return [s["__key__"] for u in expand_urls(pattern) for s in iter_shard(u)]


def test_ls_counts_samples(shards, capsys):
    pattern, keys = shards
    assert main(["shards", "ls", pattern]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 7
    assert all(line.startswith("10\t") for line in lines[:6])
    assert lines[-1] == "60\ttotal"


def test_cat_prints_keys_and_values(shards, capsys):
    pattern, keys = shards
    assert main(["shards", "cat", pattern, "-n", "3", "--values", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["__key__"] for r in rows] == keys[:3]
    assert [r["cls"] for r in rows] == ['"0"', '"1"', '"2"']
    assert rows[0]["bin"] == json.dumps("\x00" * 16)


def test_stats_json(shards, capsys):
    pattern, _ = shards
    assert main(["shards", "stats", pattern, "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"]["samples"] == 60
    assert out["total"]["extensions"] == {"bin": 60, "cls": 60}
    # 60 payloads of 16 bytes plus the cls digits: 10 one-digit and 50 two-digit numbers
    assert out["total"]["bytes"] == 60 * 16 + 10 * 1 + 50 * 2
    assert len(out["shards"]) == 6


def test_verify_ok_and_corrupt(shards, tmp_path, capsys):
    pattern, _ = shards
    assert main(["shards", "verify", pattern, "-q"]) == 0
    assert "6 of 6 shards ok, 60 samples read, 0 corrupt" in capsys.readouterr().out
    victim = expand_urls(pattern)[2]
    with open(victim, "rb") as f:
        data = f.read()
    with open(victim, "wb") as f:
        f.write(data[: 512 * 5 + 100])
    assert main(["shards", "verify", pattern, "-q"]) == 1
    out = capsys.readouterr().out
    assert "5 of 6 shards ok" in out
    corrupt = [line for line in out.splitlines() if line.startswith("CORRUPT")]
    assert len(corrupt) == 1 and victim in corrupt[0] and "byte" in corrupt[0]
    garbage = tmp_path / "garbage.tar"  # not a tar at all: its first header fails the checksum
    garbage.write_bytes(b"x" * 700)
    assert main(["shards", "verify", pattern, str(garbage), "-q"]) == 1
    out = capsys.readouterr().out
    assert f"CORRUPT shard {garbage} at byte 0: tar header checksum mismatch" in out
    assert "5 of 7 shards ok" in out


def test_split_merge_keep_samples(shards, tmp_path, capsys):
    pattern, keys = shards
    out_dir = tmp_path / "split"
    assert main(["shards", "split", pattern, "-q", "-o", str(out_dir / "p-%03d.tar"),
                 "--maxcount", "4"]) == 0
    parts = sorted(os.listdir(out_dir))
    assert parts == [f"p-{i:03d}.tar" for i in range(15)]
    split_pattern = str(out_dir / "p-{000..014}.tar")
    assert _keys(split_pattern) == keys
    merged = tmp_path / "merged"
    assert main(["shards", "merge", split_pattern, "-q", "-o", str(merged / "m-%02d.tar"),
                 "--maxcount", "100"]) == 0
    assert sorted(os.listdir(merged)) == ["m-00.tar"]
    with tarfile.open(merged / "m-00.tar") as tf:
        names = tf.getnames()
    assert names == [f"{k}.{e}" for k in keys for e in ("bin", "cls")]
    first = next(iter_shard(str(merged / "m-00.tar")))
    assert first["cls"] == b"0" and first["bin"] == b"\x00" * 16


def test_shuffle_permutes_reproducibly(shards, tmp_path, capsys):
    pattern, keys = shards
    orders = []
    for run in ("a", "b"):
        out = tmp_path / run
        assert main(["shards", "shuffle", pattern, "-q", "-o", str(out / "x-%02d.tar"),
                     "--maxcount", "30", "--seed", "7"]) == 0
        orders.append(_keys(str(out / "x-{00..01}.tar")))
    assert orders[0] == orders[1]
    assert sorted(orders[0]) == sorted(keys)
    assert orders[0] != keys
    out = tmp_path / "c"
    assert main(["shards", "shuffle", pattern, "-q", "-o", str(out / "x-%02d.tar"),
                 "--maxcount", "60", "--seed", "8", "--buffer", "5"]) == 0
    buffered = _keys(str(out / "x-00.tar"))
    assert sorted(buffered) == sorted(keys) and buffered != keys


def test_index_writes_idx_files(shards, capsys):
    pattern, keys = shards
    assert main(["shards", "index", pattern, "-q"]) == 0
    for url in expand_urls(pattern):
        with open(url + ".idx") as f:
            idx = json.load(f)
        assert idx["size"] == os.path.getsize(url)
        assert len(idx["samples"]) == 10
        # each span starts on a 512-byte header boundary and spans two members
        for _key, start, end in idx["samples"]:
            assert start % 512 == 0 and end > start
    assert main(["shards", "ls", pattern]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "60\ttotal"


def test_shards_without_subcommand_prints_help(capsys):
    assert main(["shards"]) == 2
    assert "verify" in capsys.readouterr().err


def test_cat_plain_lists_field_sizes(shards, capsys):
    pattern, keys = shards
    assert main(["shards", "cat", pattern, "-n", "12"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # sizes are labelled as bytes: "cls=1" read as class 1
    assert lines[0] == f"{keys[0]}  bin: 16 bytes, cls: 1 bytes"
    assert lines[11] == f"{keys[11]}  bin: 16 bytes, cls: 2 bytes"  # after 12, across shards
    assert len(lines) == 12


@pytest.mark.parametrize("action", ["ls", "cat", "stats", "split", "merge", "shuffle", "index"])
def test_missing_shard_is_a_one_line_error(shards, tmp_path, capsys, action):
    pattern, _ = shards
    missing = str(tmp_path / "missing.tar")
    args = ["shards", action, missing]
    if action in ("split", "merge", "shuffle"):
        args += ["-o", str(tmp_path / "o-%02d.tar")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"ember shards {action}: error: shard {missing}")
    assert "no such file" in err


def test_verify_reports_a_sample_whose_files_are_not_adjacent(unsorted_tar, capsys):
    # readers (webdataset's too) yield such a sample as two samples, each missing fields
    assert main(["shards", "verify", unsorted_tar, "-q"]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("SPLIT SAMPLE"))
    assert unsorted_tar in line and "'./s1'" in line and "--sort=name" in line
    assert "0 of 1 shards ok" in out


def test_verify_counts_a_missing_shard_as_corrupt(shards, tmp_path, capsys):
    pattern, _ = shards
    missing = str(tmp_path / "missing.tar")
    assert main(["shards", "verify", pattern, missing, "-q"]) == 1
    out = capsys.readouterr().out
    assert f"CORRUPT shard {missing}: no such file" in out
    assert "6 of 7 shards ok, 60 samples read, 1 corrupt" in out


def test_verify_reports_indexes_that_no_longer_match(shards, capsys):
    pattern, keys = shards
    urls = expand_urls(pattern)
    assert main(["shards", "index", pattern, "-q"]) == 0
    assert main(["shards", "verify", pattern, "-q"]) == 0
    # same size, other keys: only comparing the keys finds it
    with TarWriter(urls[1]) as w:
        for i in range(10):
            w.write({"__key__": f"x{i + 10:05d}", "cls": i, "bin": b"z" * 16})
    # another size: stale
    with TarWriter(urls[2]) as w:
        w.write({"__key__": "only", "cls": 1})
    capsys.readouterr()
    assert main(["shards", "verify", pattern, "-q"]) == 1
    out = capsys.readouterr().out
    assert f"BAD INDEX shard {urls[1]}: index {urls[1]}.idx lists 10 samples" in out
    assert f"BAD INDEX shard {urls[2]}: stale index {urls[2]}.idx" in out
    assert "6 of 6 shards ok, 51 samples read, 0 corrupt, 2 with a bad index" in out


def test_output_pattern_without_a_number_is_refused(shards, tmp_path, capsys):
    pattern, _ = shards
    out = tmp_path / "one.tar"
    assert main(["shards", "split", pattern, "-q", "-o", str(out), "--maxcount", "4"]) == 2
    assert "has no shard number" in capsys.readouterr().err
    assert not out.exists()


def test_output_pattern_naming_an_input_is_refused(shards, tmp_path, capsys):
    pattern, _ = shards
    urls = expand_urls(pattern)
    before = [Path(u).read_bytes() for u in urls]
    # the inputs are s-000.tar ... s-005.tar; s-%03d.tar in the same folder would overwrite them
    assert main(["shards", "merge", pattern, "-q", "-o", str(tmp_path / "s-%03d.tar")]) == 2
    err = capsys.readouterr().err
    assert f"names the input shard {urls[0]}" in err
    assert [Path(u).read_bytes() for u in urls] == before
    # a pattern of another width does not name them
    assert main(["shards", "merge", pattern, "-q", "-o", str(tmp_path / "s-%04d.tar")]) == 0


def test_global_shuffle_of_remote_shards_points_to_buffer(capsys):
    assert main(["shards", "shuffle", "http://127.0.0.1:9/a.tar", "-q", "-o", "x-%02d.tar"]) == 2
    err = capsys.readouterr().err
    assert "needs local shards, not http://127.0.0.1:9/a.tar" in err and "--buffer" in err


def test_index_of_a_remote_shard_is_refused(capsys):
    assert main(["shards", "index", "http://127.0.0.1:9/a.tar", "-q"]) == 2
    assert "local shards only" in capsys.readouterr().err


def test_bad_numbers_are_refused(shards, tmp_path, capsys):
    pattern, _ = shards
    assert main(["shards", "cat", pattern, "-n", "-1"]) == 2
    assert "-n must be >= 0" in capsys.readouterr().err
    assert main(["shards", "split", pattern, "-q", "-o", str(tmp_path / "p-%02d.tar"),
                 "--maxcount", "0"]) == 2
    assert "--maxcount must be a whole number >= 1" in capsys.readouterr().err
    assert main(["shards", "shuffle", pattern, "-q", "-o", str(tmp_path / "p-%02d.tar"),
                 "--buffer", "-3"]) == 2
    assert "--buffer must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["ls", "stats", "verify", "index", "split"])
def test_long_work_shows_progress_unless_quiet(shards, tmp_path, capsys, action):
    pattern, _ = shards
    args = ["shards", action, pattern]
    if action == "split":
        args += ["-o", str(tmp_path / "p-%03d.tar")]
    assert main(args) == 0
    assert "6/6" in capsys.readouterr().err  # tqdm: 6 of 6 shards
    if action == "split":
        args[-1] = str(tmp_path / "q-%03d.tar")
    assert main(args + ["-q"]) == 0
    assert capsys.readouterr().err == ""


def test_shuffle_shows_progress_per_sample(shards, tmp_path, capsys):
    pattern, _ = shards
    assert main(["shards", "shuffle", pattern, "-o", str(tmp_path / "x-%02d.tar")]) == 0
    assert "60/60" in capsys.readouterr().err
    assert main(["shards", "shuffle", pattern, "-o", str(tmp_path / "y-%02d.tar"),
                 "--buffer", "8"]) == 0
    assert "60sample" in capsys.readouterr().err.replace(" ", "")


def test_pipe_urls_need_allow_pipe(shards, capsys):
    pattern, _ = shards
    url = f"pipe:cat {expand_urls(pattern)[0]}"
    assert main(["shards", "stats", url, "-q", "--json"]) == 2
    assert "allow_pipe" in capsys.readouterr().err
    assert main(["shards", "stats", url, "-q", "--json", "--allow-pipe"]) == 0
    assert json.loads(capsys.readouterr().out)["total"]["samples"] == 10
    assert main(["shards", "ls", url, "--allow-pipe", "-q"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"10\t{url}"
