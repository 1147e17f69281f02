"""The ``ember shards`` command, driven through ember.cli.main."""

from __future__ import annotations

import json
import os
import tarfile

from ember.cli import main
from ember.shards import iter_shard
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
    assert main(["shards"]) == 0
    assert "verify" in capsys.readouterr().out
