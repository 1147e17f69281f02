"""The tuning step of the SWA benches' cosine-annealed SGD baseline (docs/experiments/swa-family.md).

Not an experiment of ``bench/swa_family.py``; the benches load it by path (they are loaded so too).
The baseline's peak learning rate is chosen from a grid fixed in advance ({0.25, 0.5, 1, 2} x
the method's own rate; quick: {0.5, 1} x) by the mean validation NLL over the experiment's seeds,
on a stratified 20% of the TRAINING data (the test sets are never looked at); the baseline is
then trained on the whole training set at the chosen rate by the bench itself.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

FACTORS = (0.25, 0.5, 1.0, 2.0)
QUICK_FACTORS = (0.5, 1.0)
VAL_FRACTION = 0.2
SPLIT_SEED = 0


def sgd_epoch(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
              order: torch.Generator, batch: int = 32) -> None:
    """One epoch of minibatch SGD on cross-entropy in an order drawn from ``order``; a last batch
    of one example is skipped (BatchNorm needs two)."""
    model.train()
    perm = torch.randperm(len(y), generator=order)
    for i in range(0, len(perm), batch):
        idx = perm[i:i + batch]
        if len(idx) < 2:
            continue
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()


def train_cosine(model: nn.Module, opt: torch.optim.Optimizer, seed: int, epochs: int,
                 x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """Train ``model`` for ``epochs`` epochs of :func:`sgd_epoch` (data order from ``seed``) with
    ``opt``'s rate cosine-annealed per epoch to 0; returns ``model``."""
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    order = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        sgd_epoch(model, opt, x, y, order)
        sched.step()
    return model


def grid(base_lr: float, quick: bool) -> list[float]:
    """The pre-declared learning rates around ``base_lr``."""
    return [base_lr * f for f in (QUICK_FACTORS if quick else FACTORS)]


def validation_split(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(x_fit, y_fit, x_val, y_val): a stratified ``VAL_FRACTION`` of the training examples held out."""
    from sklearn.model_selection import train_test_split

    idx = torch.arange(len(y)).numpy()
    fit_idx, val_idx = train_test_split(idx, test_size=VAL_FRACTION, stratify=y.numpy(),
                                        random_state=SPLIT_SEED)
    fit_idx, val_idx = torch.as_tensor(fit_idx), torch.as_tensor(val_idx)
    return x[fit_idx], y[fit_idx], x[val_idx], y[val_idx]


@torch.no_grad()
def _score(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    logits = model(x).double()
    nll = nn.functional.cross_entropy(logits, y).item()
    acc = (logits.argmax(1) == y).double().mean().item()
    return (nll if math.isfinite(nll) else math.inf), acc


def tune_lr(train: Callable[[float, int, torch.Tensor, torch.Tensor], nn.Module],
            x: torch.Tensor, y: torch.Tensor, seeds: Sequence[int], base_lr: float, *,
            quick: bool) -> dict[str, Any]:
    """Train ``train(lr, seed, x_fit, y_fit)`` for every grid rate and seed, score it on the held-out
    split and return ``{"chosen_lr", "grid", "validation": [{lr, val_nll, val_accuracy, ...}]}``."""
    x_fit, y_fit, x_val, y_val = validation_split(x, y)
    table = []
    for lr in grid(base_lr, quick):
        nlls, accs = [], []
        for seed in seeds:
            nll, acc = _score(train(lr, seed, x_fit, y_fit), x_val, y_val)
            nlls.append(nll)
            accs.append(acc)
        table.append({"lr": lr, "val_nll": statistics.fmean(nlls),
                      "val_accuracy": statistics.fmean(accs), "val_nll_per_seed": nlls,
                      "val_accuracy_per_seed": accs})
    best = min(table, key=lambda r: (r["val_nll"], -r["val_accuracy"]))
    return {"chosen_lr": best["lr"], "grid": [r["lr"] for r in table], "validation": table,
            "n_fit": len(y_fit), "n_val": len(y_val), "seeds": list(seeds)}


def describe(tuning: dict[str, Any]) -> str:
    """One line per grid rate, the chosen one marked."""
    lines = [f"tuned cosine-SGD lr (validation split {tuning['n_val']} of "
             f"{tuning['n_val'] + tuning['n_fit']} training examples):"]
    for r in tuning["validation"]:
        mark = "  <- chosen" if r["lr"] == tuning["chosen_lr"] else ""
        lines.append(f"  lr {r['lr']:<8g} val NLL {r['val_nll']:.4f}  val acc "
                     f"{r['val_accuracy']:.4f}{mark}")
    return "\n".join(lines)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, std (0 for one value), min and max of one metric over seeds."""
    vals = list(values)
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "min": min(vals), "max": max(vals)}


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SWA benches' data: scikit-learn's digits as (N, 1, 8, 8) float32 in [0, 1], split
    70/30 stratified with random_state=0; returns x_train, y_train, x_test, y_test."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.3, stratify=y, random_state=0)
    f = lambda a: torch.tensor(a / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)  # noqa: E731
    return f(xtr), torch.tensor(ytr), f(xte), torch.tensor(yte)


def add_scores(per: dict[tuple[str, str], dict[str, list[float]]], method: str,
               by_set: dict[str, dict[str, float]]) -> None:
    """Append one seed's metrics of ``method`` (test set -> metric -> value) to ``per``."""
    for name, m in by_set.items():
        cell = per.setdefault((method, name), {})
        for k, v in m.items():
            cell.setdefault(k, []).append(v)


def summary_rows(experiment: str, per: dict[tuple[str, str], dict[str, list[float]]],
                 n_seeds: int, tuned_method: str, tuning: dict[str, Any]) -> list[dict]:
    """One row per (method, test set): every metric's :func:`summarize` over the seeds, and the
    tuning record on the tuned baseline's rows."""
    rows = []
    for (method, name), cell in per.items():
        row: dict = {"experiment": experiment, "method": method, "test_set": name,
                     "n_seeds": n_seeds}
        if method == tuned_method:
            row["tuned_lr"] = tuning["chosen_lr"]
            row["tuning"] = tuning
        for k, vals in cell.items():
            for stat, v in summarize(vals).items():
                row[f"{k}_{stat}"] = v
        rows.append(row)
    return rows


def write_results(name: str, protocol: str, quick: bool, rows: list[dict], t0: float) -> Path:
    """Write ``bench/results/<name>.json`` (protocol, quick, rows, total wall time since ``t0``)
    and say so."""
    out = Path(__file__).resolve().parent / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"protocol": protocol, "quick": quick, "rows": rows,
                               "total_wall_s": time.perf_counter() - t0}, indent=2))
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    return out
