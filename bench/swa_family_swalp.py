"""SWALP vs 8-bit SGD vs fp32 SGD on scikit-learn's digits.

``python bench/swa_family_swalp.py [--quick]`` prints a table and writes
bench/results/swa_family_swalp.json; ``bench/swa_family.py`` imports :func:`experiment`.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

PROTOCOL = """\
Data: scikit-learn's digits, pixels/16 as float32, stratified 70/30 train/test split with
random_state=0; test sets "clean", "pixel noise" and "rotation" from ember.demo.shifted_test_sets.
Model: MLP 64-128-BN-ReLU-128-BN-ReLU-10, SGD momentum 0.9, weight decay 5e-4, batch 32,
cross-entropy; initial weights from torch.manual_seed(seed), the same for every method; data order
from a torch.Generator seeded with seed. Budget: 30 epochs (quick: 4) for every method.
Quantizer (8-bit runs): ember.swa.BlockQuantizer(wl=8), block floating point with stochastic
rounding from an ember.csprng generator keyed with seed; weights, weight gradients and momentum
one block per row (dim=0; biases one block), activations (inputs and outputs of every Linear and
the outputs of every ReLU, SWALP's placement) and their gradients one block per example (dim=0);
shared exponents clamped to 8 bits.
- "fp32 SGD": lr 0.05 for the first half, then linear decay to 0.0005 at the end.
- "fp32 SGD (cosine, tuned)": fp32, the rate cosine-annealed per epoch from a peak lr
  to 0 over all epochs. The peak lr is chosen from {0.0125, 0.025, 0.05, 0.1} (quick: {0.025,
  0.05}) by the mean validation NLL over the seeds, training on 80% of the training set and
  scoring on a stratified 20% held out from it (random_state=0; never the test sets); the row is
  then trained on the whole training set at that lr (bench/swa_family_tuning.py).
- "8-bit SGD": the same schedule, everything quantized as above, no averaging.
- "8-bit SWALP": the same quantized training with lr 0.05 for the first half, then constant
  lr 0.01; the weights are averaged in full precision (ember.swa.SWA) after every epoch of the
  second half; BatchNorm statistics recomputed on the training set.
Evaluation: 8-bit SGD keeps its 8-bit activation quantization at test time; the SWALP average
is evaluated in full precision, as SWALP's reference does (ember's averagers leave the
quantization hooks out of the average); fp32 SGD in fp32. Metrics: accuracy, NLL,
ECE (20 equal-mass bins) per test set, wall_s (training wall time). Seeds 0, 1, 2; mean and std over seeds.
Claim checked: 8-bit SGD loses accuracy against fp32 SGD and 8-bit SWALP recovers it (within
one std). The machine is a shared 2-core one: wall times are noisy.
"""

METHODS = ("fp32 SGD", "fp32 SGD (cosine, tuned)", "8-bit SGD", "8-bit SWALP")
BASE_LR = 0.05


def _tuning():
    """bench/swa_family_tuning.py (the baseline's tuning step), imported from this file's folder."""
    if str(Path(__file__).parent) not in sys.path:
        sys.path.append(str(Path(__file__).parent))
    return importlib.import_module("swa_family_tuning")


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _tuning().digits()


def _model() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(),
                         nn.Linear(128, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))


def _train(method: str, seed: int, epochs: int, xtr: torch.Tensor, ytr: torch.Tensor,
           cos_lr: float = BASE_LR) -> tuple[nn.Module, float]:
    """``cos_lr``: the peak rate of "fp32 SGD (cosine, tuned)"; the others use the protocol's."""
    import ember.csprng as csprng
    from ember.swa import SWA, update_bn
    from ember.swa.quantize import BlockQuantizer
    from ember.swa.swalp import LowPrecisionOptimizer, quantize_activations_

    torch.manual_seed(seed)
    model = _model()
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9,
                                                 weight_decay=5e-4)
    if not method.startswith("fp32 SGD"):
        gen = csprng.create_generator(seed)
        per_row = BlockQuantizer(wl=8, dim=0)
        quantize_activations_(model, per_row, per_row, generator=gen)
        opt = LowPrecisionOptimizer(opt, weight=per_row, grad=per_row, momentum=per_row,
                                    generator=gen)
        opt.quantize_weights_()
    order = torch.Generator().manual_seed(seed)
    half = epochs // 2
    swa = None
    t0 = time.perf_counter()
    for epoch in range(epochs):
        if method == "fp32 SGD (cosine, tuned)":
            lr = cos_lr * 0.5 * (1 + math.cos(math.pi * epoch / epochs))
        elif epoch < half:
            lr = 0.05
        elif method == "8-bit SWALP":
            lr = 0.01
        else:
            frac = (epoch - half + 1) / (epochs - half)
            lr = 0.05 + frac * (0.0005 - 0.05)
        for group in opt.param_groups:
            group["lr"] = lr
        _tuning().sgd_epoch(model, opt, xtr, ytr, order)
        if method == "8-bit SWALP" and epoch >= half:
            if swa is None:
                swa = SWA(model)
            swa.update(model)
    if swa is not None:
        update_bn([xtr[i:i + 256] for i in range(0, len(xtr), 256)], swa.module)
        model = swa.module
    return model, time.perf_counter() - t0


def _metrics(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    from ember.swa import accuracy, expected_calibration_error, nll

    model.eval()
    with torch.no_grad():
        probs = torch.softmax(model(x).double(), dim=1)
    return {"accuracy": accuracy(probs, y), "nll": nll(probs, y),
            "ece": expected_calibration_error(probs, y, n_bins=20)}


def experiment(*, quick: bool, seeds: Sequence[int]) -> list[dict]:
    """One row per (method, test set): mean and std over ``seeds`` of accuracy, NLL, ECE, wall_s."""
    from ember.demo import shifted_test_sets

    if not seeds:
        raise ValueError("experiment needs at least one seed")
    epochs = 4 if quick else 30
    xtr, ytr, xte, yte = _data()
    tests = shifted_test_sets(xte)
    per: dict[tuple[str, str], dict[str, list[float]]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tuning_mod = _tuning()
    try:
        tuning = tuning_mod.tune_lr(
            lambda lr, seed, x, y: _train("fp32 SGD (cosine, tuned)", seed, epochs, x, y, lr)[0],
            xtr, ytr, list(seeds), BASE_LR, quick=quick)
        print(tuning_mod.describe(tuning), flush=True)
        for seed in seeds:
            for method in METHODS:
                model, wall = _train(method, seed, epochs, xtr, ytr, tuning["chosen_lr"])
                for name, x in tests.items():
                    m = _metrics(copy.deepcopy(model), x, yte)
                    m["wall_s"] = wall
                    tuning_mod.add_scores(per, method, {name: m})
    finally:
        torch.set_num_threads(threads)
    return tuning_mod.summary_rows("swalp", per, len(seeds), "fp32 SGD (cosine, tuned)", tuning)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 epochs instead of 30")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    rows = experiment(quick=args.quick, seeds=list(range(args.seeds)))
    print(PROTOCOL)
    print(f"{'method':<24} {'test set':<12} {'accuracy mean±sd [min, max]':>32} {'nll':>32} "
          f"{'ece':>32} {'wall_s':>12}")
    for r in rows:
        print(f"{r['method']:<24} {r['test_set']:<12} "
              + " ".join(f"{r[k + '_mean']:>8.4f}±{r[k + '_std']:<7.4f}"
                         f"[{r[k + '_min']:.4f}, {r[k + '_max']:.4f}]"
                         for k in ("accuracy", "nll", "ece"))
              + f" {r['wall_s_mean']:>6.2f}±{r['wall_s_std']:<5.2f}")
    _tuning().write_results("swa_family_swalp", PROTOCOL, args.quick, rows, t0)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.exit(main())
