"""``ember shards create`` on awkward inputs, through the ``ember`` entry point: a tar stream on
standard input holding a class webdataset reserves and hidden members, links that lead nowhere
or to themselves, and files that are not regular files."""

from __future__ import annotations

import io
import tarfile

import pytest
from test_cli_guards import ember, one_error_line, png

from ember.shards import iter_shard

wds = pytest.importorskip("webdataset")


def _folder(root, classes: dict[str, int]):
    for name, count in classes.items():
        (root / name).mkdir(parents=True)
        for j in range(count):
            (root / name / f"i{j}.png").write_bytes(png(4 + j, 3))
    return root


def _keys(out_dir) -> list[str]:
    return [s["__key__"] for p in sorted(out_dir.glob("*.tar")) for s in iter_shard(str(p))]


def _tar_of(root, names: list[str], prefix: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name in names:
            tar.add(str(root / name), arcname=prefix + name, recursive=False)
    return buf.getvalue()


@pytest.mark.parametrize("prefix", ["", "./"])
def test_a_stream_keeps_a_reserved_class_and_leaves_hidden_members_out(tmp_path, prefix):
    root = _folder(tmp_path / "in", {"__background__": 3, "cat": 3})
    (root / "cat" / "._i0.png").write_bytes(b"macOS resource fork")
    (root / ".DS_Store").write_bytes(b"finder")
    by_folder = ember("create", str(root), "-o", str(tmp_path / "f" / "s-%03d.tar"), "-q",
                      "--no-shuffle")
    assert by_folder.returncode == 0, by_folder.stderr
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    r = ember("create", "-", "-o", str(tmp_path / "out" / "s-%03d.tar"), "-q",
              stdin=_tar_of(root, names, prefix))
    assert r.returncode == 0, r.stderr
    ours = _keys(tmp_path / "out")
    assert sorted(ours) == sorted(_keys(tmp_path / "f"))  # the keys the folder path writes
    assert len(ours) == 6
    theirs = [s["__key__"] for s in wds.WebDataset(str(tmp_path / "out" / "s-000.tar"),
                                                   shardshuffle=False)]
    assert theirs == ours
    err = r.stderr.decode().splitlines()
    left_out = [x for x in err if "left out" in x]
    assert len(left_out) == 1 and "2 hidden" in left_out[0], err
    assert any("_background__" in x and "differ" in x for x in err), err


def test_a_stream_with_both_a_reserved_class_and_its_new_name_is_refused(tmp_path):
    root = _folder(tmp_path / "in", {"__background__": 1, "_background__": 1})
    r = ember("create", "-", "-o", str(tmp_path / "out" / "s-%03d.tar"), "-q",
              stdin=_tar_of(root, ["__background__/i0.png", "_background__/i0.png"], ""))
    assert "__background__" in one_error_line(r, "create")
    assert not (tmp_path / "out").exists()
