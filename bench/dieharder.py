"""Feed ember.csprng output to dieharder and report its verdicts.

    python bench/dieharder.py [--mib 256] [--tests all|quick] [--json bench/results/dieharder.json]

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
import time
from pathlib import Path

import torch

import ember.csprng as csprng

QUICK = ["-d", "0", "-d", "1", "-d", "2", "-d", "3", "-d", "8", "-d", "15", "-d", "100", "-d", "101"]


def chunks(seed: int, mib_per_chunk: int = 16):
    """Endless ember output: full-range 32-bit integers from the native stream, as raw bytes."""
    g = csprng.create_generator(seed)
    out = torch.empty(mib_per_chunk * (1 << 18), dtype=torch.int64)
    while True:
        torch.randint(0, 2**32, out.shape, generator=g, out=out)  # power-of-two range: raw words
        yield out.numpy().astype("<u4").tobytes()


def run(mib: int, tests: str, seed: int = 0, timeout: float = 3600) -> tuple[list[dict], int]:
    """Verdict rows, and the MiB fed (at least ``mib``: dieharder reads as much as it needs)."""
    exe = shutil.which("dieharder")
    if exe is None:
        raise SystemExit("dieharder is not installed (apt-get install dieharder)")
    args = [exe, "-g", "200"] + (["-a"] if tests == "all" else QUICK)
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    fed = 0
    deadline = time.monotonic() + timeout
    try:
        for chunk in chunks(seed):
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"dieharder did not finish in {timeout} s")
            try:
                proc.stdin.write(chunk)
            except (BrokenPipeError, OSError):
                break  # dieharder has read what it needs and exited
            fed += len(chunk) >> 20
    finally:
        with contextlib.suppress(OSError):  # already closed by dieharder exiting
            proc.stdin.close()
    out, err = proc.communicate(timeout=60)
    if fed < mib:
        raise RuntimeError(f"dieharder stopped after {fed} MiB, fewer than the {mib} MiB asked for")
    rows = []
    for line in out.decode(errors="replace").splitlines():
        m = re.match(r"\s*(\S+)\|\s*(\d+)\|\s*(\d+)\|\s*(\d+)\|([\d.]+)\|\s*(PASSED|WEAK|FAILED)", line)
        if m:
            rows.append({"test": m[1], "ntup": int(m[2]), "p": float(m[5]), "verdict": m[6]})
    if not rows:
        raise RuntimeError(f"dieharder printed no verdicts: {err.decode()[-2000:]}")
    return rows, fed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tests", choices=["all", "quick"], default="all")
    ap.add_argument("--json", type=Path, default=Path("bench/results/dieharder.json"))
    args = ap.parse_args()
    rows, fed = run(args.mib, args.tests)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("PASSED", "WEAK", "FAILED")}
    for r in rows:
        print(f"{r['test']:<28}{r['ntup']:>4}  p={r['p']:.6f}  {r['verdict']}")
    print(f"\n{fed} MiB of ember output fed to dieharder: {counts}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"mib_fed": fed, "counts": counts, "rows": rows}, indent=2))
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
