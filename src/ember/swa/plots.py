"""Reliability diagrams as PNG files (matplotlib is imported only when a plot is drawn)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ember.swa.metrics import Binning, calibration_bins, expected_calibration_error

__all__ = ["reliability_diagram"]


def reliability_diagram(
    probs: Any,
    labels: Any,
    path: str | os.PathLike[str],
    *,
    n_bins: int = 20,
    binning: Binning = "mass",
    title: str | None = None,
) -> Path:
    """Write a reliability diagram (accuracy against confidence per bin) to ``path`` as a PNG.

    Returns the path written. Needs matplotlib (``pip install ember[plots]``).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "reliability_diagram needs matplotlib; install it with `pip install ember[plots]`"
        ) from exc

    bins = calibration_bins(probs, labels, n_bins, binning)
    ece = expected_calibration_error(probs, labels, n_bins, binning)
    fig = Figure(figsize=(4.5, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    conf = bins.confidence.numpy()
    acc = bins.accuracy.numpy()
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1, label="perfect calibration")
    ax.plot(conf, acc, marker="o", color="C0", label=f"model (ECE {ece:.3f})")
    for c, a in zip(conf, acc, strict=True):
        ax.plot([c, c], [c, a], color="C3", linewidth=1, alpha=0.6)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence (top-class probability)")
    ax.set_ylabel("accuracy")
    ax.set_title(title or f"Reliability ({n_bins} equal-{binning} bins)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out
