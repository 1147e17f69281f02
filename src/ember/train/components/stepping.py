"""The optimizer step: precision (torch.amp autocast and GradScaler), gradient accumulation,
clipping, and DDP's gradient sync only on the micro-batch that closes a step."""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch

from ember.train.components.base import Component, Run
from ember.train.config import TrainConfig
from ember.train.precision import Precision

__all__ = ["Accumulation", "Stepping"]


class Accumulation:
    """Which micro-batch closes an optimizer step: every ``k``-th of an epoch."""

    def __init__(self, k: int) -> None:
        self.k = k

    def closes_step(self, run: Run) -> bool:
        return (run.progress.micro + 1) % self.k == 0

    def context(self, run: Run, closes: bool) -> contextlib.AbstractContextManager:
        # DDP all-reduces gradients only on the micro-batch that closes a step
        if run.world.distributed and not closes \
                and isinstance(run.net, torch.nn.parallel.DistributedDataParallel):
            return run.net.no_sync()
        return contextlib.nullcontext()

    def between_steps(self, run: Run) -> None:
        """After a micro-batch that does not close a step (gradients add up in ``.grad``)."""


class Stepping(Component):
    """Forward, backward and the optimizer step of every micro-batch."""

    key = "scaler"

    def __init__(self, config: TrainConfig, device: torch.device, loss_fn: Any) -> None:
        self.config = config.step
        self.precision = Precision(self.config.precision, device.type)
        self.scaler = self.precision.make_scaler()
        self.loss_fn = loss_fn
        self.batching: Any = Accumulation(self.config.accumulate)

    def settings(self) -> dict[str, Any]:
        return {"precision": self.config.precision, "accumulate": self.config.accumulate}

    def state_dict(self) -> Any:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: Any) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state)

    def wrap(self, run: Run) -> None:
        """DistributedDataParallel around the model when several processes train (unless
        another component, privacy, does its own gradient sum)."""
        if run.world.distributed and run.ddp:
            run.net = torch.nn.parallel.DistributedDataParallel(run.model)

    def close(self, run: Run) -> None:
        """Let the DDP wrapper go now, while its process group still exists: a reducer freed
        after the group was destroyed aborts the process at exit."""
        if isinstance(run.net, torch.nn.parallel.DistributedDataParallel):
            run.net = run.model
            gc.collect()  # the wrapper may sit in a reference cycle

    def closes_step(self, run: Run) -> bool:
        return self.batching.closes_step(run)

    def backward(self, run: Run, x: torch.Tensor, y: torch.Tensor, closes: bool) -> float | None:
        """Forward and backward of one micro-batch; its loss, or None for an empty batch (a
        Poisson batch may hold no example: its gradient is zero and the loss function is not
        asked for the mean of nothing)."""
        empty = y.dim() > 0 and y.shape[0] == 0
        with self.batching.context(run, closes):
            with self.precision.autocast():
                logits = run.net(x)
            loss = logits.float().sum() * 0.0 if empty else self.loss_fn(logits.float(), y)
            scaled = loss / self.config.accumulate if self.config.accumulate > 1 else loss
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return None if empty else float(loss.detach())

    def step(self, run: Run) -> tuple[bool, float | None]:
        """One real step on the accumulated gradients; (skipped, gradient norm before
        clipping)."""
        optimizer, scaler = run.optimizer, self.scaler
        if scaler is not None:
            scaler.unscale_(optimizer)  # clip true gradients, not scaled ones
        if self.config.max_grad_value is not None:
            torch.nn.utils.clip_grad_value_(run.model.parameters(), self.config.max_grad_value)
        grad_norm = None
        if self.config.max_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(run.model.parameters(),
                                                             self.config.max_grad_norm))
        skipped = False
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(optimizer)  # skipped internally when unscale_ found inf/nan
            scaler.update()
            skipped = scaler.get_scale() < before  # the scale backs off exactly on a skip
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return skipped, grad_norm

    def on_step_end(self, run: Run, record: dict[str, Any]) -> None:
        if self.scaler is not None:
            record["scale"] = self.scaler.get_scale()

    def on_epoch_end(self, run: Run, record: dict[str, Any]) -> None:
        leftover = run.progress.micro % self.config.accumulate
        if leftover:  # micro-batches that closed no step: dropped and counted
            run.optimizer.zero_grad(set_to_none=True)
            run.progress.dropped_microbatches += leftover

