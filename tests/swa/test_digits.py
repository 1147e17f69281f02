"""A real small experiment: SGD vs SWA vs SWAG on scikit-learn's bundled digits data.

The baselines: the final iterate of the SWA run (constant rate) and, the strongest simple one,
SGD with the rate cosine-annealed to 0 over the same number of epochs, from the same initial
weights and data order (issue 28: against it SWA's accuracy gain disappears).

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


def run_seed(
    seed: int,
    *,
    epochs: int = 30,
    swa_epochs: int = 20,
    n_samples: int = 10,
    lr: float = 0.1,
    wd: float = 5e-4,
):
    """Train one MLP with SGD (momentum 0.9, constant lr; the last ``swa_epochs`` epochs collect
    once per epoch) and one with the rate cosine-annealed over all epochs; return test metrics of
    the final SGD iterate (``sgd``), the cosine-annealed SGD (``cos``), SWA and SWAG."""
    x_tr, y_tr, x_te, y_te = _data()
    loss_fn = nn.CrossEntropyLoss()

    def make():
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))
        return net, torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=wd)

    cos_model, cos_opt = make()
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(cos_opt, T_max=epochs + swa_epochs)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs + swa_epochs):
        cos_model.train()
        for xb, yb in _batches(x_tr, y_tr, 32, g):
            cos_opt.zero_grad()
            loss_fn(cos_model(xb), yb).backward()
            cos_opt.step()
        cosine.step()

    model, opt = make()
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
    # the model is tiny: one thread avoids thread-pool overhead and contention on a shared CPU
    # (about 9x faster on a loaded 2-core machine); results do not depend on the thread count
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [run_seed(s, **kw) for s in seeds]
    finally:
        torch.set_num_threads(threads)
    mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
    return rows, mean


def _check(mean):
    # against the constant-rate final iterate SWA gains; against cosine-annealed SGD at the same
    # epochs it does not lose more than a test example in 200 (the 8-seed run: 0.9783 vs 0.9784)
    assert mean["acc_swa"] >= mean["acc_sgd"], mean
    assert mean["acc_swa"] >= mean["acc_cos"] - 0.005, mean
    assert mean["nll_swag"] < mean["nll_sgd"], mean
    assert mean["nll_swag"] < mean["nll_cos"], mean


def test_digits_swa_matches_annealed_sgd_and_swag_lowers_nll():
    _, mean = run(range(3))
    _check(mean)


@pytest.mark.slow
def test_digits_full_more_seeds_longer():
    _, mean = run(range(8), epochs=60, swa_epochs=40, n_samples=30)
    _check(mean)


if __name__ == "__main__":
    full = "--full" in sys.argv
    kw = {"epochs": 60, "swa_epochs": 40, "n_samples": 30} if full else {}
    seeds = range(8) if full else range(3)
    rows, mean = run(seeds, **kw)
    keys = list(rows[0])
    print("seed  " + "  ".join(f"{k:>9}" for k in keys))
    for s, r in zip(seeds, rows, strict=True):
        print(f"{s:>4}  " + "  ".join(f"{r[k]:9.4f}" for k in keys))
    print("mean  " + "  ".join(f"{mean[k]:9.4f}" for k in keys))
