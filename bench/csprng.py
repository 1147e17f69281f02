"""Benchmark ember.csprng against torch's default CPU generator; prints a table, writes JSON.

    python bench/csprng.py [--quick] [--json bench/results/csprng.json]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from ember.csprng.benchmark import call_overhead_us, format_table, run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    ap.add_argument("--json", type=Path, default=Path("bench/results/csprng.json"))
    args = ap.parse_args()
    rows = run(quick=args.quick)
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
