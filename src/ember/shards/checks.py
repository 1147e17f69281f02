"""Argument checks of the public API, with torch's kind of messages: a TypeError for a value of
the wrong type, a ValueError for one out of range, each naming the argument."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import numpy as np

__all__ = ["boolean", "integer", "real"]


def boolean(value: Any, name: str) -> bool:
    """``value`` as a bool if it is one (Python's or NumPy's; not a string, number or None,
    whose truth says nothing)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def integer(value: Any, name: str, *, minimum: int | None = None) -> int:
    """``value`` as an int (ints and integer types such as NumPy's; not bools, floats or
    strings), at least ``minimum``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def real(value: Any, name: str, *, minimum: float | None = None, above: float | None = None,
         maximum: float | None = None) -> float:
    """``value`` as a float (ints, floats and NumPy's real scalars; not bools or strings), not
    NaN, at least ``minimum``, greater than ``above`` and at most ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if math.isnan(number):
        raise ValueError(f"{name} must be a number, got nan")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    if above is not None and not number > above:
        raise ValueError(f"{name} must be > {above}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {number}")
    return number
