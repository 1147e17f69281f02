"""Transparent huge pages for the large fresh outputs of ember's factory calls (Linux only).

A fresh tensor's pages are faulted in (and zeroed by the kernel) on their first write. For a
64 MiB ``torch.rand`` that is 16384 faults of 4 KiB, which cost ember more than making and
converting the keystream. Asking the kernel for transparent huge pages on the new memory
(``madvise(MADV_HUGEPAGE)``, what torch's allocator does for every large allocation when started
with ``THP_MEM_ALLOC_ENABLE=1``) makes that 32 faults of 2 MiB. It is advice only: the values are
the same, nothing is advised on other systems or when the kernel's THP mode is ``never``, and a
failed call is ignored.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) transparent huge page size
# Fresh CPU outputs of at least this many bytes are advised (smaller ones hold no whole huge page
# worth the system call); set to 0 to turn the advice off.
ADVISE_BYTES = 4 << 20
_MADV_HUGEPAGE = 14  # Linux's value on every architecture


@functools.cache
def _madvise():
    """libc's ``madvise`` on Linux, or None (other systems, THP off, no libc symbol)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_page_span(address: int, nbytes: int) -> tuple[int, int] | None:
    """The whole huge pages inside ``[address, address + nbytes)`` as ``(start, length)``, or None."""
    lo = -(-address // HUGE_PAGE) * HUGE_PAGE
    hi = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return (lo, hi - lo) if hi > lo else None


def advise_fresh(t: torch.Tensor) -> torch.Tensor:
    """Ask for huge pages on a newly allocated, not yet written CPU tensor ``t``; returns ``t``.

    Only the whole huge pages inside ``t``'s memory are advised, so no memory outside it changes
    and its resident size does not grow. Call it only on memory nobody has written yet.
    """
    nbytes = t.numel() * t.element_size()  # a new tensor is contiguous: its storage's size
    if nbytes < ADVISE_BYTES or ADVISE_BYTES <= 0 or t.device.type != "cpu":
        return t
    fn = _madvise()
    span = huge_page_span(t.data_ptr(), nbytes) if fn is not None else None
    if span is not None:
        fn(span[0], span[1], _MADV_HUGEPAGE)  # advice: a failure (EINVAL, ENOMEM) changes nothing
    return t
