"""Side-by-side throughput of ember.csprng against torch's default CPU generator.

Each row times the same call with ``generator=`` an ember generator and a plain ``torch.Generator``
in one process, interleaving the two so that drifts in machine speed hit both alike.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from .ciphers import get_cipher
from .generator import create_generator, for_torch

MiB = 1 << 20
# the speed goals: ratio to torch's default generator, by (case, MiB); fresh-output cases by name
GOALS = {("rand float32", 64): 6.0, ("rand float32", 1): 4.0, ("randn float32", 64): 2.5,
         ("randn float32", 1): 1.5, ("randint int64", 64): 3.0, ("randperm 1e7", None): 2.0,
         ("rand float32 fresh", 64): 4.0, ("randn float32 fresh", 64): 2.0,
         ("randint int64 fresh", 64): 2.0}
# the small-call CPU goal: torch.randn(1000) per call at most 3x torch's, i.e. a ratio of at least 1/3
SMALL_CALL_GOALS = {"randn(1000) per call": 1 / 3}
SMALL_CALLS = 200  # calls per timed repetition of a small-call row
KEYSTREAM_SHARE_GOAL = 0.70  # uniform float32 at 64 MiB against the two-thread keystream rate
REPS = 5  # interleaved repetitions per row (the median and spread of these are reported)


def _goal(case: str, mib: int | None) -> float | None:
    return GOALS.get((case, mib), GOALS.get((case, None)))


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def load_average() -> float | None:
    """The machine's 1-minute load average where the OS reports one (not on Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def interleaved(fns: dict[str, Callable[[], object]], reps: int = REPS, inner: int = 1
                ) -> dict[str, list[float]]:
    """Seconds per call of each function, one figure per repetition: in every repetition each
    function in turn runs once untimed and then ``inner`` timed calls, of which the best counts.

    The untimed call first: torch's CPU kernels leave their OpenMP threads spinning for a while
    after a parallel region (libgomp's default wait policy), and on a 2-vCPU machine that slowed
    whatever ran next by up to 2x (an ember rand of 1 MiB took 381 us right after torch's, 211 us
    right after ember's own). Each side is timed after itself, as in a loop that draws repeatedly,
    and the sides alternate within every repetition, so a drift of the machine's speed hits all.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            fn()
            times[name].append(_best(fn, inner))
    return times


def _spread(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"median": float(med), "min": float(a.min()), "max": float(a.max()),
            "q1": float(q1), "q3": float(q3)}


def pair_row(case: str, nbytes: int, make: Callable[[torch.Generator], Callable[[], object]],
             reps: int = REPS, inner: int = 1, goal: float | None = None,
             extra: Mapping[str, Callable[[], object]] | None = None) -> dict:
    """One row: ember against torch's generator on the same call, ``reps`` interleaved
    repetitions; the ratio is the median of the per-repetition ratios, with their min-max and
    interquartile range, and the load average before and after."""
    ember, plain = create_generator(0), torch.Generator().manual_seed(0)
    fns = {"ember": make(for_torch(ember)), "torch": make(plain), **(extra or {})}
    load_before = load_average()
    t = interleaved(fns, reps, inner)
    ratios = [b / a for a, b in zip(t["ember"], t["torch"], strict=True)]
    r = _spread(ratios)
    row = {"case": case, "size_mib": nbytes // MiB, "reps": reps,
           "ember_gbps": nbytes / float(np.median(t["ember"])) / 1e9,
           "torch_gbps": nbytes / float(np.median(t["torch"])) / 1e9,
           "ratio": r["median"], "ratio_min": r["min"], "ratio_max": r["max"],
           "ratio_q1": r["q1"], "ratio_q3": r["q3"], "goal": goal,
           "load_before": load_before, "load_after": load_average(),
           "ember_s": t["ember"], "torch_s": t["torch"]}
    for name in extra or {}:
        row[f"{name}_s"] = t[name]
    return row


def keystream_gbps(nbytes: int = 64 * MiB, repeat: int = 5) -> float:
    """Raw AES-128-CTR keystream into a preallocated buffer (the ceiling for ember's output)."""
    buf = np.empty(nbytes, np.uint8)
    mv = buf.data
    aes = get_cipher("aes128")
    return nbytes / _best(lambda: aes.keystream(bytes(16), 0).fill(mv), repeat) / 1e9


def keystream2_call(nbytes: int = 64 * MiB, threads: int = 2) -> Callable[[], None]:
    """A call that makes ``nbytes`` of raw keystream on ``threads`` threads, each filling its own
    part of one buffer (4 MiB pieces taken in turn, as ember's draws share their chunks)."""
    from concurrent.futures import ThreadPoolExecutor

    buf = np.empty(nbytes, np.uint8)
    buf.fill(0)  # fault the pages in now, not in the first timed call
    mv = buf.data
    aes = get_cipher("aes128")
    piece = 4 * MiB
    starts = list(range(0, nbytes, piece))
    pool = ThreadPoolExecutor(threads - 1)

    def part(k: int) -> None:
        for a in starts[k::threads]:
            aes.keystream(bytes(16), a // 16).fill(mv[a: a + piece])

    def both() -> None:
        futures = [pool.submit(part, k) for k in range(1, threads)]
        part(0)
        for f in futures:
            f.result()

    return both


def _fresh_cases(nbytes: int):
    n32, n64 = nbytes // 4, nbytes // 8
    return [
        ("rand float32 fresh", lambda g: lambda: torch.rand(n32, generator=g)),
        ("randn float32 fresh", lambda g: lambda: torch.randn(n32, generator=g)),
        ("randint int64 fresh", lambda g: lambda: torch.randint(0, 1000, (n64,), generator=g)),
    ]


def run_fresh(mib: int = 64, repeat: int = REPS) -> list[dict]:
    """What users call: fresh outputs (``torch.rand(n, generator=g)``), which both sides pay for
    faulting in new pages; ``repeat`` interleaved repetitions of one call each."""
    return [pair_row(name, mib * MiB, make, max(repeat, REPS), 1, _goal(name, mib))
            for name, make in _fresh_cases(mib * MiB)]


def _cases(nbytes: int) -> list[tuple[str, int, Callable[[torch.Generator], Callable[[], object]]]]:
    n32, n64 = nbytes // 4, nbytes // 8
    out32 = torch.empty(n32)
    out64 = torch.empty(n64, dtype=torch.int64)
    p = torch.full((n32,), 0.3)
    return [
        ("rand float32", nbytes, lambda g: lambda: torch.rand(n32, generator=g, out=out32)),
        ("randn float32", nbytes, lambda g: lambda: torch.randn(n32, generator=g, out=out32)),
        ("randint int64", nbytes,
         lambda g: lambda: torch.randint(0, 1000, (n64,), generator=g, out=out64)),
        ("bernoulli float32", nbytes, lambda g: lambda: out32.bernoulli_(0.3, generator=g)),
        ("bernoulli(p tensor)", nbytes, lambda g: lambda: torch.bernoulli(p, generator=g)),
    ]


def run(quick: bool = False, sizes_mib: tuple[int, ...] | None = None,
        fresh: bool = False, reps: int = REPS) -> list[dict]:
    """Rows of ember vs torch throughput (GB/s of output; ratio median and spread over ``reps``
    interleaved repetitions; load average), and the keystream ceilings (one thread, and two
    threads: the rate uniform float32 is compared with, in the same repetitions). With
    ``fresh``, also the fresh-output rows of :func:`run_fresh`."""
    reps = max(reps, REPS)
    sizes = sizes_mib or ((1, 16) if quick else (1, 64))
    rows: list[dict] = []
    kmib = 16 if quick else 64
    load = load_average()
    ceiling = keystream_gbps(kmib * MiB, reps)
    rows.append({"case": "AES-128-CTR keystream", "size_mib": kmib, "reps": reps,
                 "ember_gbps": ceiling, "torch_gbps": None, "ratio": None, "goal": None,
                 "load_before": load, "load_after": load_average()})
    for mib in sizes:
        # best of several calls per repetition for short calls (both sides alike): on a shared VM
        # a 1 MiB call's time varies by tens of percent from one call to the next
        inner = max(1, 64 // (8 * mib))
        for name, nbytes, make in _cases(mib * MiB):
            extra = None
            if name == "rand float32" and mib == max(sizes):
                extra = {"keystream2": keystream2_call(nbytes)}
            row = pair_row(name, nbytes, make, reps, inner, _goal(name, mib), extra)
            if extra:
                shares = [k / e for e, k in zip(row["ember_s"], row["keystream2_s"], strict=True)]
                s = _spread(shares)
                row.update(of_keystream2=s["median"], of_keystream2_min=s["min"],
                           of_keystream2_max=s["max"],
                           keystream2_gbps=nbytes / float(np.median(row["keystream2_s"])) / 1e9)
                if mib == 64:
                    row["keystream2_goal"] = KEYSTREAM_SHARE_GOAL
            rows.append(row)
    n = 10**6 if quick else 10**7
    name = "randperm 1e7" if n == 10**7 else "randperm 1e6"
    rows.append(pair_row(name, n * 8, lambda g: lambda: torch.randperm(n, generator=g), reps, 1,
                         _goal(name, None)))
    if fresh:
        rows += run_fresh(16 if quick else 64, reps)
    rows += run_small(reps)
    return rows


def run_small(reps: int = REPS, calls: int = SMALL_CALLS) -> list[dict]:
    """Small calls, where the per-call cost (routing, set-up) decides: ``calls`` calls per
    repetition, ember and torch interleaved; ``ember_us``/``torch_us`` are medians per call."""
    x = torch.empty(1000)
    cases = [
        ("randn(1000) per call", 4000, lambda g: torch.randn(1000, generator=g)),
        ("rand(1000) per call", 4000, lambda g: torch.rand(1000, generator=g)),
        # Opacus's noise call (five per parameter tensor and step in secure mode)
        ("normal(0, .5, 1000) per call", 4000,
         lambda g: torch.normal(mean=0, std=0.5, size=(1000,), device="cpu", generator=g)),
        ("x.normal_() 1000 per call", 4000,
         lambda g: x.normal_(generator=g)),
        ("randn(10) per call", 40, lambda g: torch.randn(10, generator=g)),
    ]
    rows = []
    for case, nbytes, one in cases:
        def make(g: torch.Generator, one=one) -> Callable[[], object]:
            def many() -> None:
                for _ in range(calls):
                    one(g)
            return many

        row = pair_row(case, nbytes * calls, make, max(reps, REPS), 3,
                       SMALL_CALL_GOALS.get(case))
        row["size_mib"] = 0
        row["calls"] = calls
        row["ember_us"] = float(np.median(row["ember_s"])) / calls * 1e6
        row["torch_us"] = float(np.median(row["torch_s"])) / calls * 1e6
        rows.append(row)
    return rows


def call_overhead_us(number: int = 20000) -> dict[str, float]:
    """Microseconds per call: what routing adds to torch's own random calls, and small ember draws."""
    import timeit

    from . import torch_adapter

    original = torch_adapter._ORIGINALS.get((torch, "rand"), torch.rand)
    plain, ember = torch.Generator(), for_torch(create_generator(0))
    x = torch.empty(4)

    def us(fn: Callable[[], object]) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    return {
        "torch.add (not routed)": us(lambda: torch.add(x, x)),
        "torch.rand(4), routed": us(lambda: torch.rand(4, generator=plain)),
        "torch.rand(4), original": us(lambda: original(4, generator=plain)),
        "torch.rand(4, ember)": us(lambda: torch.rand(4, generator=ember)),
        "x.normal_(ember), 4 values": us(lambda: x.normal_(generator=ember)),
    }


def format_table(rows: list[dict]) -> str:
    """The rows as a table: ratio = median of the repetitions' ratios [min-max], load = the
    1-minute load average before/after the row."""
    head = (f"{'case':<26}{'MiB':>5}{'reps':>5}{'ember GB/s':>11}{'torch GB/s':>11}"
            f"{'ratio [min-max]':>20}{'goal':>7}{'met':>5}{'load':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        torch_s = f"{r['torch_gbps']:.2f}" if r.get("torch_gbps") is not None else "-"
        ratio = "-"
        if r.get("ratio") is not None:
            ratio = f"{r['ratio']:.2f}x"
            if r.get("ratio_min") is not None:
                ratio += f" [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}]"
        goal = f"{r['goal']:.2g}x" if r.get("goal") else "-"
        met = "-" if not r.get("goal") else ("yes" if r["ratio"] >= r["goal"] else "no")
        lb, la = r.get("load_before"), r.get("load_after")
        load = "-" if lb is None else f"{lb:.1f}/{la:.1f}"
        line = (f"{r['case']:<26}{r['size_mib']:>5}{r.get('reps', 1):>5}{r['ember_gbps']:>11.2f}"
                f"{torch_s:>11}{ratio:>20}{goal:>7}{met:>5}{load:>11}")
        if "of_keystream2" in r:
            line += (f"\n{'':<26}uniform = {r['of_keystream2']:.0%} [{r['of_keystream2_min']:.0%}-"
                     f"{r['of_keystream2_max']:.0%}] of the two-thread keystream "
                     f"({r['keystream2_gbps']:.2f} GB/s)")
            if "keystream2_goal" in r:
                ok = "met" if r["of_keystream2"] >= r["keystream2_goal"] else "not met"
                line += f"; goal {r['keystream2_goal']:.0%}: {ok}"
        if "ember_us" in r:
            line += (f"\n{'':<26}per call: ember {r['ember_us']:.1f} us, torch {r['torch_us']:.1f} us"
                     f" ({r['ember_us'] / r['torch_us']:.2f}x torch's time)")
        lines.append(line)
    return "\n".join(lines)
