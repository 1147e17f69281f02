"""Multi-SWA training (Wilson & Izmailov, 2020): one SWA member per seed with
:func:`ember.train.fit`, returned as an :class:`ember.swa.MultiSWA` ensemble."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ember.swa.bn import has_running_stats, update_bn
from ember.swa.multiswa import MultiSWA
from ember.train.loop import fit

__all__ = ["train_multiswa"]


def train_multiswa(make_model: Callable[[], nn.Module],
                   make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                   make_loader: Callable[[int], Iterable[Any]], config: Any,
                   seeds: Sequence[int], *, bn_loader: Iterable[Any] | None = None,
                   **fit_kwargs: Any) -> MultiSWA:
    """Train one SWA member per seed with :func:`ember.train.fit` and return the ensemble.

    For each seed: ``torch.manual_seed(seed)``, then ``make_model()`` (initial weights),
    ``make_optimizer(model)`` and ``make_loader(seed)`` (the data order), and ``fit`` with
    ``config`` (a ``TrainConfig`` with ``swa_start`` set; its ``seed`` is replaced by the member's
    seed). The member is the SWA model, BatchNorm recomputed on ``bn_loader`` when it has such
    layers (required then).
    """
    if getattr(config, "swa_start", None) is None:
        raise ValueError("config.swa_start is None: Multi-SWA members need an SWA phase")
    seeds = list(seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be a non-empty list of distinct integers, got {seeds}")
    members = []
    for seed in seeds:
        torch.manual_seed(seed)
        model = make_model()
        if has_running_stats(model) and bn_loader is None:
            raise ValueError("the model has BatchNorm layers: pass bn_loader (training data)")
        result = fit(model, make_optimizer(model), make_loader(seed), replace(config, seed=seed),
                     bn_loader=bn_loader, **fit_kwargs)
        if result.swa is None:
            raise RuntimeError(f"fit returned no SWA model for seed {seed} (is swa_start < "
                               f"epochs?)")
        member = copy.deepcopy(result.swa.module)
        if bn_loader is not None:
            update_bn(bn_loader, member)
        members.append(member)
    return MultiSWA(members)
