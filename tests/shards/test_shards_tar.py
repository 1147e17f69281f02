"""Reading shards written by GNU tar and Python's tarfile; corrupt, truncated and empty shards."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import subprocess
import tarfile

import pytest

from ember.shards import ShardDataset, ShardError, TruncatedShardError, iter_shard

LONG_DIR = "deep/" + "d" * 60 + "/" + "e" * 60


def _expected_files(root):
    """Sample content laid out on disk: key -> {ext: bytes} (with a long-named key)."""
    files = {
        "a": {"txt": b"alpha", "cls": b"1"},
        "b": {"txt": b"beta" * 300, "cls": b"2", "seg.png": b"not really a png"},
        f"{LONG_DIR}/{'k' * 120}": {"txt": b"long name", "json": b'{"x": 1}'},
    }
    for key, fields in files.items():
        for ext, data in fields.items():
            path = os.path.join(root, f"{key}.{ext}")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
    return files


def _member_list(files):
    return [f"{k}.{e}" for k in files for e in sorted(files[k])]


def _as_dicts(samples):
    return {s["__key__"]: {k: v for k, v in s.items() if k[:2] != "__"} for s in samples}


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs tar")
@pytest.mark.parametrize("fmt", ["gnu", "pax", "ustar"])
def test_reads_gnu_tar_archives(tmp_path, fmt):
    src = tmp_path / "src"
    src.mkdir()
    files = _expected_files(src)
    if fmt == "ustar":  # USTAR cannot hold the long name
        files = {k: v for k, v in files.items() if len(k) < 90}
    os.symlink("a.txt", src / "zlink.txt")
    members = ["deep", *_member_list(files), "zlink.txt"]
    shard = tmp_path / "gnu.tar"
    subprocess.run(["tar", f"--format={fmt}", "--no-recursion", "-cf", str(shard), "-C", str(src),
                    *members], check=True)
    assert _as_dicts(iter_shard(str(shard))) == files


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_reads_python_tarfile_archives(tmp_path, fmt):
    files = {"s0": {"txt": b"zero", "cls": b"0"}, "s1": {"txt": b"one" * 1000, "cls": b"1"}}
    if fmt != tarfile.USTAR_FORMAT:
        files["x/" + "y" * 150] = {"txt": b"long"}
    shard = tmp_path / "py.tar"
    with tarfile.open(shard, "w", format=fmt) as tf:
        d = tarfile.TarInfo("somedir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        for key, fields in files.items():
            for ext in sorted(fields):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(fields[key_ext := ext])
                tf.addfile(info, io.BytesIO(fields[key_ext]))
    got = _as_dicts(iter_shard(str(shard)))
    assert got == files


def test_reads_gzipped_shards_and_members(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in [("a.txt.gz", gzip.compress(b"hello")), ("a.cls", b"3")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    shard = tmp_path / "x.tar.gz"
    shard.write_bytes(gzip.compress(buf.getvalue()))
    (sample,) = list(ShardDataset(str(shard)).decode())
    assert sample["txt.gz"] == "hello" and sample["cls"] == 3


def _good_shard(tmp_path, n=5, size=3000):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(n):
            for ext, data in (("bin", bytes([i]) * size), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"k{i}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _header_offsets(data):
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return [m.offset for m in tf.getmembers()]


def test_corrupt_header_names_shard_and_offset(tmp_path):
    data = bytearray(_good_shard(tmp_path))
    third = _header_offsets(bytes(data))[3]  # k1.cls
    data[third + 10] ^= 0xFF
    shard = tmp_path / "bad.tar"
    shard.write_bytes(bytes(data))
    keys = []
    with pytest.raises(ShardError, match=rf"bad\.tar at byte {third}: .*checksum") as info:
        for s in iter_shard(str(shard)):
            keys.append(s["__key__"])
    assert info.value.offset == third
    assert keys == ["k0"]  # k1 lost its second member: never yielded as a partial sample


@pytest.mark.parametrize("cut", ["mid-data", "mid-header", "no-end-marker"])
def test_truncated_shard_raises_with_offset(tmp_path, cut):
    data = _good_shard(tmp_path)
    offsets = _header_offsets(data)
    at = {"mid-data": offsets[4] + 512 + 100, "mid-header": offsets[4] + 200,
          "no-end-marker": offsets[4]}[cut]
    shard = tmp_path / "cut.tar"
    shard.write_bytes(data[:at])
    keys = []
    with pytest.raises(TruncatedShardError, match=r"cut\.tar at byte \d+") as info:
        for s in iter_shard(str(shard)):
            keys.append(s["__key__"])
    assert keys == ["k0"]  # k2's bin member may be complete, but the sample is not
    assert info.value.offset is not None and info.value.offset <= at


def test_empty_and_missing_shards_raise(tmp_path):
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(ShardError, match="empty"):
        list(iter_shard(str(tmp_path / "empty.tar")))
    with pytest.raises(ShardError, match="no such file"):
        list(iter_shard(str(tmp_path / "missing.tar")))


def test_archive_with_only_end_marker_has_no_samples(tmp_path):
    (tmp_path / "zero.tar").write_bytes(bytes(10240))
    assert list(iter_shard(str(tmp_path / "zero.tar"))) == []


@pytest.mark.parametrize("mode", ["skip", "warn"])
def test_on_error_skips_bad_shards_and_counts_them(tmp_path, mode):
    good = _good_shard(tmp_path, n=4)
    (tmp_path / "s-0.tar").write_bytes(good)
    (tmp_path / "s-1.tar").write_bytes(good[: len(good) // 2])
    (tmp_path / "s-2.tar").write_bytes(b"")
    (tmp_path / "s-3.tar").write_bytes(good)
    ds = ShardDataset(str(tmp_path / "s-{0..4}.tar"), shuffle_shards=False, on_error=mode)
    if mode == "warn":
        with pytest.warns(UserWarning, match="s-1.tar"):
            keys = [s["__key__"] for s in ds]
    else:
        keys = [s["__key__"] for s in ds]
    # two full shards; the truncated one yields only its complete leading samples
    assert keys.count("k0") == 3 and keys.count("k3") == 2
    assert ds.error_count == 3  # truncated, empty, missing


def test_gzip_truncation_is_reported(tmp_path):
    blob = gzip.compress(_good_shard(tmp_path))
    shard = tmp_path / "cut.tar.gz"
    shard.write_bytes(blob[: len(blob) - 40])
    with pytest.raises(ShardError, match=r"cut\.tar\.gz"):
        list(iter_shard(str(shard)))
