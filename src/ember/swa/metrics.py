"""Classification and calibration metrics on predicted class probabilities.

Every function takes ``probs`` of shape ``(N, C)`` (rows summing to 1, e.g. a softmax or a
Bayesian model average) and, where needed, integer ``labels`` of shape ``(N,)``. Arrays that
``torch.as_tensor`` accepts work too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "accuracy",
    "nll",
    "brier_score",
    "predictive_entropy",
    "expected_calibration_error",
    "calibration_bins",
    "CalibrationBins",
]

Binning = Literal["width", "mass"]

# float32 softmax rows sum to 1 within a few ulps times C; 1e-3 still rejects logits or unnormalised scores
_ROW_SUM_TOL = 1e-3


def _check_probs(probs: Any) -> Tensor:
    p = torch.as_tensor(probs)
    if p.ndim != 2 or p.shape[0] == 0:
        raise ValueError(f"probs must have shape (N, C) with N >= 1, got {tuple(p.shape)}")
    if not p.is_floating_point():
        raise ValueError(f"probs must be floating point, got {p.dtype}")
    p = p.to(torch.float64)
    if not torch.isfinite(p).all() or (p < 0).any():
        raise ValueError(
            "probs must be finite and non-negative (they look like logits); "
            "pass probabilities, e.g. softmax(logits)"
        )
    worst = (p.sum(dim=1) - 1.0).abs().max().item()
    if worst > _ROW_SUM_TOL:
        raise ValueError(
            f"rows of probs must sum to 1 (within {_ROW_SUM_TOL}), but one is off by {worst:.3g}; "
            "pass probabilities, e.g. softmax(logits)"
        )
    return p


def _check(probs: Any, labels: Any) -> tuple[Tensor, Tensor]:
    p = _check_probs(probs)
    y = torch.as_tensor(labels)
    if y.shape != (p.shape[0],):
        raise ValueError(f"labels must have shape ({p.shape[0]},), got {tuple(y.shape)}")
    if y.is_floating_point() or y.is_complex():
        raise ValueError(f"labels must be integer class indices, got {y.dtype}")
    y = y.to(device=p.device, dtype=torch.long)
    if y.min() < 0 or y.max() >= p.shape[1]:
        raise ValueError(f"labels must lie in [0, {p.shape[1] - 1}], got [{y.min()}, {y.max()}]")
    return p, y


def accuracy(probs: Any, labels: Any) -> float:
    """Fraction of rows whose most probable class is the label."""
    p, y = _check(probs, labels)
    return torch.eq(p.argmax(dim=1), y).double().mean().item()


def nll(probs: Any, labels: Any, eps: float = 1e-12) -> float:
    """Mean negative log-likelihood ``-log p[label]`` (probabilities clamped at ``eps``)."""
    p, y = _check(probs, labels)
    picked = p.gather(1, y[:, None]).squeeze(1)
    return -torch.log(picked.clamp_min(eps)).mean().item()


def brier_score(probs: Any, labels: Any) -> float:
    """Mean over rows of ``sum_c (p_c - onehot_c)^2`` (between 0 and 2)."""
    p, y = _check(probs, labels)
    onehot = torch.zeros_like(p).scatter_(1, y[:, None], 1.0)
    return (p - onehot).square().sum(dim=1).mean().item()


def predictive_entropy(probs: Any) -> Tensor:
    """Entropy ``-sum_c p_c log p_c`` of each row, in nats (shape ``(N,)``)."""
    p = _check_probs(probs)
    return -torch.special.xlogy(p, p).sum(dim=1)


@dataclass(frozen=True)
class CalibrationBins:
    """Per-bin confidence, accuracy and size; empty bins are left out."""

    confidence: Tensor  # mean top-class probability in the bin
    accuracy: Tensor  # fraction correct in the bin
    count: Tensor  # number of rows in the bin
    lower: Tensor  # bin edges (confidence range)
    upper: Tensor


def calibration_bins(
    probs: Any, labels: Any, n_bins: int = 20, binning: Binning = "mass"
) -> CalibrationBins:
    """Group rows by top-class confidence into ``n_bins`` bins.

    ``binning="width"``: bins ``(i/n, (i+1)/n]`` of equal width (confidence 0 goes to the first).
    ``binning="mass"``: rows sorted by confidence and split into bins of equal size (sizes differ
    by at most one, larger bins first, as ``numpy.array_split``). Tie rule: rows of equal
    confidence are ordered incorrect before correct, so the bins (and the ECE) depend only on the
    set of (confidence, correct) pairs, never on the order of the rows.

    ``probs`` must be probabilities: non-negative, rows summing to 1 within 1e-3 (a ``ValueError``
    says so otherwise; pass ``softmax(logits)``).
    """
    if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be an integer >= 1, got {n_bins!r}")
    p, y = _check(probs, labels)
    conf, pred = p.max(dim=1)
    correct = torch.eq(pred, y).double()
    if binning == "width":
        idx = (torch.ceil(conf * n_bins).long() - 1).clamp(0, n_bins - 1)
        groups = [torch.nonzero(idx == b).squeeze(1) for b in range(n_bins)]
        edges = [(b / n_bins, (b + 1) / n_bins) for b in range(n_bins)]
    elif binning == "mass":
        # tie rule: sort by (confidence, correct) so that the row order never matters
        by_correct = torch.argsort(correct, stable=True)
        order = by_correct[torch.argsort(conf[by_correct], stable=True)]
        groups = list(torch.tensor_split(order, n_bins))
        edges = [
            (conf[g].min().item(), conf[g].max().item()) if len(g) else (0.0, 0.0) for g in groups
        ]
    else:
        raise ValueError(f"binning must be 'width' or 'mass', got {binning!r}")
    keep = [i for i, g in enumerate(groups) if len(g) > 0]
    return CalibrationBins(
        confidence=torch.stack([conf[groups[i]].mean() for i in keep]),
        accuracy=torch.stack([correct[groups[i]].mean() for i in keep]),
        count=torch.tensor([len(groups[i]) for i in keep]),
        lower=torch.tensor([edges[i][0] for i in keep], dtype=torch.float64),
        upper=torch.tensor([edges[i][1] for i in keep], dtype=torch.float64),
    )


def expected_calibration_error(
    probs: Any, labels: Any, n_bins: int = 20, binning: Binning = "mass"
) -> float:
    """``sum_b |B_b| / N * |accuracy_b - confidence_b|`` over confidence bins.

    Defaults follow the SWAG paper's code (20 equal-mass bins); ``binning="width"`` gives the
    classic equal-width ECE.
    """
    bins = calibration_bins(probs, labels, n_bins, binning)
    weights = bins.count.double() / bins.count.sum()
    return (weights * (bins.accuracy - bins.confidence).abs()).sum().item()
