"""Benchmark ember.csprng on CUDA against torch's Philox generator and a device-to-device copy.

    python bench/csprng_cuda.py [--quick] [--mib 256] [--reps 9] [--json bench/results/csprng_cuda.json]
    python bench/csprng_cuda.py --compile-only      # no GPU needed: compile every kernel for sm_90

``--compile-only`` compiles the fast path (the NVRTC module, every kernel) and the fallback path
(the Triton kernel variants ember launches) for sm_90 without a GPU and ends with
``compile: N kernels, T s``.

On a GPU it also measures (one run, interleaved, medians): ``randn(1000)`` per call against
Philox (host-bound), the DP noise of ResNet-18's 62 parameter tensors with ``normal_foreach_``
against Philox drawing them one by one, and the first CUDA draw of a fresh process with an empty
kernel cache (in a subprocess, after CUDA is initialised).

Each case fills a preallocated 256 MiB CUDA tensor (``torch.rand``/``torch.randn``/``torch.randint``
with ``out=``) from an ember generator (AES-128, and ChaCha20) and from a CUDA ``torch.Generator``
(Philox). ``copy`` is ``dst.copy_(src)`` of the same size: the output bytes per second of a plain
device-to-device copy, the bandwidth ceiling for writing that output. Times come from CUDA events
around one call, after warm-up calls (which include Triton's compilation); the median of the
repetitions is reported, the four contenders interleaved in every repetition. GB/s are of output.

Goals: AES-128 rand float32 >= 25% of the copy bandwidth; ChaCha20 rand float32 >= 0.5x Philox;
randn >= 0.7x the same cipher's rand; randn(1000) per call <= 2x Philox; ResNet-18 DP noise faster
than Philox; first draw in a fresh process <= 2 s after CUDA init.
Without a CUDA device (or without triton) it prints why and exits 0, measuring nothing.
"""

from __future__ import annotations

import argparse
import json
import math
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
    from ember.csprng.cuda_backend import fast_path

    if fast_path() == "cpu":
        return "neither cuda-bindings (NVRTC) nor triton is installed: ember would fill on the CPU"
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


GOAL_RANDN_VS_RAND = 0.7
GOAL_SMALL_VS_PHILOX = 2.0
GOAL_COLD_S = 2.0


def goals(rows: list[dict], extra: dict | None = None) -> list[dict]:
    """The goals of the issue, met or not (those whose measurement is present)."""
    by = {r["case"]: r for r in rows}
    out = []

    def add(goal: str, value: float, met: bool) -> None:
        out.append({"goal": goal, "value": value, "met": bool(met)})

    if "rand float32" in by:
        r = by["rand float32"]
        add(f"AES rand f32 >= {GOAL_OF_COPY:.0%} of copy", r["of_copy"], r["of_copy"] >= GOAL_OF_COPY)
        add(f"ChaCha20 rand f32 >= {GOAL_VS_PHILOX}x Philox", r["chacha20_vs_philox"],
            r["chacha20_vs_philox"] >= GOAL_VS_PHILOX)
        if "randn float32" in by:
            n = by["randn float32"]
            for c, label in (("aes128", "AES"), ("chacha20", "ChaCha20")):
                v = n[f"{c}_gbps"] / r[f"{c}_gbps"]
                add(f"{label} randn >= {GOAL_RANDN_VS_RAND}x its rand", v, v >= GOAL_RANDN_VS_RAND)
    extra = extra or {}
    if "small" in extra:
        v = extra["small"]["ratio"]
        add(f"randn(1000) per call <= {GOAL_SMALL_VS_PHILOX}x Philox", v, v <= GOAL_SMALL_VS_PHILOX)
    if "dp_noise" in extra:
        v = extra["dp_noise"]["ratio"]
        add("ResNet-18 noise (foreach) < Philox per tensor", v, v < 1.0)
    if "cold" in extra and extra["cold"].get("seconds") is not None:
        v = extra["cold"]["seconds"]
        add(f"first draw, empty cache <= {GOAL_COLD_S} s", v, v <= GOAL_COLD_S)
    return out


RESNET18_SHAPES = (
    [(64, 3, 7, 7), (64,), (64,)]
    + [(64, 64, 3, 3), (64,), (64,)] * 4
    + [s for w, prev in ((128, 64), (256, 128), (512, 256)) for s in (
        [(w, prev, 3, 3), (w,), (w,), (w, w, 3, 3), (w,), (w,), (w, prev, 1, 1), (w,), (w,)]
        + [(w, w, 3, 3), (w,), (w,)] * 2)]
    + [(1000, 512), (1000,)]
)


def _wall_per_call(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``fn`` over ``calls`` calls, the GPU drained before and after."""
    import time

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls


def bench_small(reps: int = 7, calls: int = 300) -> dict:
    """``torch.randn(1000, device="cuda", generator=g)`` per call: ember AES-128 vs Philox."""
    from ember.csprng import create_generator

    ge, gp = create_generator(0), torch.Generator(device="cuda").manual_seed(0)
    fns = {"ember": lambda: torch.randn(1000, device="cuda", generator=ge),
           "philox": lambda: torch.randn(1000, device="cuda", generator=gp)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        _wall_per_call(fn, 20)
    for _ in range(reps):
        for k, fn in fns.items():
            times[k].append(_wall_per_call(fn, calls))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"ember_us": med["ember"] * 1e6, "philox_us": med["philox"] * 1e6,
            "spread_us": {k: (min(v) * 1e6, max(v) * 1e6) for k, v in times.items()},
            "ratio": med["ember"] / med["philox"], "parts_us": _small_parts(ge)}


def _small_parts(g, calls: int = 300) -> dict:
    """Where the time of an ember ``randn(1000)`` goes (host and device), for diagnosis."""
    from ember.csprng import cuda_backend, cuda_fast

    x = torch.empty(1000, device="cuda")
    sampler = g.sampler()
    parts = {
        "torch.empty(1000, cuda)": lambda: torch.empty(1000, device="cuda"),
        "x.normal_(generator=g)": lambda: x.normal_(generator=g),
        "cuda_backend.cuda_fill": lambda: cuda_backend.cuda_fill(sampler, x, "normal_", ()),
        "cuda_fast.fast_fill_": lambda: cuda_fast.fast_fill_(sampler, x, "normal_", ()),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "Philox x.normal_": lambda: x.normal_(generator=torch.cuda.default_generators[0]),
    }
    out = {}
    for name, fn in parts.items():
        _wall_per_call(fn, 20)
        out[name] = statistics.median(_wall_per_call(fn, calls) for _ in range(3)) * 1e6
    return out


def bench_dp_noise(reps: int = 7, std: float = 1.1) -> dict:
    """Noise for every ResNet-18 parameter per step: ember ``normal_foreach_`` (AES-128) into
    preallocated tensors vs one ``torch.normal`` per tensor with Philox."""
    from ember.csprng import create_generator, normal_foreach_

    ge, gp = create_generator(0), torch.Generator(device="cuda").manual_seed(0)
    bufs = [torch.empty(s, device="cuda") for s in RESNET18_SHAPES]

    def philox() -> None:
        for s in RESNET18_SHAPES:
            torch.normal(0.0, std, s, generator=gp, device="cuda")

    fns = {"ember": lambda: normal_foreach_(bufs, std, generator=ge), "philox": philox}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        _wall_per_call(fn, 3)
    for _ in range(reps):
        for k, fn in fns.items():
            times[k].append(_wall_per_call(fn, 10))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tensors": len(RESNET18_SHAPES), "values": sum(math.prod(s) for s in RESNET18_SHAPES),
            "ember_ms": med["ember"] * 1e3, "philox_ms": med["philox"] * 1e3,
            "ratio": med["ember"] / med["philox"]}


_COLD = r"""
import os, sys, time
import torch
torch.cuda.init(); torch.empty(1, device="cuda"); torch.cuda.synchronize()
import ember.csprng as c
from ember.csprng.cuda_backend import fast_path
g = c.create_generator(1)
t = time.perf_counter()
x = torch.rand(10, device="cuda", generator=g); torch.cuda.synchronize()
first = time.perf_counter() - t
t = time.perf_counter()
for f in (lambda: torch.randn(10, device="cuda", generator=g),
          lambda: torch.randint(0, 7, (10,), device="cuda", generator=g),
          lambda: torch.empty(10, device="cuda").bernoulli_(0.3, generator=g),
          lambda: torch.empty(10, device="cuda", dtype=torch.float64).exponential_(generator=g)):
    f()
torch.cuda.synchronize()
print(f"COLD {first:.4f} {time.perf_counter() - t:.4f} {fast_path()}")
"""


def bench_cold(timeout: float = 120.0) -> dict:
    """First CUDA draw of a fresh process with empty kernel caches (NVRTC and Triton), after CUDA
    init; and four more methods after it."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, EMBER_CACHE_DIR=os.path.join(tmp, "ember"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        src = str(Path(__file__).resolve().parents[1] / "src")
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        try:
            proc = subprocess.run([sys.executable, "-c", _COLD], capture_output=True, text=True,
                                  timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"seconds": None, "error": f"timed out after {timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("COLD "):
            _, first, more, path = line.split()
            return {"seconds": float(first), "next_four_methods_s": float(more), "path": path}
    return {"seconds": None, "error": (proc.stderr or proc.stdout)[-2000:]}


def compile_only(arch: str = "sm_90") -> tuple[int, float, list[str]]:
    """Compile every kernel of both paths for ``arch`` without a GPU: (kernels, seconds, notes)."""
    import time

    notes: list[str] = []
    count = 0
    t0 = time.perf_counter()
    from ember.csprng import nvrtc_kernels

    if nvrtc_kernels.available():
        t = time.perf_counter()
        for name in nvrtc_kernels.KERNELS:  # one by one, as a process compiles them on first use
            nvrtc_kernels.compile_cubin(arch, name, use_cache=False)
        count += len(nvrtc_kernels.KERNELS)
        version = '.'.join(map(str, nvrtc_kernels.nvrtc_version()))
        notes.append(f"NVRTC {version}: {len(nvrtc_kernels.KERNELS)} kernels, "
                     f"{time.perf_counter() - t:.2f} s")
    else:
        notes.append("NVRTC: cuda-bindings / nvidia-cuda-nvrtc not installed, fast path not compiled")
    try:
        n, secs = _compile_triton(arch)
        count += n
        notes.append(f"Triton: {n} kernel variants, {secs:.2f} s")
    except Exception as exc:  # no triton, or a triton without an NVIDIA backend here
        notes.append(f"Triton: not compiled ({type(exc).__name__}: {exc})")
    return count, time.perf_counter() - t0, notes


def triton_variants() -> list[tuple[str, dict, dict]]:
    """(kernel, signature, constexprs) of the Triton fallback's kernel variants."""
    fill_sig = {"out_ptr": "*fp32", "tab_ptr": "*i32", "p_ptr": "*i32", "cnt_ptr": "*i32", "pos_ptr": "*i32",
                **{a: "i64" for a in ("fa", "fb", "fc", "fd", "ia", "ib", "ic", "c0", "c1", "c2", "c3",
                                      "skip", "n", "nlanes", "cap")}}
    out = []
    # (out type, op, wb, mbits, f64, flag, flag2, via) for the common calls
    cases = [("*fp32", 0, 4, 24, False, False, False, False), ("*fp32", 0, 4, 24, False, True, True, False),
             ("*fp64", 0, 8, 53, True, False, False, False), ("*fp16", 0, 2, 11, False, False, False, False),
             ("*i16", 0, 2, 8, False, False, False, True), ("*fp32", 3, 4, 24, False, False, False, False),
             ("*i64", 6, 4, 0, False, True, False, False), ("*i64", 6, 4, 0, False, False, False, False),
             ("*i32", 6, 4, 0, False, True, False, False), ("*i8", 7, 8, 0, False, False, False, False)]
    for cipher, block in ((0, 256), (1, 128)):
        for out_ty, op, wb, mbits, f64, flag, flag2, via in cases:
            sig = dict(fill_sig, out_ptr=out_ty)
            if op == 6 and not flag:  # Lemire: the list of rejected positions
                sig["pos_ptr"] = "*i64"
            out.append(("fill_kernel", sig, dict(CIPHER=cipher, OP=op, WB=wb, MBITS=mbits, F64=f64, FLAG=flag,
                                                  FLAG2=flag2, VIA_F32=via, BLOCK=block)))
    scalars = ("c0", "c1", "c2", "c3", "skip", "n", "pairs", "full_lanes", "full_programs",
               "su", "st", "std", "mean")
    nsig = {"out_ptr": "*fp32", "tab_ptr": "*i32", **{a: "i64" for a in scalars}}
    for cipher, block in ((0, 256), (1, 64)):
        for out_ty, wb, mbits, f64 in (("*fp32", 4, 24, False), ("*fp64", 8, 53, True)):
            out.append(("normal_fill_kernel", dict(nsig, out_ptr=out_ty),
                        dict(CIPHER=cipher, GROUP=16384, WB=wb, MBITS=mbits, F64=f64, AFFINE=True, LOG=False,
                             BF16=False, BLOCK=block)))
    # the one-program refill of rejected integers (block and warps as cuda_backend launches it)
    rsig = {"out_ptr": "*i64", "tab_ptr": "*i32", "cnt_ptr": "*i32", "pos_ptr": "*i64",
            **{a: "i64" for a in ("ia", "ib", "ic", "n", "cap")}}
    for cipher, block in ((0, 1024), (1, 256)):
        for wb in (4, 8):
            out.append(("refill_kernel", rsig, dict(CIPHER=cipher, WB=wb, VIA_F32=False, BLOCK=block)))
    return out


def _compile_triton(arch: str) -> tuple[int, float]:
    import time

    import triton
    import triton.backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ember.csprng.cuda_backend import kernels

    if "nvidia" not in triton.backends.backends:
        raise RuntimeError("triton has no NVIDIA backend")
    import os
    import tempfile

    k = kernels(False)
    cap = int(arch.split("_")[1])
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="ember-triton-")  # a cold cache
    t = time.perf_counter()
    n = 0
    for name, sig, consts in triton_variants():
        fn = getattr(k, name)
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()})
        warps = 8 if name == "refill_kernel" and consts["BLOCK"] >= 256 else 4
        triton.compile(src, target=GPUTarget("cuda", cap, 32),
                       options={"enable_fp_fusion": False, "num_warps": warps})
        n += 1
    return n, time.perf_counter() - t


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
    ap.add_argument("--compile-only", action="store_true",
                    help="compile every kernel for sm_90 (no GPU needed) and report the time")
    ap.add_argument("--arch", default="sm_90", help="architecture for --compile-only")
    args = ap.parse_args(argv)
    if args.compile_only:
        count, secs, notes = compile_only(args.arch)
        for note in notes:
            print(note)
        print(f"compile: {count} kernels, {secs:.1f} s")
        return 0 if count else 1
    reason = no_gpu_reason()
    if reason is not None:
        print(f"bench/csprng_cuda.py: {reason}; nothing measured.")
        return 0
    from ember.csprng.cuda_backend import fast_path

    print(f"device: {torch.cuda.get_device_name()}; ember CUDA path: {fast_path()}")
    cold = bench_cold()  # first, so that nothing of this process warms its caches
    print(f"first draw in a fresh process, empty cache: {cold}")
    mib, reps = (16, 3) if args.quick else (args.mib, args.reps)
    matches = check_matches_cpu()
    print(f"CUDA output equals the CPU output for the same seed: {'yes' if matches else 'NO'}")
    rows = run(mib, reps)
    print(format_table(rows))
    extra = {"cold": cold, "small": bench_small(3 if args.quick else 7),
             "dp_noise": bench_dp_noise(3 if args.quick else 7)}
    s, d = extra["small"], extra["dp_noise"]
    print(f"\nrandn(1000) per call: ember {s['ember_us']:.1f} us, Philox {s['philox_us']:.1f} us, "
          f"ratio {s['ratio']:.2f}")
    print("  parts (us per call): " + ", ".join(f"{k} {v:.1f}" for k, v in s["parts_us"].items()))
    print(f"ResNet-18 DP noise ({d['tensors']} tensors, {d['values'] / 1e6:.1f} M values): ember "
          f"normal_foreach_ {d['ember_ms']:.3f} ms, Philox per tensor {d['philox_ms']:.3f} ms, "
          f"ratio {d['ratio']:.2f}")
    met = goals(rows, extra)
    print("\ngoals:")
    for gl in met:
        print(f"  {gl['goal']:<44}{gl['value']:>8.2f}  {'met' if gl['met'] else 'NOT met'}")
    try:  # blocks per SM of each NVRTC kernel used (occupancy), for diagnosis
        from ember.csprng import cuda_fast

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        resident = {k[1]: v // sms for k, v in getattr(cuda_fast.launcher(), "_resident", {}).items()}
        print("NVRTC kernels, resident blocks per SM: " + ", ".join(f"{k} {v}" for k, v in resident.items()))
    except Exception as exc:  # the Triton path, or no launcher
        resident = {"error": str(exc)}
    meta = {
        "resident_blocks_per_sm": resident,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "triton": _version("triton"),
        "path": fast_path(),
        "python": platform.python_version(),
        "reps": reps,
        "statistic": "median",
        "matches_cpu": matches,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows, "extra": extra, "goals": met}, indent=2))
    print(f"wrote {args.json}")
    return 0 if matches else 1


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
