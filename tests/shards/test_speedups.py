"""The compiled tar scanner and grouper (``ember.shards._speedups``) against their pure-Python
twins: the same members, samples, errors and offsets on valid, unusual, corrupt and truncated
archives, through memory maps and through small stream windows."""

from __future__ import annotations

import io
import random
import shutil
import sys
import tarfile

import pytest

from ember.shards import format as fmt
from ember.shards import tar
from ember.shards.errors import FormatError, ShardError
from ember.shards.tar import iter_members, memory_source, open_tar_source, scan_members

compiled = pytest.mark.skipif(tar._scan is None, reason="ember.shards._speedups is not built")


@pytest.mark.skipif(sys.platform != "linux" or shutil.which("cc") is None,
                    reason="the extension is built where a C compiler is (checked on Linux)")
def test_speedups_are_built_where_a_compiler_is():
    # an optional extension that fails to build installs silently: this is where it shows
    assert tar._scan is not None
    assert fmt._compiled_group_samples is not None


def _add(tf: tarfile.TarFile, name: str, data: bytes, **kw) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in kw.items():
        setattr(info, k, v)
    tf.addfile(info, io.BytesIO(data))


def _checksum(block: bytearray, signed: bool = False) -> int:
    body = block[:148] + b" " * 8 + block[156:512]
    return sum((x - 256 if x > 127 else x) if signed else x for x in body)


def _respell(block: bytearray, *, size: bytes | None = None, chk_spelling: str = "{:06o}\0 ",
             signed: bool = False) -> None:
    """Rewrite a header's size field and re-store its checksum in another valid spelling."""
    if size is not None:
        block[124:136] = size
    block[148:156] = chk_spelling.format(_checksum(block, signed)).encode("latin-1")[:8].ljust(8, b"\0")


def _base256(n: int) -> bytes:
    return bytes([0x80]) + n.to_bytes(11, "big")


def _unusual_archive() -> bytes:
    """Members in every spelling a reader meets: GNU and PAX long names, a global PAX header,
    USTAR prefix names, directories and links, base-256 and space-padded sizes, checksums
    spelled with leading spaces or summed over signed bytes, and empty members."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tf:
        _add(tf, "a.jpg", b"A" * 700)
        _add(tf, "a.cls", b"1")
        _add(tf, "d/" + "n" * 120 + ".txt", b"gnu long name")
        d = tarfile.TarInfo("somedir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        link = tarfile.TarInfo("lnk.txt")
        link.type = tarfile.SYMTYPE
        link.linkname = "t" * 150
        tf.addfile(link)
        _add(tf, "b.empty", b"")
        _add(tf, "b.bin", bytes(range(256)) * 5)
    gnu = bytearray(out.getvalue().rstrip(b"\0"))
    gnu += bytes(-len(gnu) % 512)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT,
                      pax_headers={"comment": "global"}) as tf:
        _add(tf, "p/" + "q" * 130 + ".json", b'{"pax": 1}')
        _add(tf, "c.txt", "ü".encode() * 40)
        _add(tf, "c.cls", b"2")
    pax = bytearray(out.getvalue().rstrip(b"\0"))
    pax += bytes(-len(pax) % 512)
    out = io.BytesIO()
    # latin-1 names: bytes that are not UTF-8 (read back with surrogate escapes)
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT, encoding="latin-1") as tf:
        _add(tf, "u" * 60 + "/" + "v" * 70 + ".png", b"prefix name")
        for i, (size, spelling, signed) in enumerate([
            (b"%011o\0" % 3, "{:06o}\0 ", False),
            (b"     3      ", "  {:06o}\0", False),
            (_base256(3), "{:07o}\0", False),
            (None, "{:06o}\0 ", True),
        ]):
            start = len(out.getvalue())
            _add(tf, f"e{i}.dat" if not signed else "\xe9\xe8.dat", b"xyz")
            raw = bytearray(out.getvalue())
            block = raw[start : start + 512]
            _respell(block, size=size, chk_spelling=spelling, signed=signed)
            out.seek(start)
            out.write(bytes(block))
            out.seek(0, io.SEEK_END)
        _add(tf, "f.txt", b"last")
    return bytes(gnu + pax) + out.getvalue()


def _outcome(run) -> list:
    """What ``run()`` yields, then the error it raised (type, message, offset), if any."""
    got = []
    try:
        for item in run():
            got.append(item)
    except (ShardError, ValueError) as exc:
        got.append(("raised", type(exc).__name__, str(exc), getattr(exc, "offset", None)))
    return got


def _readers(data: bytes):
    """(name, run) pairs reading ``data``: members, spans and samples, from memory and from a
    stream (read in windows of tar._CHUNK bytes)."""
    def stream():
        return open_tar_source(io.BufferedReader(io.BytesIO(data), 97), "x.tar")

    return [
        ("members", lambda: iter_members(memory_source(data, "x.tar"), "x.tar")),
        ("spans", lambda: scan_members(memory_source(data, "x.tar"), "x.tar")),
        ("stream members", lambda: iter_members(stream(), "x.tar")),
        ("samples", lambda: fmt.group_samples(iter_members(stream(), "x.tar"), "x.tar")),
    ]


def _both(monkeypatch, use_implementation, data: bytes, chunk: int) -> None:
    monkeypatch.setattr(tar, "_CHUNK", chunk)
    for name, run in _readers(data):
        results = {}
        for which in ("compiled", "python"):
            with monkeypatch.context() as m:
                use_implementation(m, which)
                results[which] = _outcome(run)
        assert results["compiled"] == results["python"], name


@compiled
def test_unusual_archive_reads_alike_and_completely(monkeypatch, switch_implementation):
    data = _unusual_archive()
    names = [m[0] for m in iter_members(memory_source(data, "x.tar"), "x.tar")]
    # the reference reader sees every spelling (so the comparisons below cover them)
    assert names == ["a.jpg", "a.cls", "d/" + "n" * 120 + ".txt", "b.empty", "b.bin",
                     "p/" + "q" * 130 + ".json", "c.txt", "c.cls",
                     "u" * 60 + "/" + "v" * 70 + ".png", "e0.dat", "e1.dat", "e2.dat",
                     "\udce9\udce8.dat", "f.txt"]
    for chunk in (512, 1536, 1 << 20):
        _both(monkeypatch, switch_implementation, data, chunk)


@compiled
@pytest.mark.parametrize("seed", range(60))
def test_corrupt_and_truncated_archives_read_alike(monkeypatch, switch_implementation, seed):
    rng = random.Random(seed)
    data = bytearray(_unusual_archive())
    for _ in range(rng.randint(1, 3)):
        # headers are where the two parsers differ, so aim half of the damage at them
        at = rng.randrange(0, len(data), 512) + rng.choice([0, 100, 124, 130, 148, 156, 345])
        at = at if rng.random() < 0.5 else rng.randrange(len(data))
        data[min(at, len(data) - 1)] ^= 1 << rng.randrange(8)
    if rng.random() < 0.5:
        data = data[: rng.randrange(len(data))]
    _both(monkeypatch, switch_implementation, bytes(data), rng.choice([512, 2048, 1 << 20]))


_NAMES = ["a.jpg", "a.JPG", "a.cls", "b.jpg", "b.Seg.PNG", "dir/a.jpg", "__meta__", "d/__x.y__",
          "nodot", "a.__key__", "a.__URL__", "x/.hidden", "_a.b", "__a.b", "a.b__", ".jpg",
          "ü.jpg", "a/b.c/d.e", "a.jpg"]


@compiled
@pytest.mark.parametrize("seed", range(40))
def test_grouping_alike_on_random_member_sequences(monkeypatch, switch_implementation, seed):
    rng = random.Random(seed)
    names = [rng.choice(_NAMES) for _ in range(rng.randint(0, 12))]
    fail = rng.random() < 0.3

    def members():
        for i, n in enumerate(names):
            yield n, n.encode(), i * 512
        if fail:
            raise ShardError("cut", "u.tar", 99)

    results = {}
    for which in ("compiled", "python"):
        with monkeypatch.context() as m:
            switch_implementation(m, which)
            results[which] = _outcome(lambda: fmt.group_samples(members(), "u.tar"))
    assert results["compiled"] == results["python"]


@pytest.mark.usefixtures("implementation")
def test_grouping_is_finished_after_an_error():
    members = iter([("a.jpg", b"1", 0), ("a.JPG", b"2", 512), ("b.jpg", b"3", 1024)])
    samples = fmt.group_samples(members, "u.tar")
    with pytest.raises(FormatError, match="duplicate"):
        next(samples)
    assert next(samples, None) is None  # nothing after the error, as from a generator


@compiled
def test_scan_stops_where_the_python_parser_must_take_over():
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        _add(tf, "a.bin", b"1" * 600)  # header at 0, data padded to 1024
        _add(tf, "a.cls", b"7")  # header at 1536
        _add(tf, "b/" + "x" * 120 + ".bin", b"2")  # a PAX record at 2560 first
    data = out.getvalue()
    members, pos = tar._scan(data, 0, len(data), 1000, True, 64, 1 << 20)
    assert members == [("a.bin", b"1" * 600, 1000), ("a.cls", b"7", 2536)]
    assert pos == 2560  # the PAX record: left to tar.py
    assert tar._scan(data, 2560, len(data), 0, True, 64, 1 << 20) == ([], 2560)
    # spans instead of data; the member count and byte budget end a call early
    assert tar._scan(data, 0, len(data), 0, False, 64, 1 << 20)[0] == [("a.bin", 0, 1536),
                                                                      ("a.cls", 1536, 2560)]
    assert tar._scan(data, 0, len(data), 0, True, 1, 1 << 20)[1] == 1536
    assert tar._scan(data, 0, len(data), 0, True, 64, 600)[1] == 1536
    # a member whose padded data runs past the window is left for the window to be refilled
    assert tar._scan(data, 0, 1535, 0, True, 64, 1 << 20) == ([], 0)
    with pytest.raises(ValueError, match="outside a buffer"):
        tar._scan(data, 0, len(data) + 1, 0, True, 64, 1 << 20)
