"""Block floating point (BFP) quantization with stochastic or nearest rounding.

A block of values shares one exponent ``e = floor(log2(max |x|))`` taken over the block; every
value keeps a signed integer mantissa of ``wl`` bits: ``q = clamp(round(x / 2^(e - wl + 2)),
-2^(wl-1), 2^(wl-1) - 1) * 2^(e - wl + 2)``, with the shared exponent ``e`` clamped to the range
of ``ebit`` bits (``[-2^(ebit-1), 2^(ebit-1) - 1]``, 8 bits by default as in SWALP's reference).
Blocks that are all zero stay zero. Pure torch: no
compiled extension (QPyTorch, which SWALP used, compiles C++ at import time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["BlockQuantizer", "block_quantize"]

_ROUNDINGS = ("stochastic", "nearest")


def _check(wl: int, dim: int | None, block_size: int | None, rounding: str,
           ebit: int | None = 8) -> None:
    if isinstance(wl, bool) or not isinstance(wl, int) or wl < 2:
        raise ValueError(f"word length wl must be an int >= 2 (sign bit plus at least one bit), got {wl!r}")
    if ebit is not None and (isinstance(ebit, bool) or not isinstance(ebit, int) or ebit < 2):
        raise ValueError(f"exponent bits ebit must be an int >= 2 or None (unbounded), got {ebit!r}")
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}")
    if dim is not None and block_size is not None:
        raise ValueError("give at most one of dim= (one block per slice) and block_size= (fixed-size blocks)")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                   or block_size < 1):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def _block_max(a: Tensor, dim: int | None, block_size: int | None) -> Tensor:
    """max |x| of each value's block, broadcastable against ``a`` (or per element for block_size)."""
    if block_size is not None:
        flat = a.reshape(-1)
        n = flat.numel()
        pad = (-n) % block_size
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        m = flat.view(-1, block_size).amax(dim=1, keepdim=True).expand(-1, block_size)
        return m.reshape(-1)[:n].reshape(a.shape)
    if dim is None or a.dim() == 0:
        return a.amax() if a.numel() else a.new_zeros(())
    d = dim % a.dim()
    others = [i for i in range(a.dim()) if i != d]
    return a.amax(dim=others, keepdim=True) if others else a


def _times_pow2(t: Tensor, k: Tensor) -> Tensor:
    """``t * 2^k`` for integer-valued ``k``, in two factors so neither overflows nor underflows
    for exponents up to twice the dtype's range (e.g. tiny gradients in float32)."""
    half = torch.floor(k / 2)
    return t * torch.exp2(half) * torch.exp2(k - half)


@torch.compiler.disable  # runs eagerly under torch.compile: dynamo cannot trace rand(generator=)
def block_quantize(
    x: Tensor,
    wl: int,
    *,
    dim: int | None = None,
    block_size: int | None = None,
    rounding: str = "stochastic",
    ebit: int | None = 8,
    generator: Any = None,
) -> Tensor:
    """Return ``x`` quantized to block floating point with ``wl``-bit signed mantissas.

    Blocks: the whole tensor by default; with ``dim=k`` one block per index along dimension ``k``
    (``dim=0``: per row of a weight matrix or per output filter of a convolution); with
    ``block_size=B`` consecutive runs of ``B`` values of the flattened tensor. ``rounding`` is
    ``"stochastic"`` (unbiased: rounds up with probability equal to the fractional part, random bits
    from ``torch.rand(..., generator=generator)``, so a ``torch.Generator`` or an
    :mod:`ember.csprng` generator both work) or ``"nearest"`` (ties to even). Values beyond the
    largest mantissa saturate. The shared exponent ``floor(log2 max|x|)`` is clamped to what ``ebit``
    bits hold (``[-2^(ebit-1), 2^(ebit-1) - 1]``; ``None``: no bound), so blocks far below
    ``2^-128`` flush to zero and far above ``2^127`` saturate. Non-finite inputs raise
    ``ValueError``. The result has ``x``'s dtype.
    """
    _check(wl, dim, block_size, rounding, ebit)
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"block_quantize expects a floating-point tensor, got {type(x).__name__}"
                        + (f" of dtype {x.dtype}" if isinstance(x, Tensor) else ""))
    if x.numel() == 0:
        return x.clone()
    work = x.detach().to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    if dim is not None and x.dim() > 0 and not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} out of range for a tensor with {x.dim()} dimensions")
    maxabs = _block_max(work.abs(), dim, block_size)
    if not bool(torch.isfinite(maxabs).all()):  # nan and inf propagate through the block max
        raise ValueError("block_quantize got non-finite values (inf or nan); they have no BFP encoding")
    _, exp = torch.frexp(maxabs)  # maxabs = m * 2^exp, m in [0.5, 1): floor(log2 maxabs) = exp - 1
    # One mantissa step is 2^shift; scaling by powers of two is exact. A zero block has exp 0 and
    # all-zero values, which round to zero under both roundings.
    e = exp - 1
    if ebit is not None:
        e = e.clamp(-(2 ** (ebit - 1)), 2 ** (ebit - 1) - 1)
    shift = (e - (wl - 2)).to(work.dtype)
    v = _times_pow2(work, -shift)
    if rounding == "nearest":
        r = torch.round(v)
    else:
        r = torch.floor(v)
        u = torch.rand(v.shape, generator=generator, dtype=v.dtype, device=v.device)
        r += u < (v - r)
    lim = float(2 ** (wl - 1))
    out = _times_pow2(r.clamp_(-lim, lim - 1), shift)
    return out.to(x.dtype)


@dataclass(frozen=True)
class BlockQuantizer:
    """A configured :func:`block_quantize`: ``q(x, generator=g)`` quantizes ``x``.

    ``wl``, ``dim``, ``block_size``, ``rounding`` and ``ebit`` are as for :func:`block_quantize` and checked
    at construction; with ``dim`` set, tensors of fewer than 2 dimensions (biases) form one block.
    """

    wl: int = 8
    dim: int | None = None
    block_size: int | None = None
    rounding: str = "stochastic"
    ebit: int | None = 8

    def __post_init__(self) -> None:
        _check(self.wl, self.dim, self.block_size, self.rounding, self.ebit)

    def __call__(self, x: Tensor, *, generator: Any = None) -> Tensor:
        dim = self.dim
        if dim is not None and x.dim() < 2:
            dim = None  # per-row on a bias vector: one block for the whole vector
        return block_quantize(x, self.wl, dim=dim, block_size=self.block_size,
                              rounding=self.rounding, ebit=self.ebit, generator=generator)
