"""bench/csprng_cuda.py: imports and exits cleanly without a GPU; table and goals from fake rows."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "csprng_cuda.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_csprng_cuda", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_a_gpu_it_says_so_and_measures_nothing(monkeypatch, tmp_path, capsys):
    bench = load()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r.json"
    assert bench.main(["--json", str(out)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the real benchmark on a GPU")
def test_script_runs_as_one_command_without_a_gpu():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert "nothing measured" in proc.stdout


def test_table_and_goals():
    bench = load()
    row = {
        "case": "rand float32",
        "size_mib": 256,
        "aes128_gbps": 300.0,
        "chacha20_gbps": 900.0,
        "philox_gbps": 1000.0,
        "copy_gbps": 2000.0,
        "vs_philox": 0.3,
        "of_copy": 0.15,
        "chacha20_vs_philox": 0.9,
        "chacha20_of_copy": 0.45,
    }
    table = bench.format_table([row, dict(row, case="randn float32")])
    assert "rand float32" in table and "0.30x" in table and "15%" in table
    met = bench.goals([row, dict(row, case="randn float32", vs_philox=9.0)])
    assert [g["met"] for g in met] == [False, False]
    met = bench.goals([dict(row, vs_philox=0.5, of_copy=0.25)])
    assert [g["met"] for g in met] == [True, True]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quick_run_on_a_gpu(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out.exists() and "goals" in proc.stdout
