"""The run's records: each epoch's record kept in order, the epoch counter moved on, and every
rank's weights digest at the end."""

from __future__ import annotations

from typing import Any

from ember.train.checkpoint import weights_digest
from ember.train.components.base import Component, Run
from ember.train.distributed import all_gather_objects

__all__ = ["History"]


class History(Component):
    """Closes each epoch's record (after the components that add to it) and the run."""

    def __init__(self) -> None:
        self.digests: list[str] = []

    def on_epoch_end(self, run: Run, record: dict[str, Any]) -> None:
        p = run.progress
        p.history.append(record)
        p.epoch, p.micro, p.epoch_loss_sum, p.loss_batches = record["epoch"] + 1, 0, 0.0, 0

    def on_fit_end(self, run: Run) -> None:
        self.digests = all_gather_objects(weights_digest(run.model), run.world)
        run.report["ranks_in_sync"] = len(set(self.digests)) == 1
