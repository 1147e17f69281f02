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
    # AES at 15% of copy (goal 25%), ChaCha20 at 0.9x Philox (goal 0.5x), randn at 0.5x rand (0.7x)
    met = bench.goals([row, dict(row, case="randn float32", aes128_gbps=150.0, chacha20_gbps=850.0)])
    assert [g["met"] for g in met] == [False, True, False, True]
    extra = {"small": {"ratio": 2.5}, "dp_noise": {"ratio": 0.5}, "cold": {"seconds": 1.5}}
    met = bench.goals([dict(row, of_copy=0.25, chacha20_vs_philox=0.4)], extra)
    assert [(g["goal"].split()[0], g["met"]) for g in met] == [
        ("AES", True), ("ChaCha20", False), ("randn(1000)", False), ("ResNet-18", True), ("first", True)]


def test_compile_only_counts_what_it_compiled(monkeypatch, capsys):
    bench = load()
    monkeypatch.setattr(bench, "compile_only", lambda arch: (3, 1.25, ["NVRTC: 3 kernels"]))
    assert bench.main(["--compile-only"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "compile: 3 kernels, 1.2 s"


def test_resnet18_shapes_are_its_62_parameter_tensors():
    bench = load()
    shapes = bench.RESNET18_SHAPES
    assert len(shapes) == 62 and sum(int(torch.tensor(s).prod()) for s in shapes) == 11_689_512


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
