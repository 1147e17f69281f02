"""Tiny draws in plain Python: the same values as the NumPy transforms, at a fraction of the cost.

For a handful of values the NumPy path spends most of its time setting up arrays and ufunc calls.
The transforms here cover only the cases whose arithmetic Python reproduces exactly (integer ops,
and float products and sums that are exact or rounded once in the output's own precision), so a
value never depends on which path made it; transcendental functions still go through the NumPy
ufuncs of the large path, in one call each. bfloat16 uniforms and float32 affine ranges stay on the
NumPy path.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import torch

from . import transforms
from .ciphers import BLOCK_BYTES
from .stream import BlockStream
from .views import flat_view

SMALL_ITEMS = 64  # draws of at most this many values take the plain-Python path

# struct codes of the output dtypes this path can write
_CODE = {
    torch.float64: "d", torch.float32: "f", torch.float16: "e", torch.bool: "?",
    torch.int64: "q", torch.int32: "i", torch.int16: "h", torch.int8: "b", torch.uint8: "B",
}
_WORD = {2: "H", 4: "I", 8: "Q"}
_TWO_PI = 2.0 * math.pi


def _words(stream: BlockStream, n: int, size: int) -> tuple[int, tuple[int, ...]]:
    """Reserve the blocks of ``n`` words of ``size`` bytes; return (first block, the words)."""
    nbytes = n * size
    start, buf = stream.take(-(-nbytes // BLOCK_BYTES))
    return start, struct.unpack_from(f"<{n}{_WORD[size]}", buf)


def _write(out: torch.Tensor, values: list) -> None:
    view: Any = flat_view(out)  # a writable buffer (typed Any: the stubs do not say so)
    struct.pack_into(f"={len(values)}{_CODE[out.dtype]}", view, 0, *values)


def uniform(stream: BlockStream, out: torch.Tensor, n: int, a: float, b: float,
            bits: int, below: float) -> bool:
    """uniform_ for float64 (any range) and float32/float16 on [0, 1); False if not covered."""
    dtype = out.dtype
    if dtype == torch.float64:
        _, w = _words(stream, n, 8)
        mask, scale = (1 << bits) - 1, (b - a) * 2.0**-bits
        if a == 0.0 and b == 1.0:
            _write(out, [(x & mask) * scale for x in w])
        elif a == b:
            _write(out, [a] * n)
        else:  # the NumPy path: k * scale, + a, then clamped below b (all in float64)
            _write(out, [min((x & mask) * scale + a, below) for x in w])
        return True
    if dtype not in (torch.float32, torch.float16) or not (a == 0.0 and b == 1.0):
        return False
    _, w = _words(stream, n, 4 if dtype == torch.float32 else 2)
    mask, scale = (1 << bits) - 1, 2.0**-bits  # k * 2**-bits is exact in the output dtype
    _write(out, [(x & mask) * scale for x in w])
    return True


def integers(stream: BlockStream, out: torch.Tensor, n: int, low: int, r: int):
    """random_range_ values; returns (first block, rejected positions) or None if not covered.

    Rejected positions hold placeholders; the caller replaces them from the refill stream.
    """
    if out.dtype not in _CODE:
        return None
    wide = r > 1 << 32
    bits = 64 if wide else 32
    start, w = _words(stream, n, bits // 8)
    if r & (r - 1) == 0:
        mask = min(r, 1 << bits) - 1
        _write(out, [low + (x & mask) for x in w])
        return start, []
    full = (1 << bits) - 1
    threshold = (1 << bits) % r
    values, rejected = [], []
    for i, x in enumerate(w):
        p = x * r  # Lemire: keep floor(p / 2**bits) unless p's low bits fall below 2**bits mod r
        if p & full < threshold:
            rejected.append(i)
        values.append(low + (p >> bits))
    _write(out, values)
    return start, rejected


def bernoulli(stream: BlockStream, out: torch.Tensor, n: int, threshold: int) -> bool:
    """bernoulli_ with a scalar p: 1 where the 64-bit word is below ``threshold``."""
    if out.dtype not in _CODE:
        return False
    _, w = _words(stream, n, 8)
    _write(out, [x < threshold for x in w])
    return True


def normal(stream: BlockStream, out: torch.Tensor, n: int, mean: float, std: float,
           log: bool) -> None:
    """normal_/log_normal_ (``out`` contiguous, any float dtype), with the NumPy path's arithmetic.

    The exact steps (masking, the (k + 1) and angle products, which float64 holds exactly and
    rounds once to float32 like NumPy's float32 multiply) run in Python; the transcendental ones
    run through the same NumPy ufuncs as the large path, once over all values.
    """
    wide = out.dtype == torch.float64
    cd = np.float64 if wide else np.float32
    bits = 53 if wide else 24
    pairs = (n + 1) // 2
    _, w = _words(stream, 2 * pairs, 8 if wide else 4)
    mask = (1 << bits) - 1
    unit = 2.0**-bits
    angle = float(cd(_TWO_PI * unit))
    # one group (SMALL_ITEMS <= 2 * NORMAL_GROUP): radius words, then angle words
    u = np.array([((x & mask) + 1) * unit for x in w[:pairs]]
                 + [(x & mask) * angle for x in w[pairs:]], cd)
    r, th = u[:pairs], u[pairs:]
    np.log(r, out=r)
    np.multiply(r, cd(-2.0), out=r)
    np.sqrt(r, out=r)
    c = np.cos(th)
    np.sin(th, out=th)
    z = np.empty(2 * pairs, cd)
    np.multiply(c, r, out=z[:pairs])  # cosines, then sines
    np.multiply(th, r, out=z[pairs:])
    if not (mean == 0.0 and std == 1.0):
        np.multiply(z, cd(std), out=z)
        np.add(z, cd(mean), out=z)
    if log:
        np.exp(z, out=z)
    if out.dtype == torch.bfloat16:  # NumPy has no bfloat16: the large path converts with torch too
        out.view(-1).copy_(torch.from_numpy(z[:n]))
    else:
        np.copyto(flat_view(out), z[:n], casting="unsafe")


MEDIUM_PAIRS = 16384  # one normal group (distributions.NORMAL_GROUP): normal_medium's limit
_ANGLE = {24: float(np.float32(_TWO_PI * 2.0**-24)), 53: _TWO_PI * 2.0**-53}  # 2 pi 2**-bits


def normal_medium(stream: BlockStream, out: torch.Tensor, n: int, mean: float, std: float,
                  log: bool) -> None:
    """normal_/log_normal_ of one group of pairs (``out`` contiguous), with the large path's
    exact operations in the same order, minus its chunking machinery (the per-call cost of
    mid-sized draws such as ``randn(1000)`` is mostly that machinery)."""
    wide = out.dtype == torch.float64
    cd = np.float64 if wide else np.float32
    bits = 53 if wide else 24
    pairs = (n + 1) // 2
    size = 8 if wide else 4
    _, buf = stream.take(-(-(2 * pairs * size) // BLOCK_BYTES))
    direct = out.dtype in (torch.float32, torch.float64) and n == 2 * pairs
    z = flat_view(out) if direct else np.empty(2 * pairs, cd)
    r = np.empty(pairs, cd)
    th = z[pairs:]  # the angles, then their sines, in place of the sine values
    transforms.normal_inputs(buf, pairs, pairs, bits, _ANGLE[bits], r, th, wide)
    np.log(r, out=r)
    np.cos(th, out=z[:pairs])
    np.sin(th, out=th)
    transforms.normal_outputs(r, z[:pairs], th, pairs, pairs, z, wide)  # cosines, then sines
    if not (mean == 0.0 and std == 1.0):
        np.multiply(z, cd(std), out=z)
        np.add(z, cd(mean), out=z)
    if log:
        np.exp(z, out=z)
    if direct:
        return
    if out.dtype == torch.bfloat16:
        out.view(-1).copy_(torch.from_numpy(z[:n]))
    else:
        np.copyto(flat_view(out), z[:n], casting="unsafe")
