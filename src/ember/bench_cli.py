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
    from ember.csprng.benchmark import format_table, run

    rows = run(quick=args.quick)
    print(format_table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0
