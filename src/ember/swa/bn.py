"""Recomputing BatchNorm running statistics for averaged or sampled weights (``update_bn``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ember.swa._batches import Forward, default_forward, to_device

__all__ = ["update_bn", "has_running_stats"]


def _stat_modules(model: nn.Module) -> list[_NormBase]:
    return [
        m
        for m in model.modules()
        if isinstance(m, _NormBase) and m.track_running_stats and m.running_mean is not None
    ]


def has_running_stats(model: nn.Module) -> bool:
    """Whether ``model`` holds normalisation layers with running statistics (BatchNorm & co.)."""
    return bool(_stat_modules(model))


@torch.no_grad()
def update_bn(
    loader: Iterable[Any],
    model: nn.Module,
    device: torch.device | str | int | None = None,
    *,
    forward: Forward | None = None,
    max_batches: int | None = None,
) -> int:
    """Reset and recompute the running statistics of every BatchNorm-like layer of ``model``.

    The statistics become the exact cumulative average over the batches seen (every batch weighs
    the same, as in ``torch.optim.swa_utils.update_bn``). Batches may be tensors, tuples/lists (the
    first element is the input), dicts (passed as keyword arguments), or anything ``forward``
    understands: ``forward(model, batch)`` is called instead of the default when given. Tensors in
    the batch are moved to ``device`` when it is set (positional third, as in
    ``torch.optim.swa_utils.update_bn(loader, model, device)``). ``model`` may be an
    :class:`ember.swa.SWA`/:class:`ember.swa.EMA` (or torch's ``AveragedModel``).
    At most ``max_batches`` batches are used.
    The train/eval mode of every submodule and every layer's momentum are restored afterwards.

    Returns the number of batches used (0 when the model has no such layers, in which case the
    loader is not read).
    """
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be a positive integer or None, got {max_batches}")
    layers = _stat_modules(model)
    if not layers:
        return 0
    call = default_forward if forward is None else forward
    modes = {m: m.training for m in model.modules()}
    momenta = {m: m.momentum for m in layers}
    # the statistics as they were, put back when no new ones are computed (empty loader, error)
    saved = {layer: {k: v.clone() for k, v in layer.state_dict().items()} for layer in layers}
    n_batches = 0
    done = False
    try:
        for layer in layers:
            layer.reset_running_stats()
            layer.momentum = None  # None makes BatchNorm keep a cumulative (equal-weight) average
        model.train()
        for batch in loader:
            if max_batches is not None and n_batches >= max_batches:
                break
            call(model, to_device(batch, device))
            n_batches += 1
        done = n_batches > 0
    finally:
        if not done:
            with torch.no_grad():
                for layer, state in saved.items():
                    for k, v in layer.state_dict().items():
                        v.copy_(state[k])
        for layer, momentum in momenta.items():
            layer.momentum = momentum
        for module, training in modes.items():
            module.training = training
    if n_batches == 0:
        raise ValueError("update_bn: the loader yielded no batches, so no statistics were computed")
    return n_batches
