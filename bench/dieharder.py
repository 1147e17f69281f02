"""Feed ember.csprng output to dieharder and report its verdicts.

    python bench/dieharder.py [--mib 256] [--tests all|quick|ID,ID...] [--resolve] [--timeout S]
        [--json PATH]

The input is ember's ``torch.randint(0, 2**32, generator=g)`` stream (a power-of-two range, so the
values are the raw little-endian 32-bit words), streamed to ``dieharder -g 200`` (raw binary on
stdin) for as long as dieharder reads; the run fails if it read less than ``--mib`` MiB. Install
dieharder with ``apt-get install dieharder``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import ember.csprng as csprng

# dieharder -d ids (one per run: -d takes a single id). Not 201 (rgb_minimum_distance): in
# dieharder 3.31.1 it fails with p = 0 for its own AES_OFB generator too (`dieharder -d 201 -g 205`).
QUICK = [0, 1, 2, 3, 8, 15, 100, 101, 102]


def chunks(seed: int, mib_per_chunk: int = 16):
    """Endless ember output: full-range 32-bit integers from the native stream, as raw bytes."""
    g = csprng.create_generator(seed)
    out = torch.empty(mib_per_chunk * (1 << 18), dtype=torch.int64)
    while True:
        torch.randint(0, 2**32, out.shape, generator=g, out=out)  # power-of-two range: raw words
        yield out.numpy().astype("<u4").tobytes()


def _one(args: list[str], stream, deadline: float) -> tuple[str, str, int]:
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: list[str] = []

    def echo() -> None:  # print verdicts as dieharder reaches them: a full run takes hours
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            lines.append(line)
            if "|" in line:
                print(line.rstrip(), flush=True)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    fed = 0
    try:
        for chunk in stream:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError("dieharder did not finish in time")
            try:
                proc.stdin.write(chunk)
            except OSError:  # dieharder has read what it needs and exited
                break
            fed += len(chunk) >> 20
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    err = proc.stderr.read()
    proc.wait(timeout=60)
    reader.join(timeout=60)
    return "".join(lines), err.decode(errors="replace"), fed


def run(mib: int, tests: str, seed: int = 0, timeout: float = 3600, resolve: bool = False,
        extra: tuple[str, ...] = ()) -> tuple[list[dict], int]:
    """Verdict rows, and the MiB fed (at least ``mib``: dieharder reads as much as it needs)."""
    exe = shutil.which("dieharder")
    if exe is None:
        raise SystemExit("dieharder is not installed (apt-get install dieharder)")
    stream = chunks(seed)  # one continuous ember stream across all the dieharder runs
    deadline = time.monotonic() + timeout
    if tests == "all":
        runs = [["-a"]]
    else:
        ids = QUICK if tests == "quick" else [int(d) for d in tests.split(",")]
        runs = [["-d", str(d)] for d in ids]
    if resolve:  # -Y 1: re-test WEAK results with more p-samples until they pass or fail
        runs = [[*r, "-Y", "1"] for r in runs]
    runs = [[*r, *extra] for r in runs]
    rows, fed = [], 0
    for extra in runs:
        out, err, n = _one([exe, "-g", "200", *extra], stream, deadline)
        fed += n
        for line in out.splitlines():
            m = re.match(r"\s*(\S+)\|\s*(\d+)\|\s*(\d+)\|\s*(\d+)\|([\d.]+)\|\s*(PASSED|WEAK|FAILED)", line)
            if m:
                rows.append({"test": m[1], "ntup": int(m[2]), "p": float(m[5]), "verdict": m[6]})
    if not rows:
        raise RuntimeError(f"dieharder printed no verdicts: {err[-2000:]}")
    if fed < mib:
        raise RuntimeError(f"dieharder read only {fed} MiB, fewer than the {mib} MiB asked for")
    return rows, fed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tests", default="all",
                    help="all (dieharder -a), quick, or comma-separated dieharder -d ids")
    ap.add_argument("--resolve", action="store_true",
                    help="dieharder -Y 1: re-run WEAK results with more p-samples")
    ap.add_argument("--json", type=Path, default=Path("bench/results/dieharder.json"))
    ap.add_argument("--timeout", type=float, default=6 * 3600, help="seconds before giving up")
    ap.add_argument("--ntuple", type=int, help="dieharder -n (e.g. rgb_bitdist's tuple size)")
    args = ap.parse_args()
    extra = ("-n", str(args.ntuple)) if args.ntuple else ()
    rows, fed = run(args.mib, args.tests, timeout=args.timeout, resolve=args.resolve, extra=extra)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("PASSED", "WEAK", "FAILED")}
    for r in rows:
        print(f"{r['test']:<28}{r['ntup']:>4}  p={r['p']:.6f}  {r['verdict']}")
    print(f"\n{fed} MiB of ember output fed to dieharder: {counts}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"mib_fed": fed, "counts": counts, "rows": rows}, indent=2))
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
