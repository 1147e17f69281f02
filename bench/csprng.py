"""Benchmark ember.csprng against torch's default CPU generator; prints a table, writes JSON.

    python bench/csprng.py [--quick] [--no-thp] [--json bench/results/csprng.json]

Preallocated outputs (out=) and fresh outputs (torch.rand(n, generator=g)) are both measured; the
fresh ones again in a child process started with THP_MEM_ALLOC_ENABLE=1 (torch's CPU allocator
then asks for transparent huge pages, which cuts the cost of faulting in new pages).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from ember.csprng.benchmark import call_overhead_us, format_table, run


def _fresh_with_thp(mib: int, repeat: int) -> list[dict]:
    """run_fresh in a child process with THP_MEM_ALLOC_ENABLE=1 (read when torch starts)."""
    code = ("import json, sys; from ember.csprng.benchmark import run_fresh; "
            f"json.dump(run_fresh({mib}, {repeat}), sys.stdout)")
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True)
    rows = json.loads(done.stdout)
    for r in rows:
        r["case"] += " THP"
        r["goal"] = None
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    ap.add_argument("--json", type=Path, default=Path("bench/results/csprng.json"))
    ap.add_argument("--no-thp", action="store_true", help="skip the THP_MEM_ALLOC_ENABLE=1 run")
    args = ap.parse_args()
    rows = run(quick=args.quick, fresh=True)
    if not args.no_thp:
        rows += _fresh_with_thp(16 if args.quick else 64, 3 if args.quick else 7)
    print(format_table(rows))
    overhead = call_overhead_us()
    print("\nper-call cost (us):")
    for name, value in overhead.items():
        print(f"  {name:<30}{value:8.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine()}
    args.json.write_text(json.dumps({"meta": meta, "rows": rows, "call_us": overhead}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
