"""Benchmark ember.csprng on CUDA against torch's Philox generator and a device-to-device copy.

    python bench/csprng_cuda.py [--quick] [--mib 256] [--reps 9] [--json bench/results/csprng_cuda.json]

Each case fills a preallocated 256 MiB CUDA tensor (``torch.rand``/``torch.randn``/``torch.randint``
with ``out=``) from an ember generator (AES-128, and ChaCha20) and from a CUDA ``torch.Generator``
(Philox). ``copy`` is ``dst.copy_(src)`` of the same size: the output bytes per second of a plain
device-to-device copy, the bandwidth ceiling for writing that output. Times come from CUDA events
around one call, after warm-up calls (which include Triton's compilation); the median of the
repetitions is reported, the four contenders interleaved in every repetition. GB/s are of output.

Goals (rand float32, AES-128): at least 0.5x Philox and at least 25% of the copy bandwidth.
Without a CUDA device (or without triton) it prints why and exits 0, measuring nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

MiB = 1 << 20
GOAL_VS_PHILOX = 0.5  # rand float32: ember / Philox
GOAL_OF_COPY = 0.25  # rand float32: ember / copy bandwidth
CIPHERS = ("aes128", "chacha20")


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed, so ember would fill CUDA tensors on the CPU and copy"
    return None


def time_ms(fn: Callable[[], object]) -> float:
    """Milliseconds of one call of ``fn`` on the current stream (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def cases(nbytes: int) -> list[tuple[str, Callable[[torch.Generator], Callable[[], object]]]]:
    dev = "cuda"
    n32, n64 = nbytes // 4, nbytes // 8
    out32 = torch.empty(n32, device=dev)
    out64 = torch.empty(n64, dtype=torch.int64, device=dev)
    return [
        ("rand float32", lambda g: lambda: torch.rand(n32, generator=g, device=dev, out=out32)),
        ("randn float32", lambda g: lambda: torch.randn(n32, generator=g, device=dev, out=out32)),
        (
            "randint int64",
            lambda g: lambda: torch.randint(0, 1000, (n64,), generator=g, device=dev, out=out64),
        ),
    ]


def check_matches_cpu(n: int = 1 << 20) -> bool:
    """The CUDA fill equals the CPU fill for the same seed (bit for bit for uniform floats)."""
    from ember.csprng import create_generator

    ok = True
    for cipher in CIPHERS:
        a = torch.rand(n, generator=create_generator(5, cipher=cipher))
        b = torch.rand(n, generator=create_generator(5, cipher=cipher), device="cuda")
        ok = ok and torch.equal(a, b.cpu())
    return ok


def run(mib: int = 256, reps: int = 9, warmup: int = 2) -> list[dict]:
    from ember.csprng import create_generator

    nbytes = mib * MiB
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(7)
    dst = torch.empty_like(src)
    rows = []
    for name, make in cases(nbytes):
        fns = {c: make(create_generator(0, cipher=c)) for c in CIPHERS}
        fns["philox"] = make(torch.Generator(device="cuda").manual_seed(0))
        fns["copy"] = lambda: dst.copy_(src)
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(reps):
            for k, fn in fns.items():
                times[k].append(time_ms(fn))
        gbps = {k: nbytes / (statistics.median(v) * 1e-3) / 1e9 for k, v in times.items()}
        rows.append(
            {
                "case": name,
                "size_mib": mib,
                **{f"{k}_gbps": v for k, v in gbps.items()},
                "vs_philox": gbps["aes128"] / gbps["philox"],
                "of_copy": gbps["aes128"] / gbps["copy"],
                "chacha20_vs_philox": gbps["chacha20"] / gbps["philox"],
                "chacha20_of_copy": gbps["chacha20"] / gbps["copy"],
            }
        )
    return rows


def goals(rows: list[dict]) -> list[dict]:
    """The two goals for rand float32 (AES-128), met or not."""
    out = []
    for r in rows:
        if r["case"] == "rand float32":
            out.append(
                {
                    "goal": f"rand float32 >= {GOAL_VS_PHILOX}x Philox",
                    "value": r["vs_philox"],
                    "met": r["vs_philox"] >= GOAL_VS_PHILOX,
                }
            )
            out.append(
                {
                    "goal": f"rand float32 >= {GOAL_OF_COPY:.0%} of copy bandwidth",
                    "value": r["of_copy"],
                    "met": r["of_copy"] >= GOAL_OF_COPY,
                }
            )
    return out


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'case':<16}{'MiB':>6}{'AES GB/s':>10}{'ChaCha GB/s':>13}{'Philox GB/s':>13}"
        f"{'copy GB/s':>11}{'AES/Philox':>12}{'AES/copy':>10}{'ChaCha/Philox':>15}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['case']:<16}{r['size_mib']:>6}{r['aes128_gbps']:>10.1f}"
            f"{r['chacha20_gbps']:>13.1f}{r['philox_gbps']:>13.1f}{r['copy_gbps']:>11.1f}"
            f"{r['vs_philox']:>11.2f}x{r['of_copy']:>10.0%}{r['chacha20_vs_philox']:>14.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 MiB, 3 repetitions")
    ap.add_argument("--mib", type=int, default=256, help="output size per call (default 256)")
    ap.add_argument("--reps", type=int, default=9, help="timed repetitions (median reported)")
    ap.add_argument("--json", type=Path, default=Path("bench/results/csprng_cuda.json"))
    args = ap.parse_args(argv)
    reason = no_gpu_reason()
    if reason is not None:
        print(f"bench/csprng_cuda.py: {reason}; nothing measured.")
        return 0
    mib, reps = (16, 3) if args.quick else (args.mib, args.reps)
    matches = check_matches_cpu()
    print(f"CUDA output equals the CPU output for the same seed: {'yes' if matches else 'NO'}")
    rows = run(mib, reps)
    print(format_table(rows))
    met = goals(rows)
    print("\ngoals (AES-128):")
    for gl in met:
        print(f"  {gl['goal']:<40}{gl['value']:>8.2f}  {'met' if gl['met'] else 'NOT met'}")
    meta = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "triton": _version("triton"),
        "python": platform.python_version(),
        "reps": reps,
        "statistic": "median",
        "matches_cpu": matches,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows, "goals": met}, indent=2))
    print(f"wrote {args.json}")
    return 0 if matches else 1


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
