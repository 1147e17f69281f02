"""The components :func:`ember.train.fit` is made of, one concern each (see :mod:`.base`)."""

from ember.train.components.base import HOOKS, Component, Progress, Run, StopTraining

__all__ = ["HOOKS", "Component", "Progress", "Run", "StopTraining"]
