"""Multi-SWA and MultiSWAG vs a deep ensemble of the same size on scikit-learn's digits.

``python bench/swa_family_multiswa.py [--quick] [--seeds N]`` prints a table and writes
bench/results/swa_family_multiswa.json; ``bench/swa_family.py`` imports :func:`experiment`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

PROTOCOL = """\
Data: scikit-learn's digits, pixels/16 as float32, stratified 70/30 train/test split with
random_state=0; test sets "clean", "pixel noise" and "rotation" from ember.demo.shifted_test_sets.
Model: MLP 64-64-BN-ReLU-Dropout(0.1)-10, SGD lr 0.05 momentum 0.9 weight decay 5e-4, batch 32,
cross-entropy, trained with ember.train.fit. Ensemble size M = 3 (quick: 2); for seed s the
members use seeds 10*s + j (initial weights torch.manual_seed, data order and fit's seed), j < M.
Budget per member: 20 epochs (quick: 4).
- "Deep ensemble": M SGD runs, cosine learning-rate decay (CosineAnnealingLR over the epochs)
  from a tuned peak lr, final iterates, mean of the members' softmax probabilities. The
  peak lr is chosen from {0.0125, 0.025, 0.05, 0.1} (quick: {0.025, 0.05}) by the mean
  validation NLL of single cosine runs at seeds 10*s (each ensemble's first member), trained on
  80% of the training set and scored on a stratified 20% held out from it (random_state=0; never
  the test sets); the members are then trained on the whole training set at that lr
  (bench/swa_family_tuning.py).
- "Multi-SWA": M fit runs with swa_start = half the epochs, swa_lr 0.02 (anneal 1 epoch), SWA
  collected every epoch, BatchNorm recomputed; ember.swa.MultiSWA (mean of probabilities).
- "MultiSWAG": the SWAG posteriors (rank 10) of the same runs, ember.swa.MultiSWAG through
  bayesian_average, 10 samples per member (quick: 3), scale 0.5, BatchNorm recomputed per sample.
Metrics: accuracy, NLL, ECE (20 equal-mass bins) per test set; wall_s = training (+ sampling).
Seeds 0, 1, 2; mean and std over seeds. All results are reported, including where a method loses.
The machine is a shared 2-core one: wall times are noisy.
"""


BASE_LR = 0.05


def _tuning():
    """bench/swa_family_tuning.py (the baseline's tuning step), imported from this file's folder."""
    if str(Path(__file__).parent) not in sys.path:
        sys.path.append(str(Path(__file__).parent))
    return importlib.import_module("swa_family_tuning")


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _tuning().digits()


def _model() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(),
                         nn.Dropout(0.1), nn.Linear(64, 10))


class _Shuffled:
    """(x, y) batches in a fresh order every pass, from a seeded torch.Generator."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int, batch: int = 32) -> None:
        self.x, self.y, self.batch = x, y, batch
        self.gen = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        perm = torch.randperm(len(self.x), generator=self.gen)
        for i in range(0, len(perm) - 1, self.batch):
            idx = perm[i:i + self.batch]
            if len(idx) >= 2:
                yield self.x[idx], self.y[idx]


def _metrics(probs: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    from ember.swa import accuracy, expected_calibration_error, nll

    probs = probs.double()
    return {"accuracy": accuracy(probs, y), "nll": nll(probs, y),
            "ece": expected_calibration_error(probs, y, n_bins=20)}


def _cosine_member(lr: float, s: int, xtr, ytr, epochs: int) -> nn.Module:
    """One deep-ensemble member: fit with the rate cosine-annealed from ``lr`` over ``epochs``."""
    from ember.train import TrainConfig, fit

    torch.manual_seed(s)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    fit(model, opt, _Shuffled(xtr, ytr, s), TrainConfig(epochs=epochs, seed=s, progress=False),
        scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs))
    return model


def _epochs(quick: bool) -> int:
    return 4 if quick else 20


def _run_seed(seed: int, quick: bool, xtr, ytr, tests, yte, cos_lr: float
              ) -> dict[str, dict[str, dict]]:
    from ember.swa import MultiSWA, MultiSWAG, bayesian_average
    from ember.train import TrainConfig, fit

    m_size = 2 if quick else 3
    epochs = _epochs(quick)
    bn = [(xtr[i:i + 256], ytr[i:i + 256]) for i in range(0, len(xtr), 256)]
    walls = {"Deep ensemble": 0.0, "Multi-SWA": 0.0, "MultiSWAG": 0.0}
    ensemble, swa_members, swags = [], [], []
    for j in range(m_size):
        s = 10 * seed + j
        t0 = time.perf_counter()
        ensemble.append(_cosine_member(cos_lr, s, xtr, ytr, epochs))
        walls["Deep ensemble"] += time.perf_counter() - t0
        torch.manual_seed(s)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        t0 = time.perf_counter()
        res = fit(model, opt, _Shuffled(xtr, ytr, s),
                  TrainConfig(epochs=epochs, swa_start=epochs // 2, swa_lr=0.02, swag_rank=10,
                              seed=s, progress=False), bn_loader=bn)
        dt = time.perf_counter() - t0
        walls["Multi-SWA"] += dt
        walls["MultiSWAG"] += dt
        swa_members.append(res.swa.module)
        swags.append(res.swag)
    multi = MultiSWA(swa_members)
    t0 = time.perf_counter()
    multi.update_bn_(bn)
    walls["Multi-SWA"] += time.perf_counter() - t0
    deep = MultiSWA(ensemble)  # the same averaging of probabilities, over SGD final iterates
    probs = {"Deep ensemble": {n: deep(x) for n, x in tests.items()},
             "Multi-SWA": {n: multi(x) for n, x in tests.items()}}
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    shell = _model()
    probs["MultiSWAG"] = {n: bayesian_average(shell, MultiSWAG(swags), [x], 3 if quick else 10,
                                              bn_loader=bn, generator=gen)
                          for n, x in tests.items()}
    walls["MultiSWAG"] += time.perf_counter() - t0
    out: dict[str, dict[str, dict]] = {}
    for method, per in probs.items():
        out[method] = {}
        for n, p in per.items():
            m = _metrics(p, yte)
            m["wall_s"] = walls[method]
            out[method][n] = m
    return out


def experiment(*, quick: bool, seeds: Sequence[int]) -> list[dict]:
    """One row per (method, test set): mean and std over ``seeds`` of accuracy, NLL, ECE, wall_s."""
    from ember.demo import shifted_test_sets

    seeds = list(seeds)
    if not seeds:
        raise ValueError("experiment needs at least one seed")
    xtr, ytr, xte, yte = _data()
    tests = shifted_test_sets(xte)
    per: dict[tuple[str, str], dict[str, list[float]]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tuning_mod = _tuning()
    try:
        tuning = tuning_mod.tune_lr(
            lambda lr, seed, x, y: _cosine_member(lr, 10 * seed, x, y, _epochs(quick)), xtr, ytr,
            seeds, BASE_LR, quick=quick)
        print(tuning_mod.describe(tuning), flush=True)
        for seed in seeds:
            for method, by_set in _run_seed(seed, quick, xtr, ytr, tests, yte,
                                            tuning["chosen_lr"]).items():
                tuning_mod.add_scores(per, method, by_set)
    finally:
        torch.set_num_threads(threads)
    return tuning_mod.summary_rows("multiswa", per, len(seeds), "Deep ensemble", tuning)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    rows = experiment(quick=args.quick, seeds=list(range(args.seeds)))
    print(PROTOCOL)
    for r in rows:
        print(f"{r['method']:<13} {r['test_set']:<12} "
              + " ".join(f"{k} {r[k + '_mean']:.4f}±{r[k + '_std']:.4f} "
                         f"[{r[k + '_min']:.4f}, {r[k + '_max']:.4f}]"
                         for k in ("accuracy", "nll", "ece", "wall_s")))
    _tuning().write_results("swa_family_multiswa", PROTOCOL, args.quick, rows, t0)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.exit(main())
