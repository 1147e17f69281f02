"""``ember shards create`` on real folders, through the ``ember`` entry point: symlink loops,
shuffled shards, bad images, flag checks before the walk, class names webdataset keeps,
``classes.json`` carried by split/merge/shuffle, and no output left by a failed run."""

from __future__ import annotations

import json
import os

import pytest
from test_cli_guards import ember, jpeg, one_error_line, png

from ember.shards import iter_shard
from ember.shards.urls import expand_urls

wds = pytest.importorskip("webdataset")


def _folder(root, classes: dict[str, int]):
    for name, count in classes.items():
        (root / name).mkdir(parents=True)
        for j in range(count):
            (root / name / f"i{j}.png").write_bytes(png(4 + j, 3))
    return root


def _samples(out_dir) -> list[dict]:
    return [s for p in sorted(out_dir.glob("*.tar")) for s in iter_shard(str(p))]


def test_a_symlink_loop_is_walked_once_and_reported(tmp_path):
    root = _folder(tmp_path / "in", {"cat": 3, "dog": 2})
    os.symlink("..", root / "cat" / "up")  # cat/up -> in: a loop through every class
    os.symlink(root / "dog", root / "cat" / "dog-again")  # a second way into dog
    r = ember("create", str(root), "-o", str(tmp_path / "out" / "s-%03d.tar"), "-q",
              process=True)
    assert r.returncode == 0, r.stderr
    keys = sorted(s["__key__"] for s in _samples(tmp_path / "out"))
    assert keys == ["cat/i0", "cat/i1", "cat/i2", "dog/i0", "dog/i1"]
    err = r.stderr.decode()
    assert "symlink" in err and str(root / "cat" / "up") in err


def test_samples_are_shuffled_across_shards_by_seed_unless_no_shuffle(tmp_path):
    root = _folder(tmp_path / "in", {"a": 6, "b": 6, "c": 6})

    def order(*flags: str, out: str) -> list[str]:
        r = ember("create", str(root), "-o", str(tmp_path / out / "s-%03d.tar"), "--maxcount",
                  "6", "-q", *flags)
        assert r.returncode == 0, r.stderr
        return [s["__key__"] for s in _samples(tmp_path / out)]

    plain = order("--no-shuffle", out="plain")
    assert plain == sorted(plain)  # folder order: one class per shard
    first = order(out="s0")
    assert sorted(first) == plain and first != plain
    assert all(len({k.split("/")[0] for k in first[i:i + 6]}) > 1 for i in range(0, 18, 6))
    assert order(out="s0-again") == first  # the default seed repeats
    assert order("--seed", "1", out="s1") != first


def test_bad_images_stop_with_one_line_or_are_skipped_and_listed(tmp_path):
    root = _folder(tmp_path / "in", {"a": 2, "b": 2})
    (root / "a" / "broken.png").write_bytes(b"not a png")
    (root / "b" / "cut.jpg").write_bytes(jpeg(8, 8)[:40])
    out = tmp_path / "out"
    r = ember("create", str(root), "-o", str(out / "s-%03d.tar"), "-q", process=True)
    line = one_error_line(r, "create")
    assert "broken.png" in line or "cut.jpg" in line  # the first in the shuffled order
    assert not out.exists()  # no empty output folder is left behind
    r = ember("create", str(root), "-o", str(out / "s-%03d.tar"), "-q", "--skip-bad",
              process=True)
    assert r.returncode == 0, r.stderr
    assert sorted(s["__key__"] for s in _samples(out)) == ["a/i0", "a/i1", "b/i0", "b/i1"]
    summary = [x for x in r.stderr.decode().splitlines() if "bad" in x]
    assert len(summary) == 1 and "2 bad" in summary[0]
    assert "broken.png" in summary[0] and "cut.jpg" in summary[0]


def test_flags_are_checked_before_the_folder_is_walked(tmp_path, monkeypatch):
    from ember.shards import cli

    root = _folder(tmp_path / "in", {"a": 1})
    walked = []
    monkeypatch.setattr(cli.os, "walk", lambda *a, **k: walked.append(a) or iter(()))
    for flags, word in [(["--maxcount", "0"], "--maxcount"),
                        (["--maxsize", "2 apples"], "--maxsize")]:
        r = ember("create", str(root), "-o", str(tmp_path / "o" / "s-%03d.tar"), *flags)
        assert word in one_error_line(r, "create")
    r = ember("create", str(root), "-o", str(tmp_path / "o" / "s.tar"))
    assert "shard number" in one_error_line(r, "create")
    assert walked == []
    assert not (tmp_path / "o").exists()


def test_a_reserved_class_name_gives_samples_webdataset_reads(tmp_path):
    root = _folder(tmp_path / "in", {"__background__": 3, "cat": 3})
    out = tmp_path / "out"
    r = ember("create", str(root), "-o", str(out / "s-%03d.tar"), "-q", "--no-shuffle")
    assert r.returncode == 0, r.stderr
    ours = [(s["__key__"], s["cls"]) for s in _samples(out)]
    theirs = [(s["__key__"], s["cls"]) for s in
              wds.WebDataset([str(p) for p in sorted(out.glob("*.tar"))], shardshuffle=False)]
    assert len(ours) == 6 and ours == theirs
    classes = json.loads((out / "classes.json").read_text())["classes"]
    assert classes == ["__background__", "cat"]
    assert [c for _, c in ours] == [b"0"] * 3 + [b"1"] * 3


@pytest.mark.parametrize("action", ["split", "merge", "shuffle"])
def test_resharding_carries_classes_json(tmp_path, action):
    root = _folder(tmp_path / "in", {"a": 3, "b": 3})
    r = ember("create", str(root), "-o", str(tmp_path / "c" / "s-%03d.tar"), "-q",
              "--maxcount", "2")
    assert r.returncode == 0, r.stderr
    urls = expand_urls(str(tmp_path / "c" / "s-{000..002}.tar"))
    r = ember(action, *urls, "-o", str(tmp_path / "r" / "t-%03d.tar"), "-q")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "r" / "classes.json").read_text() == \
        (tmp_path / "c" / "classes.json").read_text()


def test_shards_without_an_action_prints_its_help_and_exits_2():
    r = ember(process=True)
    assert r.returncode == 2
    assert "verify" in (r.stdout + r.stderr).decode()


def test_a_failed_run_leaves_no_output_folder(tmp_path):
    root = _folder(tmp_path / "in", {"a": 3, "b": 1})
    (root / "b" / "z-broken.png").write_bytes(b"not a png")  # the last sample in folder order
    out = tmp_path / "new" / "deeper"
    r = ember("create", str(root), "-o", str(out / "s-%03d.tar"), "--maxcount", "1",
              "--no-shuffle")
    assert "z-broken.png" in one_error_line(r, "create")
    assert not (tmp_path / "new").exists()
