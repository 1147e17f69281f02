"""User callbacks: objects with any of ``on_fit_start()``, ``on_step_end(step, record)``,
``on_epoch_end(epoch, record)``, ``on_fit_end(result)``, and optionally ``state_dict()`` /
``load_state_dict(state)`` (saved in checkpoints, restored on resume). Raising
:class:`StopTraining` from ``on_step_end`` or ``on_epoch_end`` ends the run cleanly."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ember.train.components.base import Component, Run, StopTraining
from ember.train.errors import ConfigError

__all__ = ["FunctionCallback", "UserCallbacks"]


class FunctionCallback:
    """``fit``'s ``on_step=``/``on_epoch=`` functions as a callback."""

    def __init__(self, on_step: Callable[[int, dict], None] | None = None,
                 on_epoch: Callable[[int, dict], None] | None = None) -> None:
        if on_step is not None:
            self.on_step_end = on_step
        if on_epoch is not None:
            self.on_epoch_end = on_epoch


class UserCallbacks(Component):
    """Calls the user's callbacks by name, in order, after ember's own components."""

    def __init__(self, callbacks: Sequence[Any]) -> None:
        self.callbacks = list(callbacks)
        # only callbacks with a state are saved (a stateless one may come or go on resume)
        self.key = "callbacks" if any(hasattr(cb, "state_dict") for cb in self.callbacks) else ""

    def _each(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every callback; a StopTraining from one still lets the others see
        the event, then ends the run."""
        stop = False
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if method is None:
                continue
            try:
                method(*args)
            except StopTraining:
                stop = True
        if stop:
            raise StopTraining

    def on_fit_start(self, run: Run) -> None:
        self._each("on_fit_start")

    def on_step_end(self, run: Run, record: dict[str, Any]) -> None:
        try:
            self._each("on_step_end", record["step"], record)
        except StopTraining:
            run.stop = True

    def on_epoch_end(self, run: Run, record: dict[str, Any]) -> None:
        try:
            self._each("on_epoch_end", record["epoch"], record)
        except StopTraining:
            run.stop = True

    def fit_ended(self, result: Any) -> None:
        self._each("on_fit_end", result)

    def _stateful(self) -> list[Any]:
        return [cb for cb in self.callbacks if hasattr(cb, "state_dict")]

    def state_dict(self) -> list[Any]:
        """The states of the callbacks that have one, in order."""
        return [cb.state_dict() for cb in self._stateful()]

    def load_state_dict(self, state: list[Any] | None) -> None:
        mine = self._stateful()
        state = state or []
        if len(state) != len(mine):
            raise ConfigError(f"the checkpoint holds the states of {len(state)} callbacks, this "
                              f"run has {len(mine)} with a state_dict: resume with the same "
                              "callbacks")
        for cb, s in zip(mine, state, strict=True):
            if hasattr(cb, "load_state_dict"):
                cb.load_state_dict(s)
