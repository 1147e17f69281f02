"""The top of the ``ember`` command (issue 26): ``--version``, and ``ember bench`` saying what it
measures before its silent half minute."""

from __future__ import annotations

import pytest

from ember import __version__
from ember.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"ember {__version__} (torch ")


def test_bench_says_what_it_does_before_measuring(monkeypatch, capsys):
    import ember.csprng.benchmark as benchmark

    seen = {}

    def fake_run(quick: bool = False):
        seen["stderr_before"] = capsys.readouterr().err
        return [{"case": "rand float32", "size_mib": 1, "ember_gbps": 1.0, "torch_gbps": 1.0,
                 "ratio": 1.0, "goal": None}]

    monkeypatch.setattr(benchmark, "run", fake_run)
    assert main(["bench", "csprng", "--quick"]) == 0
    assert "timing ember.csprng" in seen["stderr_before"]
    assert "torch's default generator" in seen["stderr_before"]
    assert "done in" in capsys.readouterr().err
