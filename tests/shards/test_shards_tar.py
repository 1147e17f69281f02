"""Reading shards written by GNU tar and Python's tarfile; corrupt, truncated and empty shards."""

from __future__ import annotations

import gzip
import io
import os
import random
import re
import shutil
import subprocess
import tarfile
import zlib

import pytest

from ember.shards import ShardDataset, ShardError, TruncatedShardError, iter_shard
from ember.shards.format import group_samples
from ember.shards.tar import iter_members, memory_source, open_tar_source, scan_members

# every test here runs with the compiled scanner and grouper and with the pure-Python ones
pytestmark = pytest.mark.usefixtures("implementation")

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
    subprocess.run(
        ["tar", f"--format={fmt}", "--no-recursion", "-cf", str(shard), "-C", str(src), *members], check=True
    )
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


# _good_shard's layout: a sample is k<i>.bin (header + 3000 bytes padded to 3072) then k<i>.cls
# (header + 1 byte padded to 512), so sample i starts at i * _SAMPLE.
_SAMPLE = 512 + 3072 + 512 + 512
_CLS = 512 + 3072  # offset of the .cls header inside a sample
# where the shard is cut -> (samples yielded before the error, whether an error follows)
_CUTS = {
    # the header of k2.bin is incomplete: nothing says k1 had no further member
    "mid-header": (2 * _SAMPLE + 200, 1, True),
    # k2.bin's header is intact and names a new key, so k1 is complete; k2 is not
    "mid-payload": (2 * _SAMPLE + 512 + 100, 2, True),
    "mid-padding": (2 * _SAMPLE + 512 + 3000 + 10, 2, True),
    "no-data-after-header": (2 * _SAMPLE + 512, 2, True),
    "mid-second-header": (2 * _SAMPLE + _CLS + 200, 2, True),
    "mid-second-payload": (2 * _SAMPLE + _CLS + 512, 2, True),
    # a cut at a member boundary looks like a complete archive without end-of-archive blocks;
    # the sample in progress may have lost members, so it is not yielded
    "after-first-member": (2 * _SAMPLE + _CLS, 2, True),
    "after-sample": (3 * _SAMPLE, 2, True),
    "after-last-sample": (5 * _SAMPLE, 4, True),
    # inside the end-of-archive blocks every member is complete: no error
    "inside-end-marker": (5 * _SAMPLE + 100, 5, False),
    "after-one-zero-block": (5 * _SAMPLE + 512, 5, False),
}


class _Trickle(io.RawIOBase):
    """A non-seekable stream that returns at most ``step`` bytes per read (like a slow pipe)."""

    def __init__(self, data: bytes, step: int = 700):
        self._data = memoryview(data)
        self._pos = 0
        self._step = step

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self._step, len(self._data) - self._pos)
        b[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


def _truncated_gzip(data: bytes) -> bytes:
    """A gzip stream of ``data`` cut right after it: no end-of-stream marker, no trailer."""
    z = zlib.compressobj(6, zlib.DEFLATED, 31)
    return z.compress(data) + z.flush(zlib.Z_SYNC_FLUSH)


def _read_samples(tmp_path, data: bytes, source: str):
    """(samples, error) of reading ``data`` as a local file, a gzip file or a trickling stream."""
    samples = []
    try:
        if source == "stream":
            url = "cut.tar"
            src = open_tar_source(_Trickle(data), url)
            try:
                samples.extend(group_samples(iter_members(src, url), url))
            finally:
                src.close()
        else:
            shard = tmp_path / ("cut.tar.gz" if source == "gzip" else "cut.tar")
            shard.write_bytes(_truncated_gzip(data) if source == "gzip" else data)
            samples.extend(iter_shard(str(shard)))
    except ShardError as exc:
        return samples, exc
    return samples, None


@pytest.mark.parametrize("source", ["file", "gzip", "stream"])
@pytest.mark.parametrize("cut", list(_CUTS))
def test_truncated_shard_yields_exactly_the_complete_samples(tmp_path, cut, source):
    data = _good_shard(tmp_path)
    assert _header_offsets(data)[4] == 2 * _SAMPLE  # the layout _CUTS assumes
    at, complete, fails = _CUTS[cut]
    samples, err = _read_samples(tmp_path, data[:at], source)
    assert [s["__key__"] for s in samples] == [f"k{i}" for i in range(complete)]
    for i, s in enumerate(samples):  # never a partial sample
        assert s["bin"] == bytes([i]) * 3000 and s["cls"] == str(i).encode()
    if not fails and source != "gzip":
        assert err is None
        return
    # a gzip stream without its trailer is cut short even where the tar in it ends cleanly
    assert isinstance(err, TruncatedShardError)
    assert err.offset == at  # where the bytes ran out, in the uncompressed tar stream
    if fails:
        assert re.search(rf"cut\.tar(\.gz)? at byte {at}: archive ends", str(err))
    if source == "gzip":
        assert "gzip stream ends before its" in str(err)


def test_truncation_messages_say_where_the_cut_fell(tmp_path):
    data = _good_shard(tmp_path)
    header = 2 * _SAMPLE
    expected = {
        "mid-header": f"200 bytes into the header block at byte {header}",
        "mid-payload": f"inside the data of member 'k2.bin' (header at byte {header})",
        "mid-padding": f"inside the padding after member 'k2.bin' (header at byte {header})",
        "after-sample": "without its end-of-archive blocks, right after a complete member",
    }
    for cut, text in expected.items():
        for source in ("file", "stream"):
            _, err = _read_samples(tmp_path, data[: _CUTS[cut][0]], source)
            assert text in str(err), (cut, source)


@pytest.mark.parametrize("mode", ["skip", "warn"])
def test_truncated_shard_is_skipped_after_its_complete_samples(tmp_path, mode):
    data = _good_shard(tmp_path)
    (tmp_path / "s-0.tar").write_bytes(data)
    (tmp_path / "s-1.tar").write_bytes(data[: _CUTS["mid-payload"][0]])
    (tmp_path / "s-2.tar.gz").write_bytes(_truncated_gzip(data[: _CUTS["mid-padding"][0]]))
    (tmp_path / "s-3.tar").write_bytes(data)
    urls = [str(tmp_path / n) for n in ("s-0.tar", "s-1.tar", "s-2.tar.gz", "s-3.tar")]
    ds = ShardDataset(urls, shuffle_shards=False, on_error=mode)
    if mode == "warn":
        with pytest.warns(UserWarning, match=r"s-1\.tar at byte 9828: archive ends"):
            keys = [s["__key__"] for s in ds]
    else:
        keys = [s["__key__"] for s in ds]
    five, two = [f"k{i}" for i in range(5)], ["k0", "k1"]
    assert keys == five + two + two + five
    assert ds.error_count == 2


def test_cut_right_after_a_long_name_record(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name in ("a.txt", "x" * 150 + ".txt"):
            info = tarfile.TarInfo(name)
            info.size = 5
            tf.addfile(info, io.BytesIO(b"hello"))
    data = buf.getvalue()
    long_at = _header_offsets(data)[1]  # where the long-name record starts
    cut = long_at + 512 + 512  # after its header and the one block holding the name
    samples, err = _read_samples(tmp_path, data[:cut], "file")
    # the record may name a link or directory, after which sample "a" could go on: not yielded
    assert samples == []
    assert isinstance(err, TruncatedShardError) and err.offset == cut
    assert "right after a long-name or PAX record" in str(err)


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


def _random_shard(seed: int, n: int = 40) -> tuple[bytes, dict]:
    """A tarfile-written shard whose member sizes vary from 0 to a few windows."""
    rng = random.Random(seed)
    files = {}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(n):
            key = f"s{i:03d}" if i % 7 else "p/" + "q" * 120 + f"{i}"  # some PAX long names
            fields = {
                ext: rng.randbytes(rng.choice([0, 1, 511, 512, 513, 3000, 9000])) for ext in ("a", "b.c")
            }
            files[key] = fields
            for ext in sorted(fields):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(fields[ext])
                tf.addfile(info, io.BytesIO(fields[ext]))
    return buf.getvalue(), files


@pytest.mark.parametrize("step", [1, 97, 512, 4096, 1 << 20])
def test_stream_reads_members_across_window_boundaries(monkeypatch, step):
    import ember.shards.tar as tar

    monkeypatch.setattr(tar, "_CHUNK", 1500)  # windows far smaller than most members
    data, files = _random_shard(step)
    src = open_tar_source(_Trickle(data, step), "s.tar")
    assert _as_dicts(group_samples(iter_members(src, "s.tar"), "s.tar")) == files
    gz = open_tar_source(_Trickle(gzip.compress(data), step), "s.tar.gz")
    assert _as_dicts(group_samples(iter_members(gz, "s.tar.gz"), "s.tar.gz")) == files


def test_member_larger_than_a_window_through_a_pipe(tmp_path):
    big = os.urandom(3 * (1 << 20) + 123)  # spans several 1 MiB windows
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, payload in [("x.bin", big), ("x.cls", b"7"), ("y.bin", big[::-1])]:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tf.addfile(info, io.BytesIO(payload))
    shard = tmp_path / "big.tar"
    shard.write_bytes(buf.getvalue())
    for url in (str(shard), f"pipe:cat {shard}"):
        got = list(ShardDataset(url, allow_pipe=True))
        assert [s["__key__"] for s in got] == ["x", "y"]
        assert got[0]["bin"] == big and got[0]["cls"] == b"7" and got[1]["bin"] == big[::-1]


def test_header_field_caches_are_bounded_and_stay_correct(monkeypatch):
    import ember.shards.tar as tar

    monkeypatch.setattr(tar, "_CACHE", 3)
    data, files = _random_shard(5)
    assert _as_dicts(group_samples(iter_members(tar.memory_source(data, "m.tar"), "m.tar"), "m.tar")) == files


def test_gzip_members_concatenated_and_zero_padded(tmp_path):
    data = _good_shard(tmp_path)
    half = 2 * _SAMPLE
    shard = tmp_path / "multi.tar.gz"
    # two gzip members back to back, then zero padding, as some tools write
    shard.write_bytes(gzip.compress(data[:half]) + gzip.compress(data[half:]) + bytes(1000))
    assert [s["__key__"] for s in iter_shard(str(shard))] == [f"k{i}" for i in range(5)]


def test_corrupt_gzip_names_the_shard(tmp_path):
    blob = bytearray(gzip.compress(_good_shard(tmp_path, size=30000)))
    blob[len(blob) // 2] ^= 0xFF
    shard = tmp_path / "bad.tar.gz"
    shard.write_bytes(bytes(blob))
    with pytest.raises(ShardError, match=r"bad\.tar\.gz at byte \d+: .*gzip stream is corrupt"):
        list(iter_shard(str(shard)))
    # what follows a gzip member must be another one (or zero padding)
    data = _good_shard(tmp_path)
    shard.write_bytes(gzip.compress(data[: 2 * _SAMPLE]) + b"not gzip" + gzip.compress(data))
    with pytest.raises(ShardError, match=rf"at byte {2 * _SAMPLE}: gzip stream is corrupt"):
        list(iter_shard(str(shard)))


def test_signed_checksums_of_old_writers_are_accepted(tmp_path):
    name = "caf\u00e9.txt".encode()  # a byte above 127 makes signed and unsigned sums differ
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        info = tarfile.TarInfo(name.decode())
        info.size = 2
        tf.addfile(info, io.BytesIO(b"ok"))
    data = bytearray(buf.getvalue())
    header = data[:512]
    header[148:156] = b" " * 8
    signed = sum(x - 256 if x > 127 else x for x in header)
    data[148:156] = b"%06o\x00 " % signed
    shard = tmp_path / "signed.tar"
    shard.write_bytes(bytes(data))
    assert [(s["__key__"], s["txt"]) for s in iter_shard(str(shard))] == [("caf\u00e9", b"ok")]


def test_lone_zero_block_before_more_members_is_an_error(tmp_path):
    data = _good_shard(tmp_path)
    at = 2 * _SAMPLE
    shard = tmp_path / "zero.tar"
    shard.write_bytes(data[:at] + bytes(512) + data[at:])
    with pytest.raises(ShardError, match=rf"zero\.tar at byte {at + 512}: lone zero block"):
        list(iter_shard(str(shard)))


def test_member_cut_after_its_header_comes_last_without_data(tmp_path):
    data = _good_shard(tmp_path)[: _CUTS["mid-payload"][0]]
    src = memory_source(data, "m.tar")
    got = []
    with pytest.raises(TruncatedShardError):
        for name, payload, offset in iter_members(src, "m.tar"):
            got.append((name, payload is None, offset))
    # the four complete members, then k2.bin with no data: it shows k1 ended
    assert got == [
        ("k0.bin", False, 0),
        ("k0.cls", False, _CLS),
        ("k1.bin", False, _SAMPLE),
        ("k1.cls", False, _SAMPLE + _CLS),
        ("k2.bin", True, 2 * _SAMPLE),
    ]
    spans = []
    with pytest.raises(TruncatedShardError):
        spans.extend(scan_members(memory_source(data, "m.tar"), "m.tar"))
    assert spans[-1] == ("k2.bin", 2 * _SAMPLE, None)
    assert spans[-2] == ("k1.cls", _SAMPLE + _CLS, 2 * _SAMPLE)


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_link_members_come_with_their_targets_when_asked(fmt):
    from ember.shards.tar import Link, iter_members, memory_source

    long = "d" * 60 + "/" if fmt != tarfile.USTAR_FORMAT else ""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        info = tarfile.TarInfo(long + "a" * 90 + ".txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
        for kind, name in [(tarfile.LNKTYPE, "h.txt"), (tarfile.SYMTYPE, "s.txt")]:
            link = tarfile.TarInfo(long + name)
            link.type, link.linkname = kind, info.name
            tar.addfile(link)
        tail = tarfile.TarInfo("z.txt")
        tail.size = 1
        tar.addfile(tail, io.BytesIO(b"z"))
    data = buf.getvalue()
    got = [(n, d) for n, d, _ in iter_members(memory_source(data, "t.tar"), "t.tar", links=True)]
    assert got == [(info.name, b"abc"), (long + "h.txt", Link(info.name, True)),
                   (long + "s.txt", Link(info.name, False)), ("z.txt", b"z")]
    plain = [(n, d) for n, d, _ in iter_members(memory_source(data, "t.tar"), "t.tar")]
    assert plain == [(info.name, b"abc"), ("z.txt", b"z")]
