"""Small behaviours of ``ember shards`` through the ``ember`` entry point: sizes past any
number, flag combinations that cannot mean anything, a closed output pipe, counts in what the
command says."""

from __future__ import annotations

import pytest
from test_cli_guards import ember, one_error_line

from ember.shards import ShardWriter


def _shard(tmp_path, n: int = 5) -> str:
    with ShardWriter(str(tmp_path / "s-%04d.tar"), maxcount=n) as w:
        for i in range(n):
            w.write({"__key__": f"k{i}", "txt": "x"})
    return str(tmp_path / "s-0000.tar")


@pytest.mark.parametrize("size", ["1e400", "1e400MB", "9e99GiB"])
def test_a_maxsize_past_any_number_is_one_line(tmp_path, size):
    line = one_error_line(ember("split", _shard(tmp_path), "-o", str(tmp_path / "o" / "x-%03d.tar"),
                                "--maxsize", size), "split")
    assert "--maxsize" in line and size in line
    assert not (tmp_path / "o").exists()
