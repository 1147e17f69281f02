"""The ``ember demo`` experiment: its pre-specified protocol (``PROTOCOL``, ``DemoSettings``), the
data (digits written as shards, read back, shifted test sets), the training of each method for a
seed, the metrics, the DP-SGD section and the speed measurements. Figures are drawn by
:mod:`ember.demo.figures`, the tables and report.html written by :mod:`ember.demo.report`, and
:mod:`ember.demo.run` runs it all (``ember demo``).
"""

from __future__ import annotations

import math
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

__all__ = ["DemoSettings", "PROTOCOL", "shifted_test_sets", "write_digits_shards"]

DEFAULT_OUT = Path("ember-demo-out")
TEST_SETS = ("clean", "pixel noise", "rotation")
# one model per seed (mean ± std over seeds)
SINGLE_METHODS = ("SGD (cosine LR)", "SGD (early-stopped)", "SGD (SWA run, final iterate)", "SWA",
                  "SWAG")
# one model pooled from every seed's run: compared with each other at the same compute
POOLED_METHODS = ("SGD ensemble", "MultiSWAG")
METHODS = SINGLE_METHODS + POOLED_METHODS
BASELINES = ("SGD (cosine LR)", "SGD (early-stopped)")  # the strongest simple baselines
AVERAGING = ("SWA", "SWAG")  # the weight-averaging methods a winning baseline is compared with

# The experiment, fixed in advance (docs/experiments/train.md states the same). Sizes that --quick reduces are
# in DemoSettings; everything else is here.
PROTOCOL: dict[str, Any] = {
    "data": "scikit-learn digits (1797 8x8 images, 10 classes), 70/30 stratified split (seed 0)",
    "label_noise": "40% of training labels replaced by a uniformly drawn other class (seed 0)",
    "label_noise_rate": 0.4,
    "test_sets": {
        "clean": "test images as they are, clean labels",
        "pixel noise": "Gaussian noise sigma 4 on the 0..16 pixel scale, clipped to 0..16 (seed 1)",
        "rotation": "rotation by an angle uniform in [-15, 15] degrees, bilinear (seed 2)",
    },
    "pixel_noise_sigma_0_16": 4.0,
    "rotation_degrees": 15.0,
    "model": "MLP 64-128-BN-ReLU-128-BN-ReLU-10 (BatchNorm1d)",
    "optimizer": "SGD lr 0.05, momentum 0.9, weight decay 5e-4, batch 32, fp32",
    "lr": 0.05,
    "baseline": "SGD with the LR cosine-annealed from 0.0125 to 0 over all epochs (peak rate "
                "tuned by bench/demo_tuning.py: chosen from 0.0125, 0.025, 0.05, 0.1 by accuracy "
                "on the early-stopping split's held-out 15%, never on a test set)",
    "baseline_lr": 0.0125,
    "early_stopping": "SGD at the constant lr 0.05 on the training data minus a held-out 15% "
                      "validation split (stratified, seed 0; its labels are as noisy as the rest), "
                      "evaluated after every epoch; the weights of the epoch with the best "
                      "validation accuracy are kept; training stops after 5 epochs without "
                      "improvement or at the epoch budget. Same initial weights as the others",
    "val_fraction": 0.15,
    "patience": 5,
    "swa": "same optimizer at lr 0.05 for the first 60% of epochs, then the last 40% at the "
           "constant swa_lr 0.01, weights averaged after every 20th optimizer step (about twice per "
           "epoch); "
           "BatchNorm recomputed on the training data",
    "swa_fraction": 0.4,
    "swa_lr": 0.01,
    "swa_every_steps": 20,
    "swag": "SWAG from the SWA run: rank 20 (the last 20 of the deviations collected every 20 "
            "steps), scale 0.5, 30 samples, "
            "BatchNorm recomputed for every sample, class probabilities averaged",
    "swag_scale": 0.5,
    "multiswag": "the SWAGs of all seeds pooled: 30 samples from each",
    "sgd_ensemble": "the cosine-SGD models of all seeds, softmax outputs averaged: MultiSWAG's "
                    "baseline at the same compute (one training run per seed each)",
    "seeds": "training seeds 0, 1, 2 (initialisation and ember.csprng data shuffle); mean and "
             "sample std over seeds (the SGD ensemble and MultiSWAG are one pooled model each: "
             "no std)",
    "metrics": "accuracy, NLL (mean), ECE (20 equal-mass bins) and mean confidence (top-class "
               "probability) on each test set",
    "dp": "DP-SGD with Opacus on clean labels: MLP without BatchNorm, noise multiplier 1.0, "
          "per-example clip 1.0, Poisson sampling at rate 64/N, delta 1e-5; secure_mode=True "
          "(ember.csprng as Opacus's secure RNG) timed against secure_mode=False in this run",
}


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of the demo run (``quick`` is the reduced one used by the tests)."""

    epochs: int = 30
    seeds: tuple[int, ...] = (0, 1, 2)
    swag_rank: int = 20
    swag_samples: int = 30
    dp_epochs: int = 10
    bench_mib: int = 16
    bench_passes: int = 5

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(epochs=5, seeds=(0, 1), swag_rank=2, swag_samples=3, dp_epochs=1,
                   bench_mib=1, bench_passes=1)

    def protocol(self) -> dict[str, Any]:
        """``PROTOCOL`` with the sizes of these settings (``PROTOCOL`` states the default run)."""
        seeds = ", ".join(str(s) for s in self.seeds)
        out = dict(PROTOCOL)
        out["swag"] = (f"SWAG from the SWA run: rank {self.swag_rank} (the last {self.swag_rank} "
                       "of the deviations collected every 20 steps), scale 0.5, "
                       f"{self.swag_samples} samples, BatchNorm recomputed for every sample, "
                       "class probabilities averaged")
        out["multiswag"] = f"the SWAGs of all seeds pooled: {self.swag_samples} samples from each"
        out["seeds"] = PROTOCOL["seeds"].replace("0, 1, 2", seeds)
        out["epochs"] = (f"{self.epochs} epochs per run (SWA from epoch {self.swa_start + 1}, "
                         "1-based); DP-SGD " + f"{self.dp_epochs} epochs")
        return out

    @property
    def swa_start(self) -> int:
        """First epoch (0-based) of the SWA phase: the last 40% of the epochs."""
        return self.epochs - round(PROTOCOL["swa_fraction"] * self.epochs)


def write_digits_shards(root: Path, *, noise_rate: float = 0.4, test_size: float = 0.3,
                        seed: int = 0, maxcount: int = 200) -> dict[str, Any]:
    """Write the digits as 8x8 grayscale PNG shards under ``root``.

    Training samples carry the noisy label in ``cls`` and the true one in ``clean.cls``; a
    ``noise_rate`` fraction of them (exactly, chosen with ``seed``) get a uniformly drawn other
    class. Test samples carry their true label. Returns the brace patterns, counts and the noise
    rate written.
    """
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from ember.shards import ShardWriter

    if not 0 <= noise_rate < 1:
        raise ValueError(f"noise_rate must be in [0, 1), got {noise_rate}")
    x, y = load_digits(return_X_y=True)
    images = np.rint(x.reshape(-1, 8, 8) * (255.0 / 16.0)).astype(np.uint8)
    idx_tr, idx_te = train_test_split(np.arange(len(y)), test_size=test_size, random_state=seed,
                                      stratify=y)
    rng = np.random.default_rng(seed)
    noisy = y.copy()
    flip = rng.choice(idx_tr, size=round(noise_rate * len(idx_tr)), replace=False)
    # y + k mod 10 with k uniform in 1..9 is uniform over the 9 other classes
    noisy[flip] = (y[flip] + rng.integers(1, 10, size=len(flip))) % 10
    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    for split, idx in (("train", idx_tr), ("test", idx_te)):
        for old in root.glob(f"{split}-*.tar"):
            old.unlink()
        with ShardWriter(str(root / f"{split}-%06d.tar"), maxcount=maxcount) as writer:
            for i in idx:
                sample = {"__key__": f"digit{i:05d}", "png": images[i]}
                if split == "train":
                    sample.update({"cls": int(noisy[i]), "clean.cls": int(y[i])})
                else:
                    sample["cls"] = int(y[i])
                writer.write(sample)
        n = len(writer.shards)
        out[split] = str(root / f"{split}-{{000000..{n - 1:06d}}}.tar")
        out[f"n_{split}"] = len(idx)
    out["noise_rate"] = float(np.mean(noisy[idx_tr] != y[idx_tr]))
    return out


# -- data -------------------------------------------------------------------------------------


def _read_all(urls: str, label_key: str = "cls") -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample of ``urls`` in order, decoded to (N, 1, 8, 8) floats in [0, 1] and labels."""
    from ember.shards import ShardDataset, ShardLoader

    ds = ShardDataset(urls, shuffle_shards=False).decode("torchl").to_tuple(f"png {label_key}")
    xs, ys = [], []
    for x, y in ShardLoader(ds.batched(256), num_workers=0):
        xs.append(x.unsqueeze(1))  # "torchl" gives (H, W) images, as in webdataset
        ys.append(torch.as_tensor(y))
    return torch.cat(xs), torch.cat(ys).long()


def _rotate(x: torch.Tensor, degrees: torch.Tensor) -> torch.Tensor:
    theta = degrees * (math.pi / 180.0)
    cos, sin = torch.cos(theta), torch.sin(theta)
    zero = torch.zeros_like(cos)
    mat = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)
    grid = nn.functional.affine_grid(mat, list(x.shape), align_corners=False)
    return nn.functional.grid_sample(x, grid, mode="bilinear", padding_mode="zeros",
                                     align_corners=False)


def _torch_generator(generator: Any) -> torch.Generator:
    """An ember.csprng generator typed as what it stands in for: torch's functions and ember's
    take it wherever they take ``generator=`` (ember.csprng's torch adapter routes the draw);
    torch's type stubs know only ``torch.Generator``."""
    return cast(torch.Generator, generator)


def shifted_test_sets(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The protocol's three test inputs from clean images ``x`` in [0, 1] (1.0 is 16 on the
    digits' 0..16 scale)."""
    from ember.csprng import create_generator

    sigma = PROTOCOL["pixel_noise_sigma_0_16"] / 16.0
    noise = torch.randn(x.shape, generator=_torch_generator(create_generator(1))) * sigma
    max_deg = PROTOCOL["rotation_degrees"]
    angles = (torch.rand(x.shape[0], generator=_torch_generator(create_generator(2))) * 2 - 1) * max_deg
    return {"clean": x, "pixel noise": (x + noise).clamp_(0, 1), "rotation": _rotate(x, angles)}


def _batches(x: torch.Tensor, y: torch.Tensor, size: int = 256) -> list[tuple[torch.Tensor, ...]]:
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


# -- models and training ---------------------------------------------------------------------


def _model(batchnorm: bool = True) -> nn.Module:
    def norm() -> nn.Module:
        return nn.BatchNorm1d(128) if batchnorm else nn.Identity()

    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), norm(), nn.ReLU(), nn.Linear(128, 128),
                         norm(), nn.ReLU(), nn.Linear(128, 10))


def _optimizer(model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
    """The protocol's SGD at ``lr`` (default: the methods' ``PROTOCOL["lr"]``)."""
    return torch.optim.SGD(model.parameters(), lr=PROTOCOL["lr"] if lr is None else lr,
                           momentum=0.9, weight_decay=5e-4)


def _train_loader(urls: str, seed: int) -> Any:
    from ember.csprng import create_generator
    from ember.train import image_class_loader

    # the shuffle buffer and shard order are drawn by an ember.csprng generator
    return image_class_loader(urls, 32, seed=seed, shuffle=500, grayscale=True,
                              generator=_torch_generator(create_generator(seed).fold_in(7)))


def _train_seed(seed: int, settings: DemoSettings, train_urls: str, eval_batches: list,
                bn_batches: list, out: Path, progress: bool) -> dict[str, Any]:
    from ember.train import TrainConfig, fit

    torch.manual_seed(seed)
    sgd_model = _model()
    opt = _optimizer(sgd_model, PROTOCOL["baseline_lr"])
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=settings.epochs)
    sgd = fit(sgd_model, opt, _train_loader(train_urls, seed),
              TrainConfig(epochs=settings.epochs, seed=seed, progress=progress,
                          metrics_path=out / f"metrics-sgd-seed{seed}.jsonl"),
              scheduler=cosine, eval_loader=eval_batches)

    torch.manual_seed(seed)  # same initial weights as the baseline
    swa_model = _model()
    opt = _optimizer(swa_model)
    swa = fit(swa_model, opt, _train_loader(train_urls, seed),
              TrainConfig(epochs=settings.epochs, seed=seed, progress=progress,
                          swa_start=settings.swa_start, swa_lr=PROTOCOL["swa_lr"],
                          swa_schedule="constant", swa_every_steps=PROTOCOL["swa_every_steps"],
                          swag_rank=settings.swag_rank,
                          metrics_path=out / f"metrics-swa-seed{seed}.jsonl"),
              eval_loader=eval_batches, bn_loader=bn_batches)
    return {"sgd": sgd, "swa": swa}


def _early_stopped(seed: int, settings: DemoSettings, x: torch.Tensor, y: torch.Tensor,
                   eval_batches: list) -> dict[str, Any]:
    """The early-stopping baseline (``PROTOCOL["early_stopping"]``) on in-memory training data:
    the kept model, its epoch, and per-epoch history (validation and clean test accuracy)."""
    import copy

    from sklearn.model_selection import train_test_split

    from ember.swa import accuracy

    idx = torch.arange(len(y))
    fit_idx, val_idx = train_test_split(idx.numpy(), test_size=PROTOCOL["val_fraction"],
                                        random_state=0, stratify=y.numpy())
    fit_idx, val_idx = torch.as_tensor(fit_idx), torch.as_tensor(val_idx)
    x_fit, y_fit, x_val, y_val = x[fit_idx], y[fit_idx], x[val_idx], y[val_idx]
    torch.manual_seed(seed)  # same initial weights as the other runs
    model = _model()
    opt = _optimizer(model)
    order = torch.Generator().manual_seed(seed)
    best, best_state, best_epoch, since, history = -1.0, None, -1, 0, []
    for epoch in range(settings.epochs):
        model.train()
        perm = torch.randperm(len(y_fit), generator=order)
        total, n = 0.0, 0
        for i in range(0, len(perm), 32):
            j = perm[i:i + 32]
            if len(j) < 2:  # BatchNorm needs two examples
                continue
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x_fit[j]), y_fit[j])
            loss.backward()
            opt.step()
            total, n = total + float(loss.detach()), n + 1
        val = accuracy(_probs(model, _batches(x_val, y_val)), y_val)
        test = accuracy(*_probs_and_labels(model, eval_batches))
        history.append({"epoch": epoch, "train_loss": total / max(n, 1), "val_accuracy": val,
                        "eval_accuracy": test})
        if val > best:
            best, best_state, best_epoch, since = val, copy.deepcopy(model.state_dict()), epoch, 0
        else:
            since += 1
            if since >= PROTOCOL["patience"]:
                break
    if best_state is not None:  # always set: the first epoch beats best = -1
        model.load_state_dict(best_state)
    return {"model": model, "epoch": best_epoch, "history": history, "val_accuracy": best}


def _probs_and_labels(model: nn.Module, batches: list) -> tuple[torch.Tensor, torch.Tensor]:
    from ember.train import predict

    return predict(model, batches)


def _probs(model: nn.Module, batches: list) -> torch.Tensor:
    from ember.train import predict

    return predict(model, batches)[0]


def _metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    from ember.swa import accuracy, expected_calibration_error, nll

    return {"accuracy": accuracy(probs, labels), "nll": nll(probs, labels),
            "ece": expected_calibration_error(probs, labels, 20, "mass"),
            "confidence": float(probs.max(-1).values.double().mean())}


def _split(probs: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    return {name: probs[i * n:(i + 1) * n] for i, name in enumerate(TEST_SETS)}


def _summary(values: list[float]) -> dict[str, Any]:
    t = torch.tensor(values, dtype=torch.float64)
    std = float(t.std()) if len(values) > 1 else None
    return {"mean": float(t.mean()), "std": std, "per_seed": values}


# -- speed -------------------------------------------------------------------------------------


def _csprng_speed(settings: DemoSettings) -> list[dict[str, Any]]:
    from ember.csprng.benchmark import run

    wanted = {"rand float32", "randn float32", "randint int64"}
    rows = run(quick=True, sizes_mib=(settings.bench_mib,))
    # ratio: the median of interleaved per-repetition ratios (not ember_gbps / torch_gbps)
    return [{"case": r["case"], "size_mib": r["size_mib"], "ember_gbps": r["ember_gbps"],
             "torch_gbps": r["torch_gbps"], "ratio": r["ratio"],
             "ratio_min": r.get("ratio_min", r["ratio"]), "ratio_max": r.get("ratio_max", r["ratio"])}
            for r in rows if r["case"] in wanted]


def _shards_speed(urls: str, n: int, passes: int) -> list[dict[str, Any]]:
    """Samples/s reading and decoding the train shards (PNG to tensor + label), ember.shards
    against webdataset, alternating passes, best pass of each."""
    import webdataset as wds

    from ember.shards import ShardDataset, expand_urls

    files = expand_urls(urls)

    def ember_pass() -> int:
        ds = ShardDataset(files, shuffle_shards=False).decode("torchl").to_tuple("png cls")
        return sum(1 for _ in ds)

    def wds_pass() -> int:
        ds = wds.WebDataset(files, shardshuffle=False, empty_check=False).decode("torchl") \
            .to_tuple("png", "cls")
        return sum(1 for _ in ds)

    best = {"ember.shards": math.inf, "webdataset": math.inf}
    for _ in range(passes):
        for name, fn in (("ember.shards", ember_pass), ("webdataset", wds_pass)):
            t0 = time.perf_counter()
            count = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
            if count != n:
                raise RuntimeError(f"{name} read {count} samples, expected {n}")
    e, w = n / best["ember.shards"], n / best["webdataset"]
    return [{"case": "PNG decode + label, samples/s", "ember_per_s": e, "webdataset_per_s": w,
             "ratio": e / w}]


# -- differential privacy ----------------------------------------------------------------------


def _torchcsprng_module() -> tuple[Any, str]:
    """The module Opacus imports as ``torchcsprng``: ember's own provider when it exists, else a
    stand-in whose ``create_random_device_generator`` is ember's."""
    import ember.csprng as csprng

    provide = getattr(csprng, "provide_torchcsprng", None)
    if provide is not None:
        return provide(), "ember.csprng.provide_torchcsprng()"
    shim = types.ModuleType("torchcsprng")
    shim.create_random_device_generator = csprng.create_random_device_generator  # type: ignore
    shim.create_generator = csprng.create_generator  # type: ignore[attr-defined]
    return shim, "sys.modules['torchcsprng'] bound to ember.csprng (demo stand-in)"


def _dp_run(x: torch.Tensor, y: torch.Tensor, test: tuple[torch.Tensor, torch.Tensor],
            epochs: int, secure: bool) -> dict[str, Any]:
    import warnings

    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = _model(batchnorm=False)  # BatchNorm mixes examples: not DP-compatible
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.0)
    loader = DataLoader(TensorDataset(x, y), batch_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "secure RNG turned off" and similar notices
        engine = PrivacyEngine(secure_mode=secure)
        model, opt, loader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                                 noise_multiplier=1.0, max_grad_norm=1.0,
                                                 poisson_sampling=True)
    t0 = time.perf_counter()
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's hooks warn that the inputs need no gradient
        for _ in range(epochs):
            for xb, yb in loader:
                if len(xb) == 0:
                    continue
                opt.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        acc = float((model(test[0]).argmax(1) == test[1]).double().mean())
    return {"secure_mode": secure, "epsilon": float(engine.get_epsilon(1e-5)), "delta": 1e-5,
            "accuracy": acc, "train_seconds": seconds, "epochs": epochs}


def _dp_section(train_urls: str, test: tuple[torch.Tensor, torch.Tensor], epochs: int
                ) -> dict[str, Any]:
    x, y = _read_all(train_urls, "clean.cls")
    module, how = _torchcsprng_module()
    previous = sys.modules.get("torchcsprng")
    sys.modules["torchcsprng"] = module
    try:
        plain = _dp_run(x, y, test, epochs, secure=False)
        secure = _dp_run(x, y, test, epochs, secure=True)
    finally:
        if previous is None:
            sys.modules.pop("torchcsprng", None)
        else:
            sys.modules["torchcsprng"] = previous
    return {"how": how, "runs": [plain, secure],
            "secure_time_ratio": secure["train_seconds"] / plain["train_seconds"]}
