"""The SWA-family table on scikit-learn's digits.

``python bench/swa_family.py [--quick] [--seeds N] [--only NAME ...]`` imports every
``bench/swa_family_<method>.py`` that exists (method in multiswa, subspace, fastswa, swalp, swap),
runs its ``experiment(quick=, seeds=)``, prints one table and writes
bench/results/swa_family.json (protocols, rows, skipped experiments, wall times). A module that
is missing, fails to import or raises is reported as skipped; the others still run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
METHODS = ("multiswa", "subspace", "fastswa", "swalp", "swap")
METRICS = ("accuracy", "nll", "ece", "wall_s")


def _load(name: str) -> Any:
    path = HERE / f"swa_family_{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"{path.name} does not exist")
    spec = importlib.util.spec_from_file_location(f"swa_family_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        # a half-executed module must not shadow the real one for later imports
        del sys.modules[spec.name]
        raise
    if not callable(getattr(module, "experiment", None)):
        raise AttributeError(f"{path.name} defines no experiment()")
    return module


def _cell(row: dict, metric: str) -> str:
    mean, std = row.get(f"{metric}_mean"), row.get(f"{metric}_std")
    if mean is None:
        return "-"
    return f"{mean:.3f}±{(std or 0.0):.3f}" if metric != "wall_s" else f"{mean:.1f}±{(std or 0):.1f}"


def format_table(rows: Sequence[dict]) -> str:
    """One line per row: experiment, method, test set, metric mean±std, seeds."""
    header = ["experiment", "method", "test_set", *METRICS, "n_seeds"]
    body = [[str(r.get("experiment", "?")), str(r.get("method", "?")), str(r.get("test_set", "-")),
             *(_cell(r, m) for m in METRICS), str(r.get("n_seeds", "?"))] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*b) for b in body]
    return "\n".join(lines)


def run(*, quick: bool, seeds: Sequence[int], only: Sequence[str] | None = None,
        out: Path | None = HERE / "results" / "swa_family.json") -> dict[str, Any]:
    """Run the experiments; returns (and writes to ``out`` unless None) the JSON document."""
    names = list(only) if only else list(METHODS)
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {unknown}; choose from {list(METHODS)}")
    rows: list[dict] = []
    protocols: dict[str, str] = {}
    skipped: dict[str, str] = {}
    walls: dict[str, float] = {}
    for name in names:
        try:
            module = _load(name)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"note: skipping {name}: {type(exc).__name__}: {exc}", flush=True)
            skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        protocols[name] = str(getattr(module, "PROTOCOL", ""))
        t0 = time.perf_counter()
        try:
            got = module.experiment(quick=quick, seeds=list(seeds))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            print(f"note: {name} failed: {type(exc).__name__}: {exc}", flush=True)
            skipped[name] = f"failed: {type(exc).__name__}: {exc}"
            continue
        walls[name] = time.perf_counter() - t0
        print(f"{name}: {len(got)} rows in {walls[name]:.1f} s", flush=True)
        rows.extend(got)
    doc = {"quick": quick, "seeds": list(seeds), "rows": rows, "protocols": protocols,
           "skipped": skipped, "experiment_wall_s": walls,
           "platform": {"python": platform.python_version(), "machine": platform.machine()}}
    try:
        import torch
        doc["platform"]["torch"] = torch.__version__
        doc["platform"]["threads"] = torch.get_num_threads()
    except ImportError:
        pass
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2))
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the short version (tests use it)")
    ap.add_argument("--seeds", type=int, default=3, help="number of seeds (0..N-1), default 3")
    ap.add_argument("--only", action="append", choices=METHODS,
                    help="run only this experiment (repeatable)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "swa_family.json")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    t0 = time.perf_counter()
    doc = run(quick=args.quick, seeds=range(args.seeds), only=args.only, out=args.out)
    print()
    print(format_table(doc["rows"]))
    for name, why in doc["skipped"].items():
        print(f"skipped {name}: {why}")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s; wrote {args.out}"
          " (shared 2-core machine: wall times are noisy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
