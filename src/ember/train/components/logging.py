"""The metrics log (JSON lines) and the progress bars: what a person watching the run sees."""

from __future__ import annotations

import os
from typing import Any

from ember.train.components.base import Component, Run
from ember.train.metrics_log import MetricsLog

__all__ = ["MetricsLogger", "ProgressBar"]


class MetricsLogger(Component):
    """Writes ``start``/``resume``, ``step`` (every ``log_every`` steps and every skipped one),
    ``epoch`` and ``end`` records (rank 0)."""

    def __init__(self, path: str | os.PathLike | None, log_every: int, resumed_from: Any,
                 start: dict[str, Any]) -> None:
        self.path, self.log_every = path, log_every
        self.resumed_from, self.start = resumed_from, start
        self.log: MetricsLog | None = None

    def on_fit_start(self, run: Run) -> None:
        self.log = MetricsLog(self.path if run.world.is_main else None)
        p = run.progress
        if self.resumed_from is not None:
            self.log.write("resume", checkpoint=str(self.resumed_from), step=p.step,
                           epoch=p.epoch)
        else:
            self.log.write("start", **self.start)

    def on_step_end(self, run: Run, record: dict[str, Any]) -> None:
        if record["step"] % self.log_every == 0 or record["skipped"]:
            self.log.write("step", **record)  # type: ignore[union-attr]

    def on_epoch_end(self, run: Run, record: dict[str, Any]) -> None:
        self.log.write("epoch", **record)  # type: ignore[union-attr]

    def on_fit_end(self, run: Run) -> None:
        p = run.progress
        self.log.write("end", steps=p.step, skipped_steps=p.skipped_steps,  # type: ignore[union-attr]
                       dropped_microbatches=p.dropped_microbatches, empty_steps=p.empty_steps,
                       **run.report)

    def close(self, run: Run) -> None:
        if self.log is not None:
            self.log.close()


def _length(loader: Any) -> int | None:
    """Batches per epoch where the loader knows (a progress bar's total), else None."""
    try:
        return len(loader)
    except TypeError:
        return None


class ProgressBar(Component):
    """A tqdm bar per epoch (rank 0, when enabled)."""

    def __init__(self, enabled: bool, epochs: int) -> None:
        self.enabled, self.epochs = enabled, epochs
        self.bar: Any = None

    def on_fit_start(self, run: Run) -> None:
        from tqdm.auto import tqdm

        p = run.progress
        on = self.enabled and run.world.is_main and p.epoch < self.epochs and not run.stop
        # total and description from the start: a bar drawn before its first reset showed
        # "0batch" with no total
        self.bar = tqdm(unit="batch", disable=not on, dynamic_ncols=True, mininterval=0.5,
                        total=_length(run.loader), desc=f"epoch {p.epoch + 1}/{self.epochs}")

    def on_epoch_start(self, run: Run, epoch: int) -> None:
        self.bar.reset(total=_length(run.loader))
        self.bar.update(run.progress.micro)  # batches of this epoch done before a resume
        self.bar.set_description_str(f"epoch {epoch + 1}/{self.epochs}")

    def on_batch_end(self, run: Run) -> None:
        self.bar.update(1)

    def on_step_end(self, run: Run, record: dict[str, Any]) -> None:
        if self.bar.disable:
            return  # formatting a hidden bar's postfix costs every step
        loss = record["loss"]
        self.bar.set_postfix(loss="empty" if loss is None else f"{loss:.4f}",
                             skipped=run.progress.skipped_steps, refresh=False)

    def close(self, run: Run) -> None:
        if self.bar is not None:
            self.bar.close()
