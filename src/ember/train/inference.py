"""Predictions and metrics of a model over a loader of ``(inputs, targets)`` batches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ember.train.precision import Precision

__all__ = ["evaluate", "predict", "split_batch"]


def split_batch(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"expected batches of (inputs, targets), got {type(batch).__name__}"
                        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    x, y = batch
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


@torch.no_grad()
def predict(model: nn.Module, loader: Iterable, precision: str | Precision = "fp32",
            device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Class probabilities (float32) and targets over ``loader``'s ``(inputs, targets)`` batches."""
    policy = precision if isinstance(precision, Precision) else Precision(precision)
    was_training = model.training
    model.eval()
    probs, targets = [], []
    try:
        for batch in loader:
            x, y = split_batch(batch, torch.device(device))
            with policy.autocast():
                logits = model(x)
            probs.append(torch.softmax(logits.float(), dim=-1).cpu())
            targets.append(y.cpu())
    finally:
        model.train(was_training)
    if not probs:
        raise ValueError("predict: the loader yielded no batches")
    return torch.cat(probs), torch.cat(targets)


def evaluate(model: nn.Module, loader: Iterable, precision: str | Precision = "fp32",
             device: str | torch.device = "cpu") -> dict[str, float]:
    """Accuracy and mean negative log-likelihood of ``model`` on ``loader``."""
    from ember.swa import accuracy, nll

    probs, targets = predict(model, loader, precision, device)
    return {"accuracy": accuracy(probs, targets), "nll": nll(probs, targets)}


