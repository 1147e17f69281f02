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
# Box-Muller's exact steps: built only where C evaluates floats in their own precision
_compiled_normal = _compiled if hasattr(_compiled, "normal_outputs") else None

__all__ = ["bounded32", "unit_float32", "normal_inputs", "normal_outputs", "pair_halves",
           "pair_runs", "compiled_available"]


def compiled_available() -> bool:
    """Whether the compiled transforms are in use."""
    return _compiled is not None


def normal_compiled() -> bool:
    """Whether Box-Muller's exact steps (:func:`normal_inputs`, :func:`normal_outputs`) run
    compiled."""
    return _compiled_normal is not None


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


def pair_halves(x: np.ndarray, m: int, group: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(first halves, second halves) of the groups of ``m`` pairs laid out in ``x`` (2m items):
    each group of ``group`` pairs (the last may be smaller) holds its first items, then its
    second items."""
    full, q = divmod(m, group)
    views = []
    if full:
        v = x[: 2 * full * group].reshape(full, 2, group)
        views.append((v[:, 0, :], v[:, 1, :]))
    if q:
        t = x[2 * full * group: 2 * m]
        views.append((t[:q], t[q:]))
    return views


def pair_runs(x: np.ndarray, m: int, group: int) -> list[np.ndarray]:
    """``x`` (one item per pair, ``m`` items) cut as :func:`pair_halves` cuts a group's half."""
    full, q = divmod(m, group)
    views = []
    if full:
        views.append(x[: full * group].reshape(full, group))
    if q:
        views.append(x[full * group: m])
    return views


def normal_inputs_numpy(words: np.ndarray, m: int, group: int, bits: int, angle: float,
                        r: np.ndarray, th: np.ndarray) -> None:
    """Box-Muller's inputs of ``m`` pairs whose words lie in groups (see :func:`pair_halves`):
    with ``k = word & (2**bits - 1)``, ``r = (k + 1) * 2**-bits`` and ``th = k * angle`` in
    ``r``'s dtype. Masks ``words`` in place."""
    cd = r.dtype.type
    np.bitwise_and(words, words.dtype.type((1 << bits) - 1), out=words)
    k = words.view(np.int64 if words.itemsize == 8 else np.int32)  # masked below the sign bit
    for (wr, wt), rr, tt in zip(pair_halves(k, m, group), pair_runs(r, m, group),
                                pair_runs(th, m, group), strict=True):
        np.copyto(rr, wr, casting="unsafe")  # exact: k < 2**bits
        np.copyto(tt, wt, casting="unsafe")
    np.add(r, cd(1.0), out=r)
    np.multiply(r, cd(2.0**-bits), out=r)
    np.multiply(th, cd(angle), out=th)


def normal_outputs_numpy(logr: np.ndarray, c: np.ndarray, s: np.ndarray, m: int, group: int,
                         z: np.ndarray) -> None:
    """``rad = sqrt(-2 * logr)``; ``c * rad`` and ``s * rad`` into the first and second half of
    each pair's group in ``z``. Overwrites ``logr`` with ``rad``."""
    np.multiply(logr, logr.dtype.type(-2.0), out=logr)
    np.sqrt(logr, out=logr)
    for (zc, zs), rr, cc, ss in zip(pair_halves(z, m, group), pair_runs(logr, m, group),
                                    pair_runs(c, m, group), pair_runs(s, m, group), strict=True):
        np.multiply(cc, rr, out=zc)
        np.multiply(ss, rr, out=zs)


def _normal_inputs_any(words, m: int, group: int, bits: int, angle: float, r: np.ndarray,
                       th: np.ndarray, wide: bool) -> None:
    if not isinstance(words, np.ndarray):  # a bytes-like keystream buffer
        words = np.frombuffer(words, np.dtype("<u8" if wide else "<u4"), 2 * m)
    normal_inputs_numpy(words[: 2 * m], m, group, bits, angle, r, th)


def _normal_outputs_any(logr: np.ndarray, c: np.ndarray, s: np.ndarray, m: int, group: int,
                        z: np.ndarray, wide: bool) -> None:
    normal_outputs_numpy(logr, c, s, m, group, z)


# normal_inputs(words, m, group, bits, angle, r, th, wide): normal_inputs_numpy's values, in one
# pass where the extension is built; ``words`` (an array or a bytes-like keystream buffer holding
# at least 2m words of 8 bytes if ``wide`` else 4) is then left as it is, else masked in place.
# normal_outputs(logr, c, s, m, group, z, wide): normal_outputs_numpy's values, likewise; ``c``
# and ``s`` may be ``z``'s own halves when the pairs are one group. Bound to the C functions
# themselves where built: they run on every small normal draw.
normal_inputs = _compiled_normal.normal_inputs if _compiled_normal else _normal_inputs_any
normal_outputs = _compiled_normal.normal_outputs if _compiled_normal else _normal_outputs_any
