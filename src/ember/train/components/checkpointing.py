"""Checkpoints: everything a run needs to continue bit for bit, written between optimizer steps
(after every epoch, and every ``checkpoint_every`` steps) and restored on resume.

The components' states go under their keys (beside ``model``, ``optimizer``, ``progress``,
``ranks``, ``world_size`` and ``settings``), the options a resumed run must share with its
checkpoint come from the components' ``settings()``; this module owns only what is the run's
own: model, optimizer, progress, random states and the data position.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from ember.train.checkpoint import CHECKPOINT_NAME, rng_state, save_checkpoint, set_rng_state
from ember.train.components.base import Component, Progress, Run
from ember.train.distributed import all_gather_objects
from ember.train.errors import ConfigError

__all__ = ["Checkpointing"]

# what checkpoints written before an option existed were trained with
LEGACY_SETTINGS = {"swa_every_steps": None, "swa_schedule": "anneal", "swa_cycle": None,
                   "swag_diagonal": False, "swag_params": None, "scheduler_interval": "epoch",
                   "swa_cycle_shape": "linear", "swa_collect_start": 0.5, "private": False}


def _check_same_model(saved: dict[str, Any], mine: dict[str, Any]) -> None:
    """A ConfigError naming the first difference between a checkpoint's model and this run's."""
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or extra:
        raise ConfigError("the checkpoint's model is not this run's model: "
                          + (f"it lacks {missing[0]}" if missing else f"it has {extra[0]} in addition"))
    for name, t in mine.items():
        if tuple(saved[name].shape) != tuple(t.shape):
            raise ConfigError(f"the checkpoint's model is not this run's model: {name} has shape "
                              f"{tuple(saved[name].shape)} in the checkpoint and {tuple(t.shape)} "
                              "here")


class Checkpointing(Component):
    """Writes ``last.pt`` in ``directory`` (owner-only when ``secret``: a private run's holds the
    noise key) and restores a run from a checkpoint."""

    def __init__(self, directory: Any, every: int | None, components: list[Any]) -> None:
        self.path = Path(directory) / CHECKPOINT_NAME if directory is not None else None
        self.every, self.components = every, components

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"private": any(c.key == "privacy" for c in self.components)}
        for c in self.components:
            if c is not self:
                out.update(c.settings())
        return out

    def save(self, run: Run) -> None:
        """Every rank must call it (it gathers every rank's random and data state)."""
        for c in self.components:
            before = getattr(c, "before_save", None)
            if before is not None:
                before(run)
        loader = run.loader
        mine = {"rng": rng_state(), "ember": run.generator.get_state(),
                "data": loader.state_dict() if hasattr(loader, "state_dict") else None}
        ranks = all_gather_objects(mine, run.world)
        if not run.world.is_main or self.path is None:
            return
        state = {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
                 "progress": asdict(run.progress), "ranks": ranks,
                 "world_size": run.world.size, "settings": self.settings(),
                 **{c.key: c.state_dict() for c in self.components if c.key}}
        secret = any(c.key == "privacy" for c in self.components)
        save_checkpoint(self.path, state, owner_only=secret)

    def on_step_end(self, run: Run, record: dict[str, Any]) -> None:
        if self.every and run.progress.step % self.every == 0:
            self.save(run)

    def on_epoch_end(self, run: Run, record: dict[str, Any]) -> None:
        if self.path is not None:
            self.save(run)

    def restore(self, run: Run, state: dict[str, Any]) -> None:
        """Load ``state`` into the run (after every component's setup and wrap)."""
        if state["world_size"] != run.world.size:
            raise ConfigError(f"checkpoint was written by {state['world_size']} processes, this "
                              f"run has {run.world.size}; resume with the same number")
        for key, value in self.settings().items():
            saved = state["settings"].get(key, LEGACY_SETTINGS.get(key))
            if key == "private" and saved != value:
                raise ConfigError("the checkpoint was written with privacy; resume it with "
                                  "privacy=" if saved else "the checkpoint was written without "
                                  "privacy; resume it without")
            if saved != value:
                raise ConfigError(f"checkpoint was written with {key}={saved!r}, this "
                                  f"run has {key}={value!r}")
        _check_same_model(state["model"], run.model.state_dict())
        run.model.load_state_dict(state["model"])
        for c in self.components:
            if c.key:
                c.load_state_dict(state.get(c.key))
        run.optimizer.load_state_dict(state["optimizer"])
        for c in self.components:
            after = getattr(c, "after_optimizer_restored", None)
            if after is not None:
                after()
        self._restore_own(run, state)

    def _restore_own(self, run: Run, state: dict[str, Any]) -> None:
        mine = state["ranks"][run.world.rank]
        set_rng_state(mine["rng"])
        run.generator.set_state(mine["ember"])
        run.progress = Progress(**state["progress"])
        if mine["data"] is not None:
            if not hasattr(run.loader, "load_state_dict"):
                raise ConfigError("the checkpoint holds a data position but the training loader "
                                  "has no load_state_dict(); use an ember.shards.ShardLoader")
            run.loader.load_state_dict(mine["data"])
        elif run.progress.micro:
            raise ConfigError("the checkpoint was taken mid-epoch with a loader that cannot "
                              "resume mid-epoch; use an ember.shards.ShardLoader or checkpoint "
                              "only at epoch ends")
