"""Shard-writing commands and writers never leave bad or partial shards, on shards
written by the webdataset package with keys that restart at 0 in every shard."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from ember.cli import main
from ember.shards import ShardWriter, TarWriter, iter_shard
from ember.shards.urls import expand_urls

wds = pytest.importorskip("webdataset")


def _wds_shards(tmp_path: Path, n_shards: int = 4, per: int = 40) -> list[str]:
    """One webdataset TarWriter per shard, each numbering its samples from 0 (one writer per
    process, as is common)."""
    urls = []
    for i in range(n_shards):
        path = str(tmp_path / f"part-{i}.tar")
        with wds.TarWriter(path) as w:
            for j in range(per):
                w.write({"__key__": f"{j:06d}", "cls": str(i * 1000 + j), "txt": f"s{i}-{j}"})
        urls.append(path)
    return urls


def _read(pattern: str) -> list[dict]:
    return [s for u in expand_urls(pattern) for s in iter_shard(u)]


def _verify_with_webdataset(pattern: str) -> list[dict]:
    ds = wds.WebDataset(expand_urls(pattern), shardshuffle=False, empty_check=False)
    return list(ds)


@pytest.mark.parametrize("command", [["shuffle"], ["shuffle", "--buffer", "50"], ["merge"]])
def test_restarting_keys_give_no_duplicates(tmp_path, capsys, command):
    urls = _wds_shards(tmp_path)
    out = str(tmp_path / "out" / "o-%03d.tar")
    assert main(["shards", *command, *urls, "-o", out, "--maxcount", "40", "-q"]) == 0
    assert "wrote 160 samples to 4 shards" in capsys.readouterr().out
    assert main(["shards", "verify", str(tmp_path / "out" / "o-{000..003}.tar"), "-q"]) == 0
    samples = _read(str(tmp_path / "out" / "o-{000..003}.tar"))
    assert len(samples) == 160
    assert len({s["__key__"] for s in samples}) == 160
    # every input sample is there once, with its fields intact
    assert sorted(bytes(s["cls"]).decode() for s in samples) == sorted(
        str(i * 1000 + j) for i in range(4) for j in range(40))
    # renamed keys carry the source shard, and the payload matches it
    for s in samples:
        i, j = bytes(s["txt"]).decode()[1:].split("-")
        assert s["__key__"] in (f"{int(j):06d}", f"part-{i}/{int(j):06d}")
    # and webdataset reads the result as the same 160 samples
    got = _verify_with_webdataset(str(tmp_path / "out" / "o-{000..003}.tar"))
    assert len(got) == 160 and len({s["__key__"] for s in got}) == 160


def test_merge_joins_a_sample_split_across_two_shards(tmp_path, capsys):
    a, b = str(tmp_path / "a.tar"), str(tmp_path / "b.tar")
    with wds.TarWriter(a) as w:
        w.write({"__key__": "x0", "cls": "0", "txt": "a"})
        w.write({"__key__": "x1", "cls": "1"})  # x1's txt is in the next shard
    with wds.TarWriter(b) as w:
        w.write({"__key__": "x1", "txt": "b"})
        w.write({"__key__": "x2", "cls": "2", "txt": "c"})
    out = str(tmp_path / "m-%02d.tar")
    assert main(["shards", "merge", a, b, "-o", out, "-q"]) == 0
    assert "wrote 3 samples to 1 shard" in capsys.readouterr().out
    samples = _read(str(tmp_path / "m-00.tar"))
    assert [s["__key__"] for s in samples] == ["x0", "x1", "x2"]
    assert bytes(samples[1]["cls"]) == b"1" and bytes(samples[1]["txt"]) == b"b"


def test_global_shuffle_of_gzipped_shards_is_refused_up_front(tmp_path, capsys):
    path = str(tmp_path / "g.tar.gz")
    with wds.TarWriter(path, compress=True) as w:
        for j in range(20):
            w.write({"__key__": f"{j:04d}", "cls": str(j)})
    out = tmp_path / "o-%02d.tar"
    assert main(["shards", "shuffle", path, "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert "uncompressed" in err and "--buffer" in err
    assert not list(tmp_path.glob("o-*"))
    # through a buffer it works
    assert main(["shards", "shuffle", path, "--buffer", "5", "-o", str(out), "-q"]) == 0
    assert len(_read(str(tmp_path / "o-00.tar"))) == 20


@pytest.mark.parametrize("command", [["merge"], ["split"], ["shuffle"], ["shuffle", "--buffer", "4"]])
def test_a_sample_with_files_apart_is_refused_not_renamed(unsorted_tar, tmp_path, capsys, command):
    # renaming the second part (as for keys that restart in another shard) would write two
    # half samples and report success
    out = tmp_path / "out" / "o-%02d.tar"
    assert main(["shards", *command, unsorted_tar, "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert "'./s1'" in err and "not adjacent" in err and "unsorted.tar" in err
    assert not list((tmp_path / "out").glob("*"))  # (an absent folder globs to nothing)


def test_failed_split_leaves_no_shard_behind(tmp_path, capsys):
    good = str(tmp_path / "good.tar")
    with wds.TarWriter(good) as w:
        for j in range(27):
            w.write({"__key__": f"{j:04d}", "cls": str(j)})
    bad = str(tmp_path / "bad.tar")
    data = Path(good).read_bytes()
    Path(bad).write_bytes(data[: 512 * 9 + 100])  # truncated inside a member
    out = tmp_path / "out" / "split-%03d.tar"
    assert main(["shards", "split", good, bad, "-o", str(out), "--maxcount", "10", "-q"]) == 2
    assert "error" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # not even the folder the run made


def test_shard_writer_exception_inside_with_leaves_no_partial_shard(tmp_path):
    pattern = str(tmp_path / "w-%02d.tar")
    with pytest.raises(RuntimeError, match="boom"), ShardWriter(pattern, maxcount=5) as w:
        for j in range(12):
            w.write({"__key__": f"{j:03d}", "cls": j})
        raise RuntimeError("boom")
    names = sorted(os.listdir(tmp_path))
    assert names == ["w-00.tar", "w-01.tar"]  # the two finished shards; w-02 (2 samples) is gone
    for name in names:
        assert len(list(wds.WebDataset(str(tmp_path / name), shardshuffle=False))) == 5


def test_tar_writer_exception_inside_with_leaves_nothing(tmp_path):
    path = tmp_path / "t.tar"
    with pytest.raises(RuntimeError, match="boom"), TarWriter(str(path)) as w:
        w.write({"__key__": "a", "cls": 1})
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    with TarWriter(str(path)) as w:
        w.write({"__key__": "a", "cls": 1})
    assert os.listdir(tmp_path) == ["t.tar"]
    with tarfile.open(path) as tf:
        assert tf.getnames() == ["a.cls"]


def test_writers_refuse_a_key_equal_to_the_previous_one(tmp_path):
    with TarWriter(str(tmp_path / "t.tar")) as w:
        w.write({"__key__": "a", "cls": 1})
        with pytest.raises(ValueError, match="previous sample's key"):
            w.write({"__key__": "a", "txt": "x"})
        w.write({"__key__": "b", "cls": 2})
    assert [s["__key__"] for s in iter_shard(str(tmp_path / "t.tar"))] == ["a", "b"]
    # across a shard boundary of a ShardWriter too
    with ShardWriter(str(tmp_path / "s-%02d.tar"), maxcount=1) as sw:
        sw.write({"__key__": "a", "cls": 1})
        with pytest.raises(ValueError, match="previous sample's key"):
            sw.write({"__key__": "a", "cls": 2})
