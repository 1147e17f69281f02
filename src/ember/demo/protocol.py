"""``ember demo``: a pre-specified experiment on scikit-learn's bundled digits data (no download).

What each part of ember is for, shown in one run:

- ember.shards: the digits are written as PNG + cls tar shards and streamed back, with the sample
  shuffle drawn by an ember.csprng generator;
- ember.swa: SGD, SWA, SWAG and MultiSWAG compared where weight averaging is claimed to help, with
  40% of the training labels wrong and test images that differ from the training images;
- ember.train: every model is trained by ``fit``;
- ember.csprng: DP-SGD through Opacus with ember's generator as Opacus's secure RNG, and speed
  ratios against torch's default generator measured in this run.

The protocol (``PROTOCOL`` below, printed before any number) was fixed before the first run and is
not tuned to the results. Outputs: ``results.json``, the PNG figures and a self-contained
``report.html``.
"""

from __future__ import annotations

import argparse
import base64
import html
import importlib.util
import json
import math
import platform
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["DemoSettings", "PROTOCOL", "register", "run_demo", "write_digits_shards"]

DEFAULT_OUT = Path("ember-demo-out")
TEST_SETS = ("clean", "pixel noise", "rotation")
METHODS = ("SGD (cosine LR)", "SGD (SWA run, final iterate)", "SWA", "SWAG", "MultiSWAG")

# The experiment, fixed in advance (docs/train.md states the same). Sizes that --quick reduces are
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
    "baseline": "SGD with the LR cosine-annealed from 0.05 to 0 over all epochs",
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
    "seeds": "training seeds 0, 1, 2 (initialisation and ember.csprng data shuffle); mean and "
             "sample std over seeds (MultiSWAG is one pooled model: no std)",
    "metrics": "accuracy, NLL (mean), ECE (20 equal-mass bins) on each test set",
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


def shifted_test_sets(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The protocol's three test inputs from clean images ``x`` in [0, 1] (1.0 is 16 on the
    digits' 0..16 scale)."""
    from ember.csprng import create_generator

    sigma = PROTOCOL["pixel_noise_sigma_0_16"] / 16.0
    noise = torch.randn(x.shape, generator=create_generator(1)) * sigma
    max_deg = PROTOCOL["rotation_degrees"]
    angles = (torch.rand(x.shape[0], generator=create_generator(2)) * 2 - 1) * max_deg
    return {"clean": x, "pixel noise": (x + noise).clamp_(0, 1), "rotation": _rotate(x, angles)}


def _batches(x: torch.Tensor, y: torch.Tensor, size: int = 256) -> list[tuple[torch.Tensor, ...]]:
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


# -- models and training ---------------------------------------------------------------------


def _model(batchnorm: bool = True) -> nn.Module:
    def norm() -> nn.Module:
        return nn.BatchNorm1d(128) if batchnorm else nn.Identity()

    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), norm(), nn.ReLU(), nn.Linear(128, 128),
                         norm(), nn.ReLU(), nn.Linear(128, 10))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=PROTOCOL["lr"], momentum=0.9, weight_decay=5e-4)


def _train_loader(urls: str, seed: int) -> Any:
    from ember.csprng import create_generator
    from ember.train import image_class_loader

    # the shuffle buffer and shard order are drawn by an ember.csprng generator
    return image_class_loader(urls, 32, seed=seed, shuffle=500, grayscale=True,
                              generator=create_generator(seed).fold_in(7))


def _train_seed(seed: int, settings: DemoSettings, train_urls: str, eval_batches: list,
                bn_batches: list, out: Path, progress: bool) -> dict[str, Any]:
    from ember.train import TrainConfig, fit

    torch.manual_seed(seed)
    sgd_model = _model()
    opt = _optimizer(sgd_model)
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


def _probs(model: nn.Module, batches: list) -> torch.Tensor:
    from ember.train import predict

    return predict(model, batches)[0]


def _metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    from ember.swa import accuracy, expected_calibration_error, nll

    return {"accuracy": accuracy(probs, labels), "nll": nll(probs, labels),
            "ece": expected_calibration_error(probs, labels, 20, "mass")}


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
    return [{"case": r["case"], "size_mib": r["size_mib"], "ember_gbps": r["ember_gbps"],
             "torch_gbps": r["torch_gbps"], "ratio": r["ratio"]}
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


# -- tables ------------------------------------------------------------------------------------


def _fmt(s: dict[str, Any], digits: int = 3) -> str:
    if s["std"] is None:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f}±{s['std']:.{digits}f}"


def format_results(results: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> str:
    """The experiment's table: one row per (test set, method), mean ± std over seeds."""
    head = f"{'test set':<13}{'method':<31}{'accuracy':>15}{'NLL':>15}{'ECE':>15}"
    lines = [head, "-" * len(head)]
    for test_set in TEST_SETS:
        for method in METHODS:
            m = results[test_set][method]
            lines.append(f"{test_set:<13}{method:<31}{_fmt(m['accuracy']):>15}"
                         f"{_fmt(m['nll']):>15}{_fmt(m['ece']):>15}")
    return "\n".join(lines)


def _format_speed(csprng_rows: list[dict], shard_rows: list[dict]) -> str:
    lines = [f"{'ember.csprng vs torch default':<34}{'ember GB/s':>11}{'torch GB/s':>11}"
             f"{'ratio':>8}"]
    for r in csprng_rows:
        lines.append(f"{r['case'] + ' ' + str(r['size_mib']) + ' MiB':<34}{r['ember_gbps']:>11.2f}"
                     f"{r['torch_gbps']:>11.2f}{r['ratio']:>7.2f}x")
    lines.append(f"{'ember.shards vs webdataset':<34}{'ember /s':>11}{'wds /s':>11}{'ratio':>8}")
    for r in shard_rows:
        lines.append(f"{r['case']:<34}{r['ember_per_s']:>11.0f}{r['webdataset_per_s']:>11.0f}"
                     f"{r['ratio']:>7.2f}x")
    return "\n".join(lines)


def _format_protocol(settings: DemoSettings) -> str:
    keys = ("data", "label_noise", "model", "optimizer", "baseline", "swa", "swag", "multiswag",
            "seeds", "metrics", "dp")
    lines = ["Pre-specified protocol (fixed before any result was seen):"]
    lines += [f"  {k}: {PROTOCOL[k]}" for k in keys]
    lines += [f"  test sets: {'; '.join(f'{k}: {v}' for k, v in PROTOCOL['test_sets'].items())}",
              f"  this run: {settings.epochs} epochs (SWA from epoch {settings.swa_start + 1}), "
              f"seeds {list(settings.seeds)}, SWAG rank {settings.swag_rank}, "
              f"{settings.swag_samples} samples"]
    return "\n".join(lines)


# -- figures and report ------------------------------------------------------------------------


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _plot_reliability(probs: dict[str, dict[str, torch.Tensor]], labels: torch.Tensor,
                      path: Path) -> Path:
    from ember.swa import calibration_bins, expected_calibration_error

    fig = _figure(13, 4.3)
    for i, test_set in enumerate(TEST_SETS):
        ax = fig.add_subplot(1, 3, i + 1)
        ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1)
        for j, method in enumerate(("SGD (cosine LR)", "SWA", "SWAG")):
            p = probs[method][test_set]
            bins = calibration_bins(p, labels, 20, "mass")
            ece = expected_calibration_error(p, labels, 20, "mass")
            ax.plot(bins.confidence.numpy(), bins.accuracy.numpy(), marker="o", markersize=3,
                    color=f"C{j}", label=f"{method} (ECE {ece:.3f})")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{test_set} (all seeds pooled)")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _plot_shift(results: dict, path: Path) -> Path:
    fig = _figure(11, 4)
    for k, metric in enumerate(("accuracy", "nll")):
        ax = fig.add_subplot(1, 2, k + 1)
        for j, method in enumerate(METHODS):
            means = [results[t][method][metric]["mean"] for t in TEST_SETS]
            stds = [results[t][method][metric]["std"] or 0.0 for t in TEST_SETS]
            ax.errorbar(range(len(TEST_SETS)), means, yerr=stds, marker="o", capsize=3,
                        color=f"C{j}", label=method)
        ax.set_xticks(range(len(TEST_SETS)))
        ax.set_xticklabels(TEST_SETS)
        ax.set_ylabel(metric.upper() if metric == "nll" else metric)
        ax.set_title(f"{'NLL' if metric == 'nll' else 'accuracy'} against shift")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _plot_curves(histories: dict[str, list[list[dict]]], swa_start: int, path: Path) -> Path:
    fig = _figure(11, 4)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for j, (name, runs) in enumerate(histories.items()):
        epochs = [r["epoch"] + 1 for r in runs[0]]
        for key, ax in (("train_loss", ax1), ("eval_accuracy", ax2)):
            values = torch.tensor([[r[key] for r in h] for h in runs], dtype=torch.float64)
            ax.plot(epochs, values.mean(0).numpy(), color=f"C{j}", label=name)
    ax1.set_title("training loss (on the noisy labels)")
    ax2.set_title("clean test accuracy of the SGD iterate")
    for ax in (ax1, ax2):
        ax.axvline(swa_start + 0.5, color="grey", linestyle="--", linewidth=1, label="SWA starts")
        ax.set_xlabel("epoch (mean over seeds)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _plot_speed(csprng_rows: list[dict], shard_rows: list[dict], path: Path) -> Path:
    fig = _figure(10, 3.6)
    names = [f"{r['case']}\n{r['size_mib']} MiB" for r in csprng_rows] + \
        ["shards: PNG decode\nvs webdataset"]
    ratios = [r["ratio"] for r in csprng_rows] + [r["ratio"] for r in shard_rows]
    ax = fig.add_subplot(1, 1, 1)
    bars = ax.bar(range(len(ratios)), ratios, color=["C0"] * len(csprng_rows) + ["C2"])
    for b, r in zip(bars, ratios, strict=True):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{r:.2f}x", ha="center",
                va="bottom")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(ratios)))
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel("speed ratio (ember / baseline)")
    ax.set_title("measured in this run: ember.csprng vs torch's default generator, "
                 "ember.shards vs webdataset")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _write_report(path: Path, payload: dict[str, Any], figures: dict[str, Path],
                  settings: DemoSettings) -> Path:
    def img(key: str, alt: str) -> str:
        data = base64.b64encode(figures[key].read_bytes()).decode("ascii")
        return f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">' \
               f"<figcaption>{html.escape(alt)}</figcaption></figure>"

    res = payload["results"]
    rows = [[t, m, _fmt(res[t][m]["accuracy"]), _fmt(res[t][m]["nll"]), _fmt(res[t][m]["ece"])]
            for t in TEST_SETS for m in METHODS]
    protocol = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(str(v))}</li>"
                       for k, v in PROTOCOL.items() if isinstance(v, str))
    protocol += "".join(f"<li><b>test set {html.escape(k)}</b>: {html.escape(v)}</li>"
                        for k, v in PROTOCOL["test_sets"].items())
    speed = payload["speed"]
    speed_rows = [[f"{r['case']} {r['size_mib']} MiB", f"{r['ember_gbps']:.2f} GB/s",
                   f"{r['torch_gbps']:.2f} GB/s", f"{r['ratio']:.2f}x"] for r in speed["csprng"]]
    speed_rows += [[r["case"], f"{r['ember_per_s']:.0f}/s", f"{r['webdataset_per_s']:.0f}/s",
                    f"{r['ratio']:.2f}x"] for r in speed["shards"]]
    dp = payload.get("dp")
    if dp is not None:
        dp_html = _html_table(
            ["mode", "epsilon (delta 1e-5)", "clean test accuracy", "training seconds"],
            [["secure_mode=True" if r["secure_mode"] else "secure_mode=False",
              f"{r['epsilon']:.2f}", f"{r['accuracy']:.3f}", f"{r['train_seconds']:.2f}"]
             for r in dp["runs"]])
        dp_html += (f"<p>secure mode took {dp['secure_time_ratio']:.2f}x the time of non-secure "
                    f"mode. Opacus's secure RNG: {html.escape(dp['how'])}.</p>")
    else:
        dp_html = f"<p>not run: {html.escape(payload.get('dp_skipped', 'disabled'))}</p>"
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ember demo report</title>
<style>
body {{ font-family: sans-serif; margin: 2em auto; max-width: 1400px; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #bbb; padding: 3px 9px; text-align: right; }}
th {{ background: #eee; }} td:nth-child(-n+2) {{ text-align: left; }}
img {{ max-width: 100%; }} figure {{ margin: 1em 0; }} figcaption {{ color: #555; }}
</style></head><body>
<h1>ember demo: digits with noisy labels and shifted test sets</h1>
<p>{settings.epochs} epochs per run, seeds {list(settings.seeds)}; run took
{payload['seconds']['total']:.0f} s on {html.escape(payload['machine'])}.</p>
<h2>Protocol (fixed before any result)</h2><ul>{protocol}</ul>
<h2>Results (mean ± std over seeds)</h2>
{_html_table(["test set", "method", "accuracy", "NLL", "ECE"], rows)}
{img("reliability", "Reliability diagrams: SGD, SWA and SWAG on each test set")}
{img("shift", "Accuracy and NLL against shift")}
{img("curves", "Learning curves")}
<h2>Differentially private training (Opacus, ember.csprng as secure RNG)</h2>
{dp_html}
<h2>Speed measured in this run</h2>
{_html_table(["case", "ember", "baseline", "ratio"], speed_rows)}
{img("speed", "Speed ratios") if "speed" in figures else "<p>not measured (--no-benchmark)</p>"}
</body></html>
"""
    path.write_text(doc, encoding="utf-8")
    return path


# -- the run -----------------------------------------------------------------------------------


def run_demo(out: Path = DEFAULT_OUT, *, quick: bool = False, progress: bool = True,
             benchmark: bool = True, dp: bool = True,
             settings: DemoSettings | None = None) -> dict[str, Any]:
    """Run the demo, print the protocol and tables, write results.json, the figures and
    report.html under ``out``; returns the results.json payload."""
    settings = settings or (DemoSettings.quick() if quick else DemoSettings())
    threads = torch.get_num_threads()
    # the models are tiny ((32, 128) activations): with several intra-op threads every op pays
    # thread start-up and, on a busy machine, waits for a core (measured 17-55 ms per step with 2
    # threads against 1 ms with one); the speed section below runs with the caller's threads
    torch.set_num_threads(1)
    try:
        return _run(out, settings, progress, benchmark, dp, threads)
    finally:
        torch.set_num_threads(threads)


def _run(out: Path, settings: DemoSettings, progress: bool, benchmark: bool, dp: bool,
         threads: int) -> dict[str, Any]:
    from ember.csprng import create_generator
    from ember.swa import MultiSWAG, bayesian_average

    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    print(_format_protocol(settings), flush=True)
    shards = write_digits_shards(out / "shards", noise_rate=PROTOCOL["label_noise_rate"])
    print(f"\nwrote {shards['n_train']} train digits ({shards['noise_rate']:.1%} labels wrong) "
          f"and {shards['n_test']} test digits as PNG+cls shards to {out / 'shards'}", flush=True)

    x_test, y_test = _read_all(shards["test"])
    inputs = shifted_test_sets(x_test)
    n_test = len(y_test)
    all_x = torch.cat([inputs[t] for t in TEST_SETS])
    all_batches = _batches(all_x, y_test.repeat(len(TEST_SETS)))
    eval_batches = _batches(x_test, y_test)
    x_train, y_train = _read_all(shards["train"])
    bn_batches = _batches(x_train, y_train, 32)  # training inputs for BatchNorm recomputation

    per_seed: dict[str, dict[str, list[dict]]] = {m: {t: [] for t in TEST_SETS} for m in METHODS}
    pooled: dict[str, dict[str, list[torch.Tensor]]] = {m: {t: [] for t in TEST_SETS}
                                                       for m in METHODS}
    histories: dict[str, list[list[dict]]] = {"SGD, cosine LR": [], "SWA run": []}
    swags, last_model = [], None
    for seed in settings.seeds:
        print(f"seed {seed}: training SGD (cosine) and the SWA run, {settings.epochs} epochs "
              "each ...", flush=True)
        runs = _train_seed(seed, settings, shards["train"], eval_batches, bn_batches, out, progress)
        sgd, swa = runs["sgd"], runs["swa"]
        histories["SGD, cosine LR"].append(sgd.history)
        histories["SWA run"].append(swa.history)
        probs = {"SGD (cosine LR)": _probs(sgd.model, all_batches),
                 "SGD (SWA run, final iterate)": _probs(swa.model, all_batches),
                 "SWA": _probs(swa.swa.module, all_batches),
                 "SWAG": bayesian_average(swa.model, swa.swag, [b[0] for b in all_batches],
                                          settings.swag_samples, bn_loader=bn_batches,
                                          scale=PROTOCOL["swag_scale"],
                                          generator=create_generator(seed).fold_in(11))}
        for method, p in probs.items():
            for test_set, q in _split(p, n_test).items():
                per_seed[method][test_set].append(_metrics(q, y_test))
                pooled[method][test_set].append(q)
        swags.append(swa.swag)
        last_model = swa.model
    print("MultiSWAG: pooling the seeds' SWAG posteriors ...", flush=True)
    p_multi = bayesian_average(last_model, MultiSWAG(swags), [b[0] for b in all_batches],
                               settings.swag_samples, bn_loader=bn_batches,
                               scale=PROTOCOL["swag_scale"],
                               generator=create_generator(99).fold_in(11))
    for test_set, q in _split(p_multi, n_test).items():
        per_seed["MultiSWAG"][test_set].append(_metrics(q, y_test))
        pooled["MultiSWAG"][test_set].append(q)
    t_experiment = time.perf_counter() - t0

    results = {t: {m: {k: _summary([r[k] for r in per_seed[m][t]])
                       for k in ("accuracy", "nll", "ece")} for m in METHODS} for t in TEST_SETS}
    print("\n" + format_results(results), flush=True)

    payload: dict[str, Any] = {
        "protocol": PROTOCOL, "settings": asdict(settings) | {"swa_start": settings.swa_start},
        "data": {"n_train": shards["n_train"], "n_test": n_test,
                 "label_noise_rate_written": shards["noise_rate"]},
        "results": results,
        "machine": f"{platform.machine()}, training on 1 torch thread, speed on {threads}, "
                   f"torch {torch.__version__}",
    }

    dp_payload = None
    if dp and importlib.util.find_spec("opacus") is not None:
        print(f"\nDP-SGD with Opacus, {settings.dp_epochs} epochs, non-secure then secure mode ...",
              flush=True)
        t_dp = time.perf_counter()
        dp_payload = _dp_section(shards["train"], (x_test, y_test), settings.dp_epochs)
        payload["dp"] = dp_payload
        payload["seconds_dp"] = time.perf_counter() - t_dp
        for r in dp_payload["runs"]:
            print(f"  secure_mode={r['secure_mode']!s:<5}  epsilon {r['epsilon']:.2f} (delta 1e-5)"
                  f"  clean test accuracy {r['accuracy']:.3f}  {r['train_seconds']:.2f} s")
        print(f"  secure mode took {dp_payload['secure_time_ratio']:.2f}x the time of non-secure "
              f"mode ({dp_payload['how']})")
    else:
        payload["dp_skipped"] = "opacus is not installed" if dp else "disabled (--no-dp)"
        print(f"\nDP-SGD section skipped: {payload['dp_skipped']}")

    speed = {"csprng": [], "shards": []}
    torch.set_num_threads(threads)
    if benchmark:
        print("\nspeed, measured now (other processes on this machine affect both sides):",
              flush=True)
        speed["csprng"] = _csprng_speed(settings)
        speed["shards"] = _shards_speed(shards["train"], shards["n_train"], settings.bench_passes)
        print(_format_speed(speed["csprng"], speed["shards"]))
    payload["speed"] = speed

    figures = {
        "reliability": _plot_reliability({m: {t: torch.cat(v) for t, v in d.items()}
                                          for m, d in pooled.items()},
                                         y_test.repeat(len(settings.seeds)), out /
                                         "reliability.png") if len(settings.seeds) else None,
        "shift": _plot_shift(results, out / "shift.png"),
        "curves": _plot_curves(histories, settings.swa_start, out / "learning_curves.png"),
    }
    if benchmark:
        figures["speed"] = _plot_speed(speed["csprng"], speed["shards"], out / "speed.png")
    payload["seconds"] = {"experiment": t_experiment, "total": time.perf_counter() - t0}
    payload["figures"] = {k: str(v) for k, v in figures.items()}
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    report = _write_report(out / "report.html", payload,
                           figures,
                           settings)
    print(f"\nfigures: {', '.join(str(p) for p in figures.values())}")
    print(f"results: {out / 'results.json'}")
    print(f"demo finished in {payload['seconds']['total']:.1f} s")
    print(f"report: {report.resolve()}")
    return payload


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ember demo`` to the ``ember`` command."""
    p = sub.add_parser(
        "demo", help="a pre-specified SGD/SWA/SWAG experiment on noisy digits, DP-SGD, speed; "
        "writes report.html",
        description="Write scikit-learn's bundled digits as tar shards (40%% of the training "
        "labels wrong), stream them with an ember.csprng shuffle, train SGD (cosine) and SWA "
        "runs for several seeds, and compare SGD, SWA, SWAG and MultiSWAG on clean, noisy and "
        "rotated test images (accuracy, NLL, ECE); train with DP-SGD through Opacus using "
        "ember's generator; measure ember.csprng and ember.shards speed ratios. Writes "
        "results.json, PNG figures and a self-contained report.html.")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"output directory (default: ./{DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true",
                   help="fewer epochs, 2 seeds, small SWAG (for tests; under a minute)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-benchmark", action="store_true", help="skip the speed measurements")
    p.add_argument("--no-dp", action="store_true", help="skip the DP-SGD section")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    missing = [m for m in ("sklearn", "matplotlib") if importlib.util.find_spec(m) is None]
    if not args.no_benchmark and importlib.util.find_spec("webdataset") is None:
        missing.append("webdataset")
    if missing:
        print(f"ember demo: error: needs {' and '.join(missing)}; install them with "
              "pip install 'ember[demo]'", file=sys.stderr)
        return 2
    run_demo(args.out, quick=args.quick, progress=not args.no_progress,
             benchmark=not args.no_benchmark, dp=not args.no_dp)
    return 0
