"""Evaluation after every epoch: accuracy and NLL of every model the run keeps."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ember.swa import update_bn
from ember.swa.bn import has_running_stats
from ember.train.components.averaging import Averaging
from ember.train.components.base import Component, Run
from ember.train.inference import evaluate
from ember.train.precision import Precision

__all__ = ["Evaluation", "evaluate_kept"]


def evaluate_kept(model: nn.Module, averagers: dict[str, Any], eval_loader: Iterable,
                  bn_loader: Iterable | None, precision: Precision, device: torch.device,
                  bn_batches: int | None) -> dict[str, Any]:
    """Metrics of every model kept: ``eval_*`` (raw), ``eval_ema_*``, ``eval_swa_*``.

    The SWA model is evaluated on a copy whose BatchNorm statistics are recomputed on at most
    ``bn_batches`` batches of ``bn_loader``; with BatchNorm and no ``bn_loader`` it is not
    evaluated (``eval_swa_skipped`` says why). Torch's random state is left as it was.
    """
    out: dict[str, Any] = {f"eval_{k}": v
                           for k, v in evaluate(model, eval_loader, precision, device).items()}
    ema, swa = averagers.get("ema"), averagers.get("swa")
    if ema is not None:
        out.update({f"eval_ema_{k}": v for k, v in
                    evaluate(ema.module, eval_loader, precision, device).items()})
    if swa is not None and swa.n_updates > 0:
        if has_running_stats(swa.module) and bn_loader is None:
            out["eval_swa_skipped"] = "BatchNorm statistics need bn_loader"
        else:
            averaged = copy.deepcopy(swa.module)
            devices = [device] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                if bn_loader is not None and has_running_stats(averaged):
                    update_bn(bn_loader, averaged, device=device, max_batches=bn_batches)
                out.update({f"eval_swa_{k}": v for k, v in
                            evaluate(averaged, eval_loader, precision, device).items()})
    return out


class Evaluation(Component):
    """Adds ``eval_*`` metrics to each epoch's record (rank 0 reads ``eval_loader``)."""

    def __init__(self, eval_loader: Iterable, bn_loader: Iterable | None, averaging: Averaging,
                 precision: Precision, bn_batches: int | None) -> None:
        self.eval_loader, self.bn_loader, self.averaging = eval_loader, bn_loader, averaging
        self.precision, self.bn_batches = precision, bn_batches

    def on_epoch_end(self, run: Run, record: dict[str, Any]) -> None:
        if not run.world.is_main:
            return
        record.update(evaluate_kept(run.model, self.averaging.averagers(), self.eval_loader,
                                    self.bn_loader, self.precision, run.device, self.bn_batches))
        errors = getattr(self.eval_loader, "error_count", None)
        if errors is not None:  # skipped in the (last) evaluation pass
            record["eval_data_errors"] = int(errors)
