"""Cost of SWAG collection/sampling and EMA updates relative to a training step (CPU, ~25 M params).

Run: ``.venv/bin/python bench/swa.py`` (about a minute; ``--quick``: 3 rounds). Prints a table and
writes ``bench/results/swa.json``. Goals: ember's EMA update no slower than the fastest
baseline (torch ``AveragedModel`` with ``get_ema_multi_avg_fn``, a timm-style
``torch._foreach_lerp_`` loop); SWAG collection at one per 10 steps < 5% of a training step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torch.optim import swa_utils

from ember.swa import EMA, SWA, SWAG


def _model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, 1000),
    )


def _timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=4096, help="hidden width (4096: 25.1 M params)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-rank", type=int, default=20)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of --reps")
    ap.add_argument("--out", default="bench/results/swa.json")
    args = ap.parse_args()
    if args.quick:
        args.reps = 3

    torch.manual_seed(0)
    model = _model(args.width)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(args.batch, 1024)
    y = torch.randint(0, 1000, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()

    def fwd_bwd():
        opt.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()

    def train_step():
        fwd_bwd()
        opt.step()

    swag = SWAG(model, max_rank=args.max_rank)
    for _ in range(2):  # fill two rows so that the low-rank term exists; warm the pages
        train_step()
        swag.collect(model)
    ema = EMA(model, decay=0.999)
    ref = swa_utils.AveragedModel(model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.999))
    ref.update_parameters(model)
    g = torch.Generator().manual_seed(0)
    swa = SWA(model)
    # timm ModelEmaV3-style baseline: the averaged tensors and the live ones, one foreach lerp
    timm_avg = [t.detach().clone() for t in model.state_dict().values() if t.is_floating_point()]

    def timm_ema():
        with torch.no_grad():
            live = [t.detach() for t in model.state_dict().values() if t.is_floating_point()]
            torch._foreach_lerp_(timm_avg, live, 1.0 - 0.999)

    ops = {
        "fwd_bwd": fwd_bwd,
        "train_step": train_step,
        "collect": lambda: swag.collect(model),
        "sample": lambda: swag.sample(generator=g),
        "sample_diag": lambda: swag.sample(1.0, diag_only=True, generator=g),
        "ema_foreach": lambda: ema.update(model),
        "ema_loop": lambda: ema_loop.update(model),
        "averaged_model_ema": lambda: ref.update_parameters(model),
        "timm_foreach_lerp_ema": timm_ema,
        "swa_update": lambda: swa.update(model),
    }
    ema_loop = EMA(model, decay=0.999, foreach=False)
    # every round runs each operation once, so CPU speed drifting over the run (other processes,
    # frequency) hits all of them alike; round 0 is warm-up and is dropped
    times: dict[str, list[float]] = {k: [] for k in ops}
    for r in range(args.reps + 1):
        for k, fn in ops.items():
            t = _timed(fn, 1)
            if r:
                times[k] += t
    t_fb, t_step, t_collect = times["fwd_bwd"], times["train_step"], times["collect"]
    t_sample, t_sample_diag = times["sample"], times["sample_diag"]
    t_ema, t_ema_loop, t_ref = times["ema_foreach"], times["ema_loop"], times["averaged_model_ema"]

    med = statistics.median
    step = med(t_step)
    rows = [
        ("forward+backward", med(t_fb)),
        ("train step (fwd+bwd+SGD step)", step),
        (f"SWAG collect (max_rank={args.max_rank})", med(t_collect)),
        ("SWAG sample (full rank)", med(t_sample)),
        ("SWAG sample (diag only)", med(t_sample_diag)),
        ("ember EMA update (foreach)", med(t_ema)),
        ("ember EMA update (per-tensor loop)", med(t_ema_loop)),
        ("torch AveragedModel EMA update", med(t_ref)),
        ("timm-style _foreach_lerp_ EMA", med(times["timm_foreach_lerp_ema"])),
        ("ember SWA update", med(times["swa_update"])),
    ]
    amortised = med(t_collect) / (100 * step)
    at_10 = med(t_collect) / (10 * step)
    fastest = min(med(t_ref), med(times["timm_foreach_lerp_ema"]))
    ema_ratio = med(t_ema) / fastest
    print(f"model: {n_params / 1e6:.1f} M parameters, batch {args.batch}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"SWAG memory: {swag.memory_bytes / 2**30:.2f} GiB ((2 + {args.max_rank}) x P x 4 bytes)")
    print(f"{'operation':<40}{'median ms':>12}{'x fwd+bwd':>12}")
    for name, t in rows:
        print(f"{name:<40}{t * 1e3:>12.1f}{t / med(t_fb):>12.3f}")
    print(f"SWAG collection cost at 1 per 100 steps: {100 * amortised:.2f}% of training time "
          f"(goal < 10%: {'met' if amortised < 0.10 else 'NOT met'})")
    print(f"SWAG collection cost at 1 per 10 steps: {100 * at_10:.2f}% of a training step "
          f"(goal < 5%: {'met' if at_10 < 0.05 else 'NOT met'})")
    print(f"ember EMA / fastest baseline EMA: {ema_ratio:.3f} "
          f"(goal <= 1: {'met' if ema_ratio <= 1.0 else 'NOT met'}; noisy on a shared CPU)")

    result = {
        "params": n_params,
        "batch": args.batch,
        "max_rank": args.max_rank,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "swag_memory_bytes": swag.memory_bytes,
        "median_seconds": {name: t for name, t in rows},
        "samples_seconds": times,
        "collect_fraction_at_1_per_100_steps": amortised,
        "goal_met": amortised < 0.10,
        "collect_fraction_at_1_per_10_steps": at_10,
        "ema_over_fastest_baseline": ema_ratio,
        "goals": {"ema_no_slower": ema_ratio <= 1.0, "collect_below_5pct": at_10 < 0.05},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
