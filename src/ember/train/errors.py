"""Errors raised by ember.train for bad configuration, so callers can tell them from bugs."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A training option, a combination of options, or the data location is invalid."""
