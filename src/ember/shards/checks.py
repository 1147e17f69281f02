"""Argument checks of the public API, with torch's kind of messages: a TypeError for a value of
the wrong type, a ValueError for one out of range, each naming the argument."""

from __future__ import annotations

import operator
from typing import Any

__all__ = ["integer"]


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
