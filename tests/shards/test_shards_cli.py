"""The ``ember shards`` command through ember.cli.main."""

from __future__ import annotations

import os

from ember.cli import main
from ember.shards import ShardDataset


def test_split_shuffle_index_and_verify(shards, tmp_path, capsys):
    pattern, keys = shards
    out = str(tmp_path / "o" / "x-%03d.tar")
    assert main(["shards", "split", pattern, "-o", out, "--maxcount", "4"]) == 0
    assert sorted(s["__key__"] for s in ShardDataset(str(tmp_path / "o" / "x-{000..014}.tar"))) \
        == sorted(keys)
    sh = str(tmp_path / "sh-%02d.tar")
    assert main(["shards", "shuffle", pattern, "-o", sh, "--maxcount", "100"]) == 0
    got = [s["__key__"] for s in ShardDataset(str(tmp_path / "sh-00.tar"))]
    assert sorted(got) == sorted(keys) and got != keys
    assert main(["shards", "index", pattern]) == 0
    assert os.path.exists(pattern.replace("{000..005}", "000") + ".idx")
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"x" * 700)
    capsys.readouterr()
    assert main(["shards", "verify", pattern, str(bad)]) == 1
    assert "CORRUPT shard " + str(bad) in capsys.readouterr().out
