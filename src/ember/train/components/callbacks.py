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

    key = "callbacks"

    def __init__(self, callbacks: Sequence[Any]) -> None:
        self.callbacks = list(callbacks)

    def _each(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if method is not None:
                method(*args)

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

    def state_dict(self) -> list[Any]:
        return [cb.state_dict() if hasattr(cb, "state_dict") else None for cb in self.callbacks]

    def load_state_dict(self, state: list[Any] | None) -> None:
        state = state or [None] * len(self.callbacks)
        if len(state) != len(self.callbacks):
            raise ConfigError(f"the checkpoint holds the states of {len(state)} callbacks, this "
                              f"run has {len(self.callbacks)}: resume with the same callbacks")
        for cb, s in zip(self.callbacks, state, strict=True):
            if s is not None and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(s)
