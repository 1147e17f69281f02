"""ShardWriter / TarWriter: round trips for every encoder, interoperability, shard splitting."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import tarfile
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from ember.shards import Decoder, ShardDataset, ShardWriter, TarWriter, iter_shard


def _roundtrip(tmp_path, sample, *handlers, allow_pickle=False):
    path = tmp_path / "rt.tar"
    with TarWriter(str(path)) as w:
        w.write(sample)
    raw = list(iter_shard(str(path)))
    assert len(raw) == 1 and raw[0]["__key__"] == sample["__key__"]
    return Decoder(*handlers, allow_pickle=allow_pickle)(raw[0]), raw[0]


def test_scalar_text_and_structured_encoders(tmp_path):
    obj = {"a": [1, 2.5, None, "x"], "b": {"c": True}}
    sample = {"__key__": "k0", "cls": 7, "cls2": 3, "index": 12, "inx": 5, "id": 99,
              "txt": "héllo wörld", "text": "two\nlines", "transcript": "t",
              "json": obj, "jsn": [1, 2], "a.json": json.dumps([3]), "mp": {"m": [1, 2, 3]}, "msg": "hi",
              "bin": b"\x00\x01raw"}
    dec, raw = _roundtrip(tmp_path, sample)
    assert raw["cls"] == b"7" and raw["txt"] == "héllo wörld".encode()
    assert raw["json"] == json.dumps(obj).encode()
    assert (dec["cls"], dec["cls2"], dec["index"], dec["inx"], dec["id"]) == (7, 3, 12, 5, 99)
    assert dec["txt"] == "héllo wörld" and dec["text"] == "two\nlines" and dec["transcript"] == "t"
    assert dec["json"] == obj and dec["jsn"] == [1, 2]
    assert raw["a.json"] == b"[3]" and dec["a.json"] == [3]  # a str is stored as its text
    assert dec["mp"] == {"m": [1, 2, 3]} and dec["msg"] == "hi"
    assert dec["bin"] == b"\x00\x01raw"


def test_numpy_and_torch_encoders(tmp_path):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    t = {"w": torch.arange(6).reshape(2, 3), "s": 3}
    sample = {"__key__": "arr", "npy": a, "npz": {"x": a, "y": np.array([1, 2], dtype=np.int16)},
              "pth": t}
    dec, raw = _roundtrip(tmp_path, sample)
    assert raw["npy"][:6] == b"\x93NUMPY"
    np.testing.assert_array_equal(dec["npy"], a)
    assert dec["npy"].dtype == np.float32
    np.testing.assert_array_equal(dec["npz"]["x"], a)
    assert dec["npz"]["y"].dtype == np.int16
    assert torch.equal(dec["pth"]["w"], torch.arange(6).reshape(2, 3)) and dec["pth"]["s"] == 3


def test_pickle_encoder_needs_opt_in_to_decode(tmp_path):
    import pickle

    sample = {"__key__": "p", "pyd": {"z": (1, 2)}, "pkl": [3]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dec, raw = _roundtrip(tmp_path, sample)
    assert dec["pyd"] == pickle.dumps({"z": (1, 2)})  # left as bytes
    dec, _ = _roundtrip(tmp_path, sample, allow_pickle=True)
    assert dec["pyd"] == {"z": (1, 2)} and dec["pkl"] == [3]


def test_gzip_member_encoder(tmp_path):
    sample = {"__key__": "g", "txt.gz": "compressed " * 50, "json.gz": {"a": 1}}
    dec, raw = _roundtrip(tmp_path, sample)
    assert raw["txt.gz"][:2] == b"\x1f\x8b"
    assert gzip.decompress(raw["txt.gz"]) == ("compressed " * 50).encode()
    assert dec["txt.gz"] == "compressed " * 50 and dec["json.gz"] == {"a": 1}


@pytest.mark.parametrize("ext", ["png", "ppm", "bmp", "tiff", "webp"])
def test_lossless_image_encoders(tmp_path, ext):
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    if ext == "webp":
        pil = Image.fromarray(img)
        buf = io.BytesIO()
        pil.save(buf, format="WEBP", lossless=True)
        sample = {"__key__": "im", ext: buf.getvalue()}
    else:
        sample = {"__key__": "im", ext: img}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "array is not writable" warning from decoding
        dec, _ = _roundtrip(tmp_path, sample, "rgb8")
        np.testing.assert_array_equal(dec[ext], img)
        dec, _ = _roundtrip(tmp_path, sample, "torchrgb8")
        assert dec[ext].shape == (3, 5, 7) and dec[ext].dtype == torch.uint8
        assert torch.equal(dec[ext], torch.from_numpy(img.copy()).permute(2, 0, 1))
        dec, _ = _roundtrip(tmp_path, sample, "torchl8")
        assert dec[ext].shape == (5, 7)  # (H, W), as webdataset gives it
        dec, _ = _roundtrip(tmp_path, sample, "torchrgb")
        assert dec[ext].dtype == torch.float32
        torch.testing.assert_close(dec[ext] * 255.0,
                                   torch.from_numpy(img.astype(np.float32)).permute(2, 0, 1))


def test_image_encoder_inputs_tensor_float_and_pil(tmp_path):
    img = np.zeros((4, 6, 3), dtype=np.uint8)
    img[:, :3] = 255
    chw = torch.from_numpy(img).permute(2, 0, 1).float() / 255.0
    sample = {"__key__": "i", "png": chw, "seg.png": Image.fromarray(img[:, :, 0]),
              "jpg": img, "pgm": img[:, :, :1]}
    dec, _ = _roundtrip(tmp_path, sample, "rgb8")
    np.testing.assert_array_equal(dec["png"], img)
    np.testing.assert_array_equal(dec["seg.png"], img)  # grey converted to RGB
    assert dec["jpg"].shape == (4, 6, 3)
    assert np.abs(dec["jpg"].astype(int) - img.astype(int)).max() <= 16  # lossy
    dec, _ = _roundtrip(tmp_path, sample, "pil")
    assert dec["pgm"].mode == "RGB" and dec["pgm"].size == (6, 4)  # "pil" is RGB, as in webdataset
    dec, _ = _roundtrip(tmp_path, sample, "pill")
    assert dec["pgm"].mode == "L" and dec["pgm"].size == (6, 4)


def test_encoder_rejects_unknown_types(tmp_path):
    with TarWriter(str(tmp_path / "x.tar")) as w, pytest.raises(TypeError, match="no encoder"):
        w.write({"__key__": "a", "weird": object()})


def _write_mixed(path, n=20, compress=None):
    long_key = "deep/" + "d" * 120 + "/sample"
    with TarWriter(str(path), compress=compress) as w:
        for i in range(n):
            key = long_key + str(i) if i % 5 == 0 else f"dir/s{i:04d}"
            w.write({"__key__": key, "cls": i, "txt": f"text {i}", "seg.png": b"P" * i})
    return long_key


def test_output_readable_by_gnu_tar(tmp_path):
    if shutil.which("tar") is None:
        pytest.skip("no tar program")
    path = tmp_path / "g.tar"
    long_key = _write_mixed(path)
    out = subprocess.run(["tar", "-tf", str(path)], capture_output=True, text=True, check=True,
                         timeout=30)
    names = out.stdout.splitlines()
    assert len(names) == 60
    assert names[:3] == [f"{long_key}0.cls", f"{long_key}0.seg.png", f"{long_key}0.txt"]
    assert names[3:6] == ["dir/s0001.cls", "dir/s0001.seg.png", "dir/s0001.txt"]
    dest = tmp_path / "x"
    dest.mkdir()
    subprocess.run(["tar", "-xf", str(path), "-C", str(dest)], check=True, timeout=30)
    assert (dest / "dir" / "s0003.txt").read_text() == "text 3"
    assert (dest / (long_key + "10.cls")).read_text() == "10"


@pytest.mark.parametrize("compress", [False, True])
def test_output_readable_by_tarfile(tmp_path, compress):
    path = tmp_path / ("p.tar.gz" if compress else "p.tar")
    long_key = _write_mixed(path, compress=compress)
    with tarfile.open(path) as tf:
        members = tf.getmembers()
        assert all(m.isreg() for m in members)
        names = [m.name for m in members]
        assert f"{long_key}15.txt" in names
        assert tf.extractfile(f"{long_key}15.txt").read() == b"text 15"
        assert tf.extractfile("dir/s0007.seg.png").read() == b"P" * 7
    assert len(names) == 60


def test_output_readable_by_webdataset(tmp_path):
    wds = pytest.importorskip("webdataset")
    path = tmp_path / "w.tar"
    long_key = _write_mixed(path)
    got = list(wds.WebDataset(str(path), shardshuffle=False))
    assert len(got) == 20
    assert got[0]["__key__"] == long_key + "0"
    assert got[1]["__key__"] == "dir/s0001"
    assert got[1]["cls"] == b"1" and got[1]["txt"] == b"text 1" and got[1]["seg.png"] == b"P"


def test_webdataset_decodes_encoded_values(tmp_path):
    wds = pytest.importorskip("webdataset")
    with ShardWriter(str(tmp_path / "w-%02d.tar"), maxcount=3) as w:
        for i in range(7):
            w.write({"__key__": f"dir/{'n' * 120}{i}", "txt": f"t{i}", "cls": i,
                     "json": {"i": i}, "npy": np.arange(i, dtype=np.int32),
                     "png": np.full((4, 5, 3), i, dtype=np.uint8)})
    assert len(w.shards) == 3
    got = list(wds.WebDataset(str(tmp_path / "w-{00..02}.tar"), shardshuffle=False).decode("rgb8"))
    assert [s["__key__"] for s in got] == [f"dir/{'n' * 120}{i}" for i in range(7)]
    for i, s in enumerate(got):
        assert int(s["cls"]) == i and s["txt"] == f"t{i}" and s["json"] == {"i": i}
        assert (s["npy"] == np.arange(i)).all() and s["png"].shape == (4, 5, 3)
        assert (s["png"] == i).all()


def test_reads_shards_written_by_webdataset(tmp_path):
    wds = pytest.importorskip("webdataset")
    pattern = str(tmp_path / "w-%02d.tar")
    with wds.ShardWriter(pattern, maxcount=7, verbose=0) as w:
        for i in range(20):
            w.write({"__key__": f"k{i:03d}", "cls": i, "json": {"i": i}})
    urls = [str(tmp_path / f"w-{i:02d}.tar") for i in range(3)]
    assert all(os.path.exists(u) for u in urls)
    ds = ShardDataset(urls, shuffle_shards=False).decode()
    got = list(ds)
    assert [s["__key__"] for s in got] == [f"k{i:03d}" for i in range(20)]
    assert [s["cls"] for s in got] == list(range(20))
    assert [s["json"]["i"] for s in got] == list(range(20))


def test_maxcount_splitting(tmp_path):
    with ShardWriter(str(tmp_path / "c-%03d.tar"), maxcount=4) as w:
        for i in range(10):
            w.write({"__key__": f"k{i}", "txt": str(i)})
    assert w.shards == [str(tmp_path / f"c-{i:03d}.tar") for i in range(3)]
    counts = [len(list(iter_shard(s))) for s in w.shards]
    assert counts == [4, 4, 2] and w.total == 10
    assert not list(tmp_path.glob("*.writing"))


def test_maxsize_splitting(tmp_path):
    payload = b"x" * 3000  # 512 header + 3072 data per member
    maxsize = 20_000
    with ShardWriter(str(tmp_path / "m-{:02d}.tar"), maxcount=1000, maxsize=maxsize) as w:
        for i in range(12):
            w.write({"__key__": f"k{i:02d}", "bin": payload})
    sizes = [os.path.getsize(s) for s in w.shards]
    assert len(w.shards) > 1
    assert all(s <= maxsize for s in sizes)
    keys = [s["__key__"] for u in w.shards for s in iter_shard(u)]
    assert keys == [f"k{i:02d}" for i in range(12)]
    # every shard but the last was full: one more sample (3584 bytes) would have passed maxsize
    assert all(s + 3584 > maxsize - 1024 for s in sizes[:-1])


def test_oversized_single_sample_still_written(tmp_path):
    with ShardWriter(str(tmp_path / "o-%d.tar"), maxsize=1000) as w:
        w.write({"__key__": "big", "bin": b"y" * 5000})
        w.write({"__key__": "big2", "bin": b"z" * 5000})
    assert len(w.shards) == 2
    assert next(iter_shard(w.shards[1]))["bin"] == b"z" * 5000


def test_writer_index_files_match_scan(tmp_path):
    from ember.shards.index import build_index, read_sample

    with ShardWriter(str(tmp_path / "i-%02d.tar"), maxcount=5, index=True) as w:
        for i in range(8):
            w.write({"__key__": f"k{i}", "txt": "v" * i, "cls": i})
    for s in w.shards:
        with open(s + ".idx") as f:
            written = json.load(f)
        scanned = build_index(s)
        assert written["samples"] == scanned["samples"]
        assert written["size"] == os.path.getsize(s)
        key, start, end = written["samples"][-1]
        sample = read_sample(s, (start, end))
        assert sample["__key__"] == key and sample["cls"] == key[1:].encode()


def test_bad_samples_rejected(tmp_path):
    from ember.shards import FormatError

    with TarWriter(str(tmp_path / "b.tar")) as w:
        with pytest.raises(ValueError, match="no fields"):
            w.write({"__key__": "nofields"})
        with pytest.raises(FormatError, match="key"):
            w.write({"cls": 1})  # no key
        w.write({"__key__": "ok", "cls": 1})
    # the rejected samples left nothing behind
    assert [s["__key__"] for s in iter_shard(str(tmp_path / "b.tar"))] == ["ok"]


# one value per conventional extension, and how to compare its decoded form with the value
_OBJ = {"a": [1, 2.5, None, "x"], "b": {"c": True}}
_ROUND_TRIPS = {
    **{ext: (42, 42) for ext in ("cls", "cls2", "index", "inx", "id")},
    **{ext: ("héllo\nwörld", "héllo\nwörld") for ext in ("txt", "text", "transcript")},
    **{ext: (_OBJ, _OBJ) for ext in ("json", "jsn")},
    **{ext: ({"m": [1, b"\x00raw", "s"]}, {"m": [1, b"\x00raw", "s"]})
       for ext in ("mp", "msg", "msgpack", "cbor")},
    **{ext: ({"z": (1, 2)}, {"z": (1, 2)}) for ext in ("pyd", "pickle", "pkl")},
}


def test_round_trips_cover_every_structured_extension():
    from ember.shards import decode

    structured = (decode.INT_EXTENSIONS | decode.TEXT_EXTENSIONS | decode.JSON_EXTENSIONS
                  | decode.MSGPACK_EXTENSIONS | decode.CBOR_EXTENSIONS | decode.PICKLE_EXTENSIONS)
    assert set(_ROUND_TRIPS) == structured


@pytest.mark.parametrize("ext", sorted(_ROUND_TRIPS))
@pytest.mark.parametrize("gz", [False, True])
def test_every_structured_extension_round_trips(tmp_path, ext, gz):
    value, expected = _ROUND_TRIPS[ext]
    field = ext + ".gz" if gz else ext
    dec, raw = _roundtrip(tmp_path, {"__key__": "k", field: value}, allow_pickle=True)
    assert dec[field] == expected
    if gz:
        assert raw[field][:2] == b"\x1f\x8b"


def test_cbor_is_standard_cbor(tmp_path):
    cbor2 = pytest.importorskip("cbor2")
    obj = {"a": [1, 2.5, None, "x", b"\x00\xff"], "n": -(2**40), "t": True}
    dec, raw = _roundtrip(tmp_path, {"__key__": "c", "cbor": obj, "s.cbor": "text"})
    assert cbor2.loads(raw["cbor"]) == obj  # readable by any CBOR decoder
    assert dec["cbor"] == obj
    # a str is serialised as a CBOR text string, not stored as raw UTF-8
    assert raw["s.cbor"] == b"\x64text" and dec["s.cbor"] == "text"
    # bytes pass through unchanged, so pre-encoded CBOR is stored as given
    dec, raw = _roundtrip(tmp_path, {"__key__": "c", "cbor": cbor2.dumps([7, 8])})
    assert dec["cbor"] == [7, 8]


@pytest.mark.parametrize("module, ext", [("cbor2", "cbor"), ("msgpack", "mp")])
def test_missing_optional_codec_is_a_clear_error(tmp_path, monkeypatch, module, ext):
    import sys

    from ember.shards import encode_field

    path = tmp_path / "o.tar"
    with TarWriter(str(path)) as w:
        w.write({"__key__": "k", ext: {"a": 1}})
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ImportError, match=f"needs the {module} package"):
        encode_field(ext, {"a": 1})
    assert encode_field(ext, b"pre-encoded") == b"pre-encoded"
    # decoding: an ImportError, even where on_error would skip bad samples
    with pytest.raises(ImportError, match=f"decoding .{ext} needs the {module} package"):
        list(ShardDataset(str(path), on_error="skip").decode())


_IMAGES = ["bmp", "gif", "jpeg", "jpg", "pbm", "pgm", "png", "pnm", "ppm", "tif", "tiff", "webp"]


def test_image_round_trips_cover_every_image_extension():
    from ember.shards.decode import IMAGE_EXTENSIONS

    assert set(IMAGE_EXTENSIONS) == set(_IMAGES)


@pytest.mark.parametrize("ext", _IMAGES)
def test_every_image_extension_round_trips(tmp_path, ext):
    img = np.zeros((8, 10, 3), dtype=np.uint8)  # black and white: exact in every format but jpeg
    img[2:6, 3:8] = 255
    dec, _ = _roundtrip(tmp_path, {"__key__": "im", ext: img}, "rgb8")
    assert dec[ext].shape == (8, 10, 3) and dec[ext].dtype == np.uint8
    tolerance = 40 if ext in ("jpg", "jpeg", "webp") else 0  # lossy by default
    assert np.abs(dec[ext].astype(int) - img.astype(int)).max() <= tolerance


@pytest.mark.parametrize("pattern, message", [("out.tar", "has no shard number"),
                                              ("out-%q.tar", "bad shard pattern"),
                                              ("out-{name}.tar", "bad shard pattern")])
def test_shard_pattern_needs_a_shard_number(tmp_path, pattern, message):
    with pytest.raises(ValueError, match=message):
        ShardWriter(str(tmp_path / pattern))
    assert list(tmp_path.iterdir()) == []


def test_shard_patterns_printf_and_format(tmp_path):
    from ember.shards.writer import shard_path

    assert shard_path("a-%06d.tar", 12) == "a-000012.tar"
    assert shard_path("a-{:04d}.tar", 12) == "a-0012.tar"
    assert shard_path("a-%d.tar", 1234567) == "a-1234567.tar"
