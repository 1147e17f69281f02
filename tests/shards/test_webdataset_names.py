"""WebDataset's naming rules, both ways, with the installed webdataset package as the reference:
the reader skips the members webdataset skips (hidden basenames, ``__x__`` parts) and reports
unsafe names instead of yielding them; the writer refuses keys that webdataset would skip or read
as another sample, naming the rule."""

from __future__ import annotations

import pytest

from conftest import tar_bytes
from ember.shards import FormatError, ShardDataset, TarWriter

wds = pytest.importorskip("webdataset")


def _wds_samples(path) -> list[dict]:
    ds = wds.WebDataset(str(path), shardshuffle=False, empty_check=False)
    return [{k: v for k, v in s.items() if k != "__local_path__"} for s in ds]


def _ember_samples(path) -> list[dict]:
    return list(ShardDataset(str(path), shuffle_shards=False))


SKIPPED_BY_WEBDATASET = [
    # macOS tar: AppleDouble files and Finder's folder settings
    [("./.DS_Store", b"x"), ("./._a.jpg", b"x"), ("./a.jpg", b"A"), ("./a.cls", b"1")],
    # hidden basenames at the top and in a folder with a dot in its name, around samples
    [("x.y/.hidden.txt", b"x"), ("x.y/b.txt", b"B"), ("._c.txt", b"x"), ("e.txt", b"E")],
    # webdataset's metadata pattern as the first part of the name, and as the whole name
    [("__meta__/y.jpg", b"m"), ("__a.b__", b"m"), ("c.txt", b"C"), ("a/__x__/y.txt", b"Y")],
    # names that are not webdataset metadata, though they look alike
    [("___/k.txt", b"1"), ("__x__.jpg", b"2"), ("x/__m.y__", b"3"), ("x/__z__.txt", b"4")],
]


@pytest.mark.parametrize("members", SKIPPED_BY_WEBDATASET)
def test_the_reader_skips_what_webdataset_skips(tmp_path, members, implementation):
    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes(members))
    expected = _wds_samples(path)
    assert expected  # each case keeps at least one sample
    assert _ember_samples(path) == expected


def test_hidden_basenames_in_other_folders_are_skipped_too(tmp_path, implementation):
    # webdataset's key pattern reads d/.hidden.txt as a sample with key 'd/' and extension
    # 'hidden.txt'; ember skips every hidden basename (a difference listed in docs/shards.md)
    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes([("d/.hidden.txt", b"x"), ("d/b.txt", b"B"), ("d/.b.txt", b"x")]))
    assert [s["__key__"] for s in _wds_samples(path)] == ["d/", "d/b", "d/"]
    assert [s["__key__"] for s in _ember_samples(path)] == ["d/b"]


@pytest.mark.parametrize("name", ["../e.jpg", "a/../../e.jpg", "/abs/e.jpg", "./../e.jpg"])
def test_unsafe_member_names_are_reported_not_yielded(tmp_path, name, implementation):
    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes([("a.txt", b"A"), (name, b"E"), ("b.txt", b"B")]))
    with pytest.raises(FormatError, match="unsafe") as ei:
        _ember_samples(path)
    assert ei.value.url == str(path) and ei.value.offset == 1024
    seen: list[Exception] = []
    got = list(ShardDataset(str(path), on_error=seen.append))
    assert [s["__key__"] for s in got] == ["a"] and len(seen) == 1


@pytest.mark.parametrize(("key", "ext", "rule"), [
    ("__meta__/y", "jpg", "webdataset skips"),
    ("__x__/y/z", "txt", "webdataset skips"),
    ("__a", "b__", "webdataset skips"),
    ("../y", "jpg", "unsafe"),
    ("a/../y", "jpg", "unsafe"),
    ("/abs/y", "jpg", "unsafe"),
    ("a/", "jpg", "ends with '/'"),
])
def test_the_writer_refuses_keys_webdataset_would_skip_or_misread(tmp_path, key, ext, rule):
    with TarWriter(str(tmp_path / "s.tar")) as w, pytest.raises(FormatError, match=rule):
        w.write({"__key__": key, ext: b"x"})


@pytest.mark.parametrize("key", ["a/__x__/y", "__x__", "___/y", "./a", "a/.b/c", "x__/y"])
def test_keys_webdataset_reads_are_written_and_read_back_by_both(tmp_path, key):
    path = tmp_path / "s.tar"
    with TarWriter(str(path)) as w:
        w.write({"__key__": key, "txt": b"v"})
    assert [s["__key__"] for s in _wds_samples(path)] == [key]
    assert [s["__key__"] for s in _ember_samples(path)] == [key]


def test_index_scan_verify_and_split_report_unsafe_names(tmp_path):
    from test_cli_guards import ember

    from ember.shards.index import sample_count

    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes([("a.txt", b"A"), ("../e.txt", b"E"), ("b.txt", b"B")]))
    with pytest.raises(FormatError, match="unsafe"):
        sample_count(str(path))
    r = ember("verify", str(path), "-q")
    assert r.returncode == 1 and "unsafe" in (r.stdout + r.stderr).decode()
    r = ember("split", str(path), "-o", str(tmp_path / "out" / "o-%03d.tar"))
    assert r.returncode != 0 and "unsafe" in r.stderr.decode()
    assert list((tmp_path / "out").glob("*.tar")) == []


@pytest.mark.parametrize(("key", "ext"), [("a\0b", "txt"), ("a\0", "txt"), ("k", "t\0xt"),
                                          ("d\0/k", "txt")])
def test_the_writer_refuses_a_nul_in_a_key_or_extension(tmp_path, key, ext):
    # a tar header ends a name at its first NUL: neither reader gives the field back as written
    path = tmp_path / "raw.tar"
    path.write_bytes(tar_bytes([(f"{key}.{ext}", b"v"), ("c.txt", b"w")]))
    for samples in (_wds_samples(path), _ember_samples(path)):
        assert (key, ext) not in [(s["__key__"], f) for s in samples for f in s]
    with TarWriter(str(tmp_path / "s.tar")) as w, pytest.raises(FormatError, match="NUL"):
        w.write({"__key__": key, ext: b"v"})
