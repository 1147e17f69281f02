"""``ember bench``: run a subsystem's benchmark and print its table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print its table")
    p.add_argument("target", choices=["csprng"], help="what to benchmark")
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import sys
    import time

    # the run is silent while it measures (a progress bar would disturb the timings): say what
    # it does and about how long it takes before it starts
    sizes, took = ("1 and 16 MiB", "10-20 s") if args.quick else ("1 and 64 MiB", "25-40 s")
    print(f"ember bench csprng: timing ember.csprng (AES-128-CTR) against torch's default "
          f"generator, side by side in interleaved repetitions: keystream, rand, randn, "
          f"randint, bernoulli at {sizes} and randperm; this takes about {took} on an idle "
          "machine" + ("" if args.quick else " (--quick: a shorter run)") + "...",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    from ember.csprng.benchmark import format_table, run

    rows = run(quick=args.quick)
    print(f"ember bench csprng: done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(format_table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0
