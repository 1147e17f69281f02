"""Small behaviours of ``ember shards`` through the ``ember`` entry point: sizes past any
number, flag combinations that cannot mean anything, a closed output pipe, counts in what the
command says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from test_cli_guards import ember, entry_point, one_error_line

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


def test_cat_into_a_pipe_closed_early_ends_quietly(tmp_path):
    with ShardWriter(str(tmp_path / "s-%04d.tar"), maxcount=5000) as w:
        for i in range(5000):  # more lines than a pipe and stdout's buffer hold
            w.write({"__key__": f"sample-{i:06d}", "txt": "x"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([*entry_point(), "shards", "cat", str(tmp_path / "s-0000.tar")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"sample-000000")
    proc.stdout.close()  # as `| head -1` does once it has its line
    try:
        err = proc.stderr.read()
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert err == b""
    assert code == 128 + signal.SIGPIPE  # as a Unix tool ended by SIGPIPE

