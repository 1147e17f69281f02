"""A real small experiment: SGD vs SWA vs SWAG on scikit-learn's bundled digits data.

The baselines: the final iterate of the SWA run (constant rate) and, the strongest simple one,
SGD with the rate cosine-annealed to 0 over the same number of epochs, from the same initial
weights and data order, its peak rate tuned: chosen from {0.25, 0.5, 1, 2} x the SWA
run's 0.1 by the mean validation NLL over the seeds, training on 80% of the training set and
scoring on a stratified 20% held out from it (never the test set); then trained on the whole
training set at that rate. Against it SWA and SWAG show no measurable gain (docs/swa.md).

Run ``.venv/bin/python tests/swa/test_digits.py`` (add ``--full`` for the slow version) to print the
per-seed table.
"""

from __future__ import annotations

import statistics
import sys

import pytest
import torch
from torch import nn

from ember.swa import (
    SWA,
    SWAG,
    accuracy,
    bayesian_average,
    expected_calibration_error,
    nll,
    update_bn,
)

sklearn = pytest.importorskip("sklearn")


def _data(split_seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=0.4, random_state=split_seed, stratify=y
    )
    mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-6
    to_x = lambda a: torch.tensor((a - mu) / sd, dtype=torch.float32)
    to_y = lambda a: torch.tensor(a, dtype=torch.long)
    return to_x(x_tr), to_y(y_tr), to_x(x_te), to_y(y_te)


def _batches(x, y, size, generator=None):
    order = torch.randperm(len(x), generator=generator) if generator is not None else None
    idx = order if order is not None else torch.arange(len(x))
    return [(x[idx[i : i + size]], y[idx[i : i + size]]) for i in range(0, len(x), size)]


def _probs(model, x):
    model.eval()
    with torch.no_grad():
        return torch.softmax(model(x), dim=1)


LR = 0.1
LR_FACTORS = (0.25, 0.5, 1.0, 2.0)  # the tuning grid, fixed before the runs (docs/swa.md)


def _make(seed: int, lr: float, wd: float = 5e-4):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))
    return net, torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=wd)


def train_cosine(seed: int, lr: float, total_epochs: int, x_tr, y_tr, wd: float = 5e-4):
    """SGD from ``seed``'s initial weights and data order, the rate cosine-annealed per epoch from
    ``lr`` to 0 over ``total_epochs``; returns the final model."""
    loss_fn = nn.CrossEntropyLoss()
    model, opt = _make(seed, lr, wd)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_epochs)
    g = torch.Generator().manual_seed(seed)
    for _ in range(total_epochs):
        model.train()
        for xb, yb in _batches(x_tr, y_tr, 32, g):
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()
        cosine.step()
    return model


def tune_cosine_lr(seeds, total_epochs: int, lr: float = LR):
    """The grid rate with the lowest mean validation NLL over ``seeds`` (ties: higher accuracy),
    on a stratified 20% of the training set (random_state=0); returns (chosen, table)."""
    from sklearn.model_selection import train_test_split

    x_tr, y_tr, _, _ = _data()
    fit_idx, val_idx = train_test_split(
        torch.arange(len(y_tr)).numpy(), test_size=0.2, stratify=y_tr.numpy(), random_state=0
    )
    x_fit, y_fit = x_tr[torch.as_tensor(fit_idx)], y_tr[torch.as_tensor(fit_idx)]
    x_val, y_val = x_tr[torch.as_tensor(val_idx)], y_tr[torch.as_tensor(val_idx)]
    table = []
    for factor in LR_FACTORS:
        cand = lr * factor
        ps = [_probs(train_cosine(s, cand, total_epochs, x_fit, y_fit), x_val) for s in seeds]
        val_nll = statistics.fmean(nll(p, y_val) if torch.isfinite(p).all() else float("inf")
                                   for p in ps)
        table.append((cand, val_nll, statistics.fmean(accuracy(p, y_val) for p in ps)))
    chosen = min(table, key=lambda r: (r[1], -r[2]))[0]
    return chosen, table


def run_seed(
    seed: int,
    *,
    epochs: int = 30,
    swa_epochs: int = 20,
    n_samples: int = 10,
    lr: float = LR,
    cos_lr: float = LR,
    wd: float = 5e-4,
):
    """Train one MLP with SGD (momentum 0.9, constant ``lr``; the last ``swa_epochs`` epochs
    collect once per epoch) and one with the rate cosine-annealed from ``cos_lr`` over all epochs;
    return test metrics of the final SGD iterate (``sgd``), the cosine-annealed SGD (``cos``), SWA
    and SWAG."""
    x_tr, y_tr, x_te, y_te = _data()
    loss_fn = nn.CrossEntropyLoss()
    cos_model = train_cosine(seed, cos_lr, epochs + swa_epochs, x_tr, y_tr, wd)

    model, opt = _make(seed, lr, wd)
    g = torch.Generator().manual_seed(seed)
    swa = SWA(model)
    swag = SWAG(model, max_rank=10)
    for epoch in range(epochs + swa_epochs):
        model.train()
        for xb, yb in _batches(x_tr, y_tr, 32, g):
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()
        if epoch >= epochs:  # SWA phase: constant learning rate, one collection per epoch
            swa.update(model)
            swag.collect(model)

    train_loader = _batches(x_tr, y_tr, 128)
    p_sgd = _probs(model, x_te)
    update_bn(train_loader, swa.module)
    p_swa = _probs(swa.module, x_te)
    p_swag = bayesian_average(
        model, swag, [x_te], n_samples, bn_loader=train_loader,
        generator=torch.Generator().manual_seed(1000 + seed),
    )
    out = {}
    p_cos = _probs(cos_model, x_te)
    for name, p in (("sgd", p_sgd), ("cos", p_cos), ("swa", p_swa), ("swag", p_swag)):
        out[f"acc_{name}"] = accuracy(p, y_te)
        out[f"nll_{name}"] = nll(p, y_te)
        out[f"ece_{name}"] = expected_calibration_error(p, y_te)
    return out


def run(seeds, **kw):
    """Tune the cosine baseline's rate on the seeds, then run every seed; returns
    (per-seed rows, means, (chosen rate, tuning table))."""
    # the model is tiny: one thread avoids thread-pool overhead and contention on a shared CPU
    # (about 9x faster on a loaded 2-core machine); results do not depend on the thread count
    seeds = list(seeds)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        total = kw.get("epochs", 30) + kw.get("swa_epochs", 20)
        cos_lr, table = tune_cosine_lr(seeds, total, kw.get("lr", LR))
        rows = [run_seed(s, cos_lr=cos_lr, **kw) for s in seeds]
    finally:
        torch.set_num_threads(threads)
    mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
    return rows, mean, (cos_lr, table)


def _check(rows):
    # What the tuned-baseline runs support on EVERY seed (3 seeds and the 8-seed --full run,
    # docs/swa.md), each with a margin: no gain is claimed over cosine-annealed SGD.
    # - every model learns: accuracy >= 0.965 (lowest seen 0.9736);
    # - SWA and SWAG lose at most 0.0125 accuracy (9 of 719 test digits) to the tuned
    #   cosine-annealed SGD (worst seen: -0.0069);
    # - SWAG's sample average does not raise the NLL of its own mean (SWA) by more than 0.01
    #   (worst seen: +0.0009; a broken posterior or sampler raises it).
    for r in rows:
        for name in ("cos", "swa", "swag"):
            assert r[f"acc_{name}"] >= 0.965, (name, r)
        assert r["acc_swa"] >= r["acc_cos"] - 0.0125, r
        assert r["acc_swag"] >= r["acc_cos"] - 0.0125, r
        assert r["nll_swag"] <= r["nll_swa"] + 0.01, r


def test_digits_swa_swag_no_loss_against_tuned_annealed_sgd():
    rows, _, _ = run(range(3))
    _check(rows)


@pytest.mark.slow
def test_digits_full_more_seeds_longer():
    rows, _, _ = run(range(8), epochs=60, swa_epochs=40, n_samples=30)
    _check(rows)


if __name__ == "__main__":
    full = "--full" in sys.argv
    kw = {"epochs": 60, "swa_epochs": 40, "n_samples": 30} if full else {}
    seeds = range(8) if full else range(3)
    rows, mean, (cos_lr, table) = run(seeds, **kw)
    print("cosine-SGD peak lr, validation split (20% of the training set):")
    for cand, val_nll, val_acc in table:
        mark = "  <- chosen" if cand == cos_lr else ""
        print(f"  lr {cand:<6g} val NLL {val_nll:.4f}  val acc {val_acc:.4f}{mark}")
    keys = list(rows[0])
    print("seed  " + "  ".join(f"{k:>9}" for k in keys))
    for s, r in zip(seeds, rows, strict=True):
        print(f"{s:>4}  " + "  ".join(f"{r[k]:9.4f}" for k in keys))
    print("mean  " + "  ".join(f"{mean[k]:9.4f}" for k in keys))
    if len(rows) > 1:
        print("sd    " + "  ".join(f"{statistics.stdev(r[k] for r in rows):9.4f}" for k in keys))
    print("min   " + "  ".join(f"{min(r[k] for r in rows):9.4f}" for k in keys))
    print("max   " + "  ".join(f"{max(r[k] for r in rows):9.4f}" for k in keys))
