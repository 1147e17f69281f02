"""Pre-specified experiment: does an EMA of DP-SGD's iterates help, at the same epsilon?

The protocol is fixed in docs/experiments/train.md ("Averaging private iterates"): digits, MLP 64-128-10,
epsilon 2.0, delta 1e-5, C = 1.0, batch 64, 30 epochs; constant vs cosine-annealed lr, final
iterate vs EMA (decay 0.99); seeds 0, 1, 2. Prints a table and writes JSON. ``--quick`` (2 epochs,
1 seed) only checks that it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from ember.train import PrivacyConfig, TrainConfig, evaluate, fit

EPSILON, DELTA, CLIP, BATCH, LR, DECAY = 2.0, 1e-5, 1.0, 64, 0.2, 0.99


def _data() -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    tr, te = train_test_split(np.arange(len(y)), test_size=0.3, random_state=0, stratify=y)
    x = torch.tensor(x, dtype=torch.float32) / 16
    y = torch.tensor(y, dtype=torch.int64)
    return (torch.utils.data.TensorDataset(x[tr], y[tr]),
            torch.utils.data.TensorDataset(x[te], y[te]))


def run(schedule: str, seed: int, epochs: int, train, test) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = torch.utils.data.DataLoader(train, batch_size=BATCH, shuffle=True)
    steps = epochs * len(loader)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=0.0) \
        if schedule == "cosine" else None
    config = TrainConfig(epochs=epochs, ema_decay=DECAY, progress=False,
                         scheduler_interval="step")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fit(model, opt, loader, config, scheduler=sched,
                     privacy=PrivacyConfig(epsilon=EPSILON, delta=DELTA, max_grad_norm=CLIP))
    test_loader = torch.utils.data.DataLoader(test, batch_size=512)
    final, ema = evaluate(result.model, test_loader), evaluate(result.ema.module, test_loader)
    return {"schedule": schedule, "seed": seed, "epsilon": result.epsilon,
            "noise_multiplier": result.noise_multiplier, "steps": result.steps,
            "final_accuracy": final["accuracy"], "final_nll": final["nll"],
            "ema_accuracy": ema["accuracy"], "ema_nll": ema["nll"]}


def _ms(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.mean(values):.4f} +- {sd:.4f}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 epochs, 1 seed: a check that it runs")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "dp_ema.json")
    args = p.parse_args(argv)
    epochs, seeds = (2, [0]) if args.quick else (30, [0, 1, 2])
    print(f"load average: {os.getloadavg() if hasattr(os, 'getloadavg') else 'n/a'}")
    train, test = _data()
    runs, t0 = [], time.perf_counter()
    for schedule in ("constant", "cosine"):
        for seed in seeds:
            runs.append(run(schedule, seed, epochs, train, test))
    print(f"{'schedule':9s} {'arm':6s} {'accuracy (mean +- std)':24s} {'NLL (mean +- std)':24s}")
    summary = {}
    for schedule in ("constant", "cosine"):
        rs = [r for r in runs if r["schedule"] == schedule]
        for arm in ("final", "ema"):
            print(f"{schedule:9s} {arm:6s} {_ms([r[f'{arm}_accuracy'] for r in rs]):24s} "
                  f"{_ms([r[f'{arm}_nll'] for r in rs]):24s}")
        diff = [r["ema_accuracy"] - r["final_accuracy"] for r in rs]
        sd = statistics.stdev(diff) if len(diff) > 1 else float("nan")
        helps = all(d > 0 for d in diff) and statistics.mean(diff) > sd
        summary[schedule] = {"ema_minus_final_accuracy": diff, "mean": statistics.mean(diff),
                             "std": sd, "verdict": "EMA helps" if helps else "no gain"}
        print(f"{schedule:9s} EMA - final accuracy per seed {[round(d, 4) for d in diff]}: "
              f"{summary[schedule]['verdict']}")
    print(f"epsilon {runs[0]['epsilon']:.3f} (target {EPSILON}), sigma "
          f"{runs[0]['noise_multiplier']:.3f}, {runs[0]['steps']} steps; "
          f"{time.perf_counter() - t0:.0f} s")
    result = {"quick": args.quick, "torch": torch.__version__, "runs": runs, "summary": summary,
              "protocol": "docs/experiments/train.md, Averaging private iterates"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
