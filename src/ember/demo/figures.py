"""The ``ember demo`` figures (matplotlib, Agg canvas, PNG): reliability diagrams, accuracy and
NLL against shift, learning curves and speed ratios."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ember.demo.protocol import METHODS, TEST_SETS


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _plot_reliability(probs: dict[str, dict[str, torch.Tensor]], labels: torch.Tensor,
                      path: Path) -> Path:
    from ember.swa import calibration_bins, expected_calibration_error

    fig = _figure(15, 5)
    for i, test_set in enumerate(TEST_SETS):
        ax = fig.add_subplot(1, 3, i + 1)
        ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1)
        for j, method in enumerate(METHODS):
            p = probs[method][test_set]
            y = labels.repeat(len(p) // len(labels))  # seeds pooled (pooled methods: one model)
            bins = calibration_bins(p, y, 20, "mass")
            ece = expected_calibration_error(p, y, 20, "mass")
            ax.plot(bins.confidence.numpy(), bins.accuracy.numpy(), marker="o", markersize=3,
                    color=f"C{j}", label=f"{method} (ECE {ece:.3f})")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{test_set} (all seeds pooled)")
        ax.legend(loc="upper left", fontsize=7)
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


def _plot_curves(histories: dict[str, list[list[dict]]], swa_start: int, stopped: list[int],
                 path: Path) -> Path:
    fig = _figure(11, 4)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for j, (name, runs) in enumerate(histories.items()):
        n = min(len(h) for h in runs)  # early-stopped runs end at different epochs
        epochs = [r["epoch"] + 1 for r in runs[0][:n]]
        for key, ax in (("train_loss", ax1), ("eval_accuracy", ax2)):
            values = torch.tensor([[r[key] for r in h[:n]] for h in runs], dtype=torch.float64)
            ax.plot(epochs, values.mean(0).numpy(), color=f"C{j}", label=name)
    for k, epoch in enumerate(stopped):  # 1-based
        ax2.axvline(epoch, color="C2", linestyle=":", linewidth=1,
                    label="epoch kept by early stopping" if k == 0 else None)
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
