"""NumPy views of CPU tensors' memory that leave the tensors as torch made them.

``Tensor.numpy()`` marks the tensor's storage as never resizable again (so that the array cannot
outlive its memory). A draw that used it on the user's tensor would change what the user can do
with that tensor afterwards: ``x.resize_(n)``, or ``torch.randn(n, out=x)`` with a new size, would
raise where torch's own draws leave them working. ember only reads and writes such tensors for the
duration of one call, so it takes its views through the tensor's raw memory instead. Each view
keeps its tensor alive; nothing may resize the tensor while a view of it is in use.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

__all__ = ["array_view", "flat_view", "tensor_bytes"]

_NUMPY = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
          torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16,
          torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_}
_NUMPY.update({getattr(torch, f"uint{b}"): getattr(np, f"uint{b}") for b in (16, 32, 64)
               if hasattr(torch, f"uint{b}")})


def _memory(t: torch.Tensor, nbytes: int) -> np.ndarray:
    """``nbytes`` bytes of ``t``'s memory from its first element on, as a 1-D array of its dtype
    (``t`` a CPU tensor; callers resolve conjugate and negative bits first)."""
    dtype = _NUMPY.get(t.dtype)
    if dtype is None:
        raise TypeError(f"NumPy has no dtype for {t.dtype}")
    if nbytes == 0:
        return np.empty(0, dtype)
    # typed Any (an annotation costs nothing at run time): ctypes arrays take attributes and
    # are buffers, which the stubs do not say
    buf: Any = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    buf._tensor = t  # the array's base holds the tensor, and so its memory
    return np.frombuffer(buf, dtype)  # no copy


def flat_view(t: torch.Tensor) -> np.ndarray:
    """A writable 1-D NumPy view of a contiguous CPU tensor's elements (as
    ``t.numpy().reshape(-1)`` gives, without making ``t`` unresizable)."""
    if not (t.is_cpu and t.is_contiguous()):
        raise ValueError("flat_view needs a contiguous CPU tensor")
    return _memory(t, t.nbytes)


def array_view(t: torch.Tensor) -> np.ndarray:
    """A writable NumPy view of a CPU tensor with its shape and strides (as ``t.numpy()``
    gives, without making ``t`` unresizable)."""
    if not t.is_cpu or t.is_conj() or t.is_neg():
        raise ValueError("array_view needs a CPU tensor without conjugate or negative bits")
    if t.is_contiguous():
        return _memory(t, t.nbytes).reshape(tuple(t.shape))
    if t.numel() == 0:
        return np.empty(tuple(t.shape), _NUMPY.get(t.dtype, np.uint8))
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    base = _memory(t, span * t.element_size())
    size = t.element_size()
    return np.lib.stride_tricks.as_strided(base, tuple(t.shape),
                                           tuple(s * size for s in t.stride()))


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A copy of the tensor's element bytes in element order (on any device)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    return bytes(flat_view(t.view(-1).view(torch.uint8))) if t.numel() else b""
