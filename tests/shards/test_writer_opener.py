"""ShardWriter opener=, verbose= and post= (as webdataset's ShardWriter has them)."""

from __future__ import annotations

import io

import pytest

from ember.shards import ShardWriter

wds = pytest.importorskip("webdataset")


class _Target(io.BytesIO):
    """A file-like target (e.g. an upload) that keeps what it got when closed."""

    done: dict[str, bytes] = {}

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def close(self) -> None:
        _Target.done[self.name] = self.getvalue()
        super().close()


def test_opener_writes_each_shard_to_the_target_it_returns(tmp_path):
    _Target.done = {}
    finished = []
    with ShardWriter("mem://s-%02d.tar", maxcount=3, opener=_Target, post=finished.append) as w:
        for j in range(7):
            w.write({"__key__": f"{j:03d}", "cls": j})
    assert finished == ["mem://s-00.tar", "mem://s-01.tar", "mem://s-02.tar"]
    assert list(_Target.done) == finished  # closed by the writer
    counts = []
    for name in finished:
        path = tmp_path / name.split("//")[1]
        path.write_bytes(_Target.done[name])
        got = list(wds.WebDataset(str(path), shardshuffle=False).decode())
        counts.append([s["cls"] for s in got])
    assert counts == [[0, 1, 2], [3, 4, 5], [6]]
    assert not list(tmp_path.glob("*.writing"))


def test_opener_must_return_a_file_object():
    with pytest.raises(TypeError, match="binary file object"), \
            ShardWriter("s-%02d.tar", opener=lambda name: name) as w:
        w.write({"__key__": "a", "cls": 1})


def test_opener_and_index_are_refused_together():
    with pytest.raises(ValueError, match="opener"):
        ShardWriter("s-%02d.tar", opener=_Target, index=True)


def test_verbose_names_each_shard_on_stderr(tmp_path, capsys):
    with ShardWriter(str(tmp_path / "v-%02d.tar"), maxcount=2, verbose=1) as w:
        for j in range(3):
            w.write({"__key__": f"{j}", "cls": j})
    err = capsys.readouterr().err
    assert "# writing" in err and "v-00.tar" in err and "v-01.tar" in err
    with ShardWriter(str(tmp_path / "q-%02d.tar")) as w:
        w.write({"__key__": "a", "cls": 1})
    assert capsys.readouterr().err == ""
