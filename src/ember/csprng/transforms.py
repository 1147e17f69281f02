"""One-pass word-to-value transforms of the CPU path, compiled where a C compiler was present.

``ember.csprng._transforms`` (optional, built by setup.py) does in one pass over the words what
the NumPy formulations below do in several; the values are the same (tests run both on the same
words). Without the extension the NumPy formulations run.
"""

from __future__ import annotations

import sys

import numpy as np

try:
    from ember.csprng import _transforms as _compiled
except ImportError:  # no C compiler at install time
    _compiled = None
if sys.byteorder != "little":  # the keystream words are little-endian; the C code reads native
    _compiled = None

__all__ = ["bounded32", "unit_float32", "compiled_available"]


def compiled_available() -> bool:
    """Whether the compiled transforms are in use."""
    return _compiled is not None


def bounded32_numpy(words: np.ndarray, r: int, offset: int, out: np.ndarray) -> int:
    """``out = (words & (r - 1)) + offset`` for a power-of-two ``r``, else Lemire's
    ``((words * r) >> 32) + offset`` (mod 2**64); returns how many words Lemire's method rejects
    (the low 32 bits of ``words * r`` below ``2**32 mod r``)."""
    if r & (r - 1) == 0:
        np.bitwise_and(words, np.uint32(r - 1) if r < 1 << 32 else np.uint32(0xFFFFFFFF), out=out,
                       casting="unsafe")
        rejected = 0
    else:
        np.copyto(out, words, casting="unsafe")
        np.multiply(out, np.uint64(r), out=out)
        low = np.multiply(words, np.uint32(r))
        np.right_shift(out, np.uint64(32), out=out)
        rejected = int(np.count_nonzero(low < np.uint32((1 << 32) % r)))
    if offset:
        np.add(out, np.uint64(offset), out=out)
    return rejected


def unit_float32_numpy(words: np.ndarray, bits: int, scale: float, out: np.ndarray) -> None:
    """``out = float32(words & (2**bits - 1)) * float32(scale)``."""
    k = np.bitwise_and(words, np.uint32((1 << bits) - 1))
    np.copyto(out, k.view(np.int32), casting="unsafe")
    np.multiply(out, np.float32(scale), out=out)


def bounded32(words: np.ndarray, r: int, offset: int, out: np.ndarray) -> int:
    """:func:`bounded32_numpy` in one pass where the extension is built."""
    if _compiled is None:
        return bounded32_numpy(words, r, offset, out)
    return _compiled.bounded32(words, r, offset, out)


def unit_float32(words: np.ndarray, bits: int, scale: float, out: np.ndarray) -> None:
    """:func:`unit_float32_numpy` in one pass where the extension is built (``out`` may be the
    words' own memory)."""
    if _compiled is None:
        unit_float32_numpy(words, bits, scale, out)
    else:
        _compiled.unit_float32(words, bits, scale, out)
