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
    """Small multiples: one reliability curve per panel, a row per test set and a column per
    method, on shared axes, so that each method's curve is read alone against the diagonal."""
    from ember.swa import calibration_bins, expected_calibration_error

    fig = _figure(2.3 * len(METHODS), 2.3 * len(TEST_SETS) + 0.6)
    axes = fig.subplots(len(TEST_SETS), len(METHODS), sharex=True, sharey=True, squeeze=False)
    for i, test_set in enumerate(TEST_SETS):
        for j, method in enumerate(METHODS):
            ax = axes[i][j]
            p = probs[method][test_set]
            y = labels.repeat(len(p) // len(labels))  # seeds pooled (pooled methods: one model)
            bins = calibration_bins(p, y, 20, "mass")
            ece = expected_calibration_error(p, y, 20, "mass")
            ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1)
            ax.plot(bins.confidence.numpy(), bins.accuracy.numpy(), marker="o", markersize=2.5,
                    color=f"C{j}")
            ax.text(0.97, 0.04, f"ECE {ece:.3f}", ha="right", va="bottom", fontsize=8,
                    transform=ax.transAxes)
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
            if i == 0:
                ax.set_title(_wrap(method), fontsize=9)
            if i == len(TEST_SETS) - 1:
                ax.set_xlabel("confidence", fontsize=8)
            if j == 0:
                ax.set_ylabel(f"{test_set}\naccuracy", fontsize=9)
            ax.tick_params(labelsize=7)
    fig.suptitle("reliability (20 equal-mass bins, all seeds pooled): on the dashed line a "
                 "method is calibrated, below it over-confident, above it under-confident",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _wrap(name: str, width: int = 18) -> str:
    """A method name broken into lines of about ``width`` characters (panel titles)."""
    lines: list[str] = []
    for word in name.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "\n".join(lines)


def _legend_below(fig: Any, ax: Any, ncol: int) -> None:
    """One legend for the figure, under the axes, so that it covers no data."""
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=ncol, fontsize=8, frameon=False)


def _plot_shift(results: dict, path: Path) -> Path:
    fig = _figure(11, 4.8)
    width = 0.06  # methods side by side at each test set, so their error bars do not overlap
    for k, metric in enumerate(("accuracy", "nll")):
        ax = fig.add_subplot(1, 2, k + 1)
        for j, method in enumerate(METHODS):
            means = [results[t][method][metric]["mean"] for t in TEST_SETS]
            stds = [results[t][method][metric]["std"] or 0.0 for t in TEST_SETS]
            xs = [i + (j - (len(METHODS) - 1) / 2) * width for i in range(len(TEST_SETS))]
            ax.errorbar(xs, means, yerr=stds, marker="o", markersize=4, capsize=2,
                        color=f"C{j}", label=method)
        ax.set_xticks(range(len(TEST_SETS)))
        ax.set_xticklabels(TEST_SETS)
        ax.set_ylabel(metric.upper() if metric == "nll" else metric)
        ax.set_title(f"{'NLL' if metric == 'nll' else 'accuracy'} against shift (mean ± std over seeds)")
    _legend_below(fig, ax, ncol=4)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, format="png")
    return path


def _plot_curves(histories: dict[str, list[list[dict]]], swa_start: int, stopped: list[int],
                 path: Path) -> Path:
    fig = _figure(11, 4.6)
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
    _legend_below(fig, ax2, ncol=5)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
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
