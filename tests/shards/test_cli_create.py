"""``ember shards create`` from an image folder and a file list, ``--post``; round
trips through webdataset."""

from __future__ import annotations

import io
import json
import shlex
import sys

import numpy as np
import pytest

from ember.cli import main
from ember.shards import ShardDataset
from ember.shards.urls import expand_urls

wds = pytest.importorskip("webdataset")
Image = pytest.importorskip("PIL.Image")


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((4, 5, 3), value, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def image_folder(tmp_path):
    root = tmp_path / "train"
    expected = {}
    for name, count in [("dog", 4), ("cat", 3), ("zebra", 2)]:
        (root / name).mkdir(parents=True)
        for j in range(count):
            (root / name / f"img{j}.png").write_bytes(_png(10 * j))
            expected[f"{name}/img{j}"] = name
    (root / "cat" / "notes.md").write_text("not an image")
    return root, expected


def test_create_from_image_folder_reads_back_in_webdataset(image_folder, tmp_path, capsys):
    root, expected = image_folder
    out = tmp_path / "out" / "train-%03d.tar"
    assert main(["shards", "create", str(root), "-o", str(out), "--maxcount", "4", "-q"]) == 0
    assert "wrote 9 samples to 3 shards" in capsys.readouterr().out
    classes = json.loads((tmp_path / "out" / "classes.json").read_text())["classes"]
    assert classes == ["cat", "dog", "zebra"]  # sorted, as torchvision's ImageFolder
    urls = expand_urls(str(tmp_path / "out" / "train-{000..002}.tar"))
    got = list(wds.WebDataset(urls, shardshuffle=False).decode("rgb8").to_tuple("__key__", "png",
                                                                                 "cls"))
    assert {k: classes[c] for k, _, c in got} == expected
    assert all(img.shape == (4, 5, 3) for _, img, _ in got)
    # and ember reads the same
    ours = list(ShardDataset(urls, shuffle_shards=False).decode().to_tuple("__key__ cls"))
    assert ours == [(k, c) for k, _, c in got]


def test_create_from_file_list(tmp_path, capsys):
    for name in ["a/x.jpg", "a/x.json", "b/y.jpg"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        if name.endswith(".jpg"):  # create decodes every image: a real JPEG
            Image.new("RGB", (6, 4), (200, 10, 10)).save(tmp_path / name, format="JPEG")
        else:
            (tmp_path / name).write_bytes(name.encode())
    (tmp_path / "files.txt").write_text("a/x.jpg\na/x.json\nb/y.jpg\n")
    out = tmp_path / "o-%02d.tar"
    assert main(["shards", "create", "--list", str(tmp_path / "files.txt"), "-o", str(out),
                 "-q"]) == 0
    got = list(wds.WebDataset(str(tmp_path / "o-00.tar"), shardshuffle=False))
    assert [(s["__key__"], sorted(k for k in s if k[:2] != "__")) for s in got] == [
        ("a/x", ["jpg", "json"]), ("b/y", ["jpg"])]
    assert got[0]["json"] == b"a/x.json"


def test_create_refuses_a_folder_without_classes(tmp_path, capsys):
    (tmp_path / "flat").mkdir()
    assert main(["shards", "create", str(tmp_path / "flat"), "-o", str(tmp_path / "o-%02d.tar"),
                 "-q"]) == 2
    assert "ImageFolder" in capsys.readouterr().err


def test_post_runs_on_each_finished_shard(image_folder, tmp_path, capsys):
    root, _ = image_folder
    log = tmp_path / "post.log"
    script = f"import sys; open({str(log)!r}, 'a').write(sys.argv[1] + '\\n')"
    post = [sys.executable, "-c", script, "{}"]
    cmd = shlex.join(post)
    out = tmp_path / "out" / "s-%02d.tar"
    assert main(["shards", "create", str(root), "-o", str(out), "--maxcount", "5", "-q",
                 "--post", cmd]) == 0
    assert log.read_text().splitlines() == [str(tmp_path / "out" / "s-00.tar"),
                                            str(tmp_path / "out" / "s-01.tar")]


def test_failing_post_exits_non_zero_and_removes_the_output(image_folder, tmp_path, capsys):
    root, _ = image_folder
    cmd = shlex.join([sys.executable, "-c", "import sys; sys.exit(3)"])
    out = tmp_path / "out" / "s-%02d.tar"
    assert main(["shards", "create", str(root), "-o", str(out), "--maxcount", "5", "-q",
                 "--post", cmd]) == 2
    assert "exit status 3" in capsys.readouterr().err
    assert not list((tmp_path / "out").glob("s-*"))


def test_split_reads_a_tar_from_stdin_and_cat_tar_writes_one(tmp_path):
    """``ember shards cat --tar A B | ember shards split - -o ...``, as separate processes."""
    import subprocess

    for i in range(2):
        with wds.TarWriter(str(tmp_path / f"in-{i}.tar")) as w:
            for j in range(6):
                w.write({"__key__": f"{j:03d}", "cls": str(10 * i + j)})
    cli = [sys.executable, "-m", "ember.cli", "shards"]
    cat = subprocess.run([*cli, "cat", "--tar", str(tmp_path / "in-{0..1}.tar")],
                         capture_output=True, check=True, timeout=120)
    out = tmp_path / "out" / "s-%02d.tar"
    done = subprocess.run([*cli, "split", "-", "-o", str(out), "--maxcount", "5", "-q"],
                          input=cat.stdout, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert b"wrote 12 samples to 3 shards" in done.stdout
    urls = expand_urls(str(tmp_path / "out" / "s-{00..02}.tar"))
    got = list(wds.WebDataset(urls, shardshuffle=False).decode())
    assert sorted(s["cls"] for s in got) == list(range(6)) + list(range(10, 16))
    assert len({s["__key__"] for s in got}) == 12  # the second shard's keys were made unique


def test_create_reads_a_tar_stream_from_stdin(tmp_path, monkeypatch, capsys, make_tar):
    """``tar cf - --sort=name -C dir . | ember shards create - -o ...``: a tar written by another
    tool (here Python's tarfile, GNU tar's layout: a ``./`` directory entry, ``./`` names)."""
    members = [("./", None)]
    for j in range(7):
        members += [(f"./s{j}.cls", str(j).encode()), (f"./s{j}.txt", f"text {j}".encode())]
    data = make_tar(members)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    out = tmp_path / "o-%02d.tar"
    assert main(["shards", "create", "-", "-o", str(out), "--maxcount", "3", "-q"]) == 0
    assert "wrote 7 samples to 3 shards" in capsys.readouterr().out
    got = list(wds.WebDataset(expand_urls(str(tmp_path / "o-{00..02}.tar")), shardshuffle=False))
    # keys lose tar's leading "./"
    assert [s["__key__"] for s in got] == [f"s{j}" for j in range(7)]
    assert [s["txt"] for s in got] == [f"text {j}".encode() for j in range(7)]


def _read_back(out_dir) -> dict[str, tuple[str, tuple]]:
    """key -> (the image field's extension, the decoded image's first pixel), read by WebDataset."""
    urls = sorted(str(p) for p in out_dir.glob("*.tar"))
    got = {}
    for s in wds.WebDataset(urls, shardshuffle=False).decode("rgb8"):
        fields = [k for k in s if not k.startswith("__") and k != "cls"]
        assert len(fields) == 1, (s["__key__"], fields)  # one image per sample, no merged pairs
        got[s["__key__"]] = (fields[0], tuple(int(v) for v in s[fields[0]][0, 0]))
    return got


def test_create_keeps_every_image_of_a_real_looking_folder(tmp_path, capsys):
    root = tmp_path / "photos"
    for sub in ["cat/2021/summer", "dog"]:
        (root / sub).mkdir(parents=True)
    Image.fromarray(np.full((4, 5, 3), 10, dtype=np.uint8)).save(root / "cat" / "x.jpg", quality=100)
    (root / "cat" / "x.png").write_bytes(_png(200))  # the same stem in two formats
    (root / "cat" / "IMG_2021.01.05.png").write_bytes(_png(30))  # dots in the name
    (root / "cat" / "IMG_2021_01_05.png").write_bytes(_png(40))  # ... and its dotless twin
    (root / "cat" / "2021" / "summer" / "beach.png").write_bytes(_png(50))  # nested, as ImageFolder
    (root / "dog" / "a.png").write_bytes(_png(60))
    (root / "dog" / "readme.txt").write_text("not an image")
    out = tmp_path / "out"
    assert main(["shards", "create", str(root), "-o", str(out / "s-%03d.tar"), "-q"]) == 0
    printed = capsys.readouterr()
    assert "wrote 6 samples" in printed.out
    got = _read_back(out)
    assert len(got) == 6 and len(set(got)) == 6  # every image, each under its own key
    pixels = sorted(p[0] for _, p in got.values())
    assert pixels[1:] == [30, 40, 50, 60, 200] and pixels[0] in range(5, 16)  # jpg is lossy
    assert any(k.startswith("cat/2021/summer/") for k in got)
    assert all("." not in k.rsplit("/", 1)[-1] for k in got)
    # what was skipped or renamed is said, not silent
    assert "1 file" in printed.err and "readme.txt" in printed.err
    assert "IMG_2021.01.05.png" in printed.err
