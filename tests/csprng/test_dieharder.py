"""A short dieharder run on ember output (slow; the full 256 MiB run is bench/dieharder.py)."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("dieharder") is None, reason="dieharder is not installed")
def test_dieharder_subset_has_no_failures():
    import dieharder

    rows, fed = dieharder.run(mib=64, tests="quick", timeout=1800)
    assert fed >= 64
    assert len(rows) >= 8
    assert not [r for r in rows if r["verdict"] == "FAILED"]
