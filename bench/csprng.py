"""Benchmark ember.csprng against torch's default CPU generator; prints a table, writes JSON.

    python bench/csprng.py [--quick] [--reps 5] [--no-thp] [--json bench/results/csprng.json]

Every row runs ember and torch's generator on the same call in one process, interleaved over at
least 5 repetitions; it reports the median ratio with its min-max (and, in the JSON, interquartile
range and every repetition's seconds) and the 1-minute load average before and after the row, so a
figure taken on a busy machine shows that it was. Preallocated outputs (out=) and fresh outputs
(torch.rand(n, generator=g)) are both measured; the fresh ones again in a child process started
with THP_MEM_ALLOC_ENABLE=1 (torch's CPU allocator then asks for transparent huge pages, which cuts
the cost of faulting in new pages).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from ember.csprng.benchmark import REPS, call_overhead_us, format_table, load_average, run


def _fresh_with_thp(mib: int, reps: int) -> list[dict]:
    """run_fresh in a child process with THP_MEM_ALLOC_ENABLE=1 (read when torch starts)."""
    code = ("import json, sys; from ember.csprng.benchmark import run_fresh; "
            f"json.dump(run_fresh({mib}, {reps}), sys.stdout)")
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
    ap.add_argument("--quick", action="store_true", help="smaller sizes (still >= 5 repetitions)")
    ap.add_argument("--reps", type=int, default=REPS,
                    help=f"interleaved repetitions per row (at least {REPS})")
    ap.add_argument("--json", type=Path, default=Path("bench/results/csprng.json"))
    ap.add_argument("--no-thp", action="store_true", help="skip the THP_MEM_ALLOC_ENABLE=1 run")
    args = ap.parse_args()
    if args.reps < REPS:
        ap.error(f"--reps must be at least {REPS}, got {args.reps}")
    start = time.time()
    rows = run(quick=args.quick, fresh=True, reps=args.reps)
    if not args.no_thp:
        rows += _fresh_with_thp(16 if args.quick else 64, args.reps)
    print(format_table(rows))
    overhead = call_overhead_us()
    print("\nper-call cost (us):")
    for name, value in overhead.items():
        print(f"  {name:<30}{value:8.2f}")
    load = load_average()
    print(f"\nload average (1 min) at the end: {'n/a' if load is None else f'{load:.2f}'}; "
          f"CPUs: {os.cpu_count()}; torch threads: {torch.get_num_threads()}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
            "seconds": round(time.time() - start, 1), "reps": args.reps, "quick": args.quick,
            "load_end": load}
    args.json.write_text(json.dumps({"meta": meta, "rows": rows, "call_us": overhead}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
