"""randperm of stream layout version 3: a random scatter into buckets, then Fisher-Yates in each.

The permutation of ``0..n-1`` is built from ``2n`` 32-bit words (docs/csprng-stream.md):

1. **scatter**: element ``i`` goes to bucket ``bucket_words[i] >> (32 - bits)`` (``2**bits``
   buckets of about 2**15 elements, so that each fits in a core's L2 cache); buckets are laid out
   one after the other, each in increasing element order (Rao-Sandelius: independent uniform
   bucket labels, then a uniform shuffle of each bucket, give an exactly uniform permutation);
2. **Fisher-Yates** in each bucket: for ``p`` from ``size - 1`` down to 1, swap entries ``p`` and
   ``j = floor(w * (p + 1) / 2**32)``, ``w`` the word of that position; a word Lemire's method
   rejects is first replaced from the draw's ``reject`` stream (increasing position order, rounds
   until none is rejected), so every ``j`` is exactly uniform.

The three passes are compiled in :mod:`ember.csprng._shuffle` (optional; it releases the GIL,
so halves of the buckets are shuffled on two threads). Where it was not built, the NumPy twins
below give the same values, more slowly; they are also the reference the tests compare it with.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

try:
    from ember.csprng import _shuffle as _compiled
except ImportError:  # no C compiler at install time: the NumPy twins do the work
    _compiled = None

__all__ = ["BUCKET_BITS_TARGET", "bucket_bits", "permutation", "compiled_available"]

# average bucket of at most 2**15 elements (256 KiB of int64): inside L2 on current CPUs
BUCKET_BITS_TARGET = 15
MAX_BUCKET_BITS = 24
# below this many elements one thread does the shuffle (handing half to a thread costs ~50 us)
PARALLEL_ELEMENTS = 1 << 20


def compiled_available() -> bool:
    """Whether the compiled passes are in use (else the NumPy twins, same values)."""
    return _compiled is not None


def bucket_bits(n: int) -> int:
    """log2 of the number of buckets for a permutation of ``n`` elements."""
    return min(MAX_BUCKET_BITS, max(0, (n - 1).bit_length() - BUCKET_BITS_TARGET))


# ---------------------------------------------------------------------------- NumPy twins
def scatter_numpy(bucket_words: np.ndarray, bits: int, out: np.ndarray,
                  offsets: np.ndarray) -> None:
    """Twin of ``_shuffle.scatter``: ``out`` gets the buckets of ``0..n-1`` in turn."""
    n = bucket_words.size
    if bits == 0:
        out[:] = np.arange(n, dtype=np.int64)
        offsets[:] = (0, n)
        return
    keys = bucket_words >> np.uint32(32 - bits)
    out[:] = np.argsort(keys, kind="stable")
    offsets[0] = 0
    np.cumsum(np.bincount(keys, minlength=1 << bits), out=offsets[1:])


def _ranges(offsets: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, m) of buckets lo..hi-1: every position and its Fisher-Yates range p + 1."""
    sizes = np.diff(offsets[lo:hi + 1])
    q = np.arange(offsets[lo], offsets[hi], dtype=np.int64)
    m = q - np.repeat(offsets[lo:hi], sizes) + 1
    return q, m


def _rejected(words: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Mask of the words Lemire's method rejects for the ranges ``m`` (uint32 words)."""
    m = m.astype(np.uint64)
    low = (words.astype(np.uint64) * m) & np.uint64(0xFFFFFFFF)
    return low < (np.uint64(1 << 32) % m)


def rejects_numpy(fy_words: np.ndarray, offsets: np.ndarray, lo: int, hi: int) -> list[int]:
    """Twin of ``_shuffle.rejects``: the rejected positions of buckets lo..hi-1, increasing."""
    q, m = _ranges(offsets, lo, hi)
    return q[_rejected(fy_words[q], m)].tolist()


def apply_numpy(out: np.ndarray, fy_words: np.ndarray, offsets: np.ndarray, lo: int,
                hi: int) -> None:
    """Twin of ``_shuffle.apply``: Fisher-Yates in each bucket, all buckets one step at a time."""
    starts = offsets[lo:hi]
    sizes = offsets[lo + 1:hi + 1] - starts
    order = np.argsort(-sizes, kind="stable")  # largest first: the active ones are a prefix
    starts, sizes = starts[order], sizes[order]
    for p in range(int(sizes.max(initial=0)) - 1, 0, -1):
        k = int(np.searchsorted(-sizes, -p, side="left"))  # buckets with size > p
        base = starts[:k]
        q = base + p
        j = base + ((fy_words[q].astype(np.uint64) * np.uint64(p + 1)) >> np.uint64(32)
                    ).astype(np.int64)
        held = out[q]  # fancy indexing copies
        out[q] = out[j]
        out[j] = held


# ---------------------------------------------------------------------------- driver
def _impl():
    if _compiled is not None:
        return _compiled.scatter, _compiled.rejects, _compiled.apply
    return scatter_numpy, rejects_numpy, apply_numpy


def permutation(words: np.ndarray, out: np.ndarray,
                refill: Callable[[int], np.ndarray], pool: Executor | None = None,
                use_compiled: bool | None = None) -> None:
    """Write the layout-3 permutation of ``n = out.size`` elements into ``out`` (int64).

    ``words`` are the draw's ``2n`` uint32 words (bucket words, then Fisher-Yates words; the
    array is modified where words are replaced); ``refill(k)`` returns the next ``k`` words of
    the draw's reject stream. ``pool``, when given and ``n`` is large, shuffles the second half
    of the buckets on another thread. ``use_compiled=False`` forces the NumPy twins.
    """
    n = out.size
    if words.dtype != np.uint32 or words.size != 2 * n or out.dtype != np.int64:
        raise ValueError("permutation: need 2n uint32 words and an int64 output of n elements")
    if use_compiled is None:
        scatter, rejects, apply = _impl()
    elif use_compiled:
        if _compiled is None:
            raise RuntimeError("ember.csprng._shuffle was not built")
        scatter, rejects, apply = _compiled.scatter, _compiled.rejects, _compiled.apply
    else:
        scatter, rejects, apply = scatter_numpy, rejects_numpy, apply_numpy
    bits = bucket_bits(n)
    buckets = 1 << bits
    offsets = np.empty(buckets + 1, np.int64)
    bucket_words, fy_words = words[:n], words[n:]
    scatter(bucket_words, bits, out, offsets)
    pending = np.asarray(rejects(fy_words, offsets, 0, buckets), np.int64)
    if pending.size:
        m = pending - offsets[np.searchsorted(offsets, pending, side="right") - 1] + 1
        while pending.size:
            w = np.asarray(refill(pending.size), np.uint32)
            bad = _rejected(w, m)
            fy_words[pending[~bad]] = w[~bad]
            pending, m = pending[bad], m[bad]
    if pool is None or n < PARALLEL_ELEMENTS or buckets < 2:
        apply(out, fy_words, offsets, 0, buckets)
        return
    half = buckets // 2
    second = pool.submit(apply, out, fy_words, offsets, half, buckets)
    apply(out, fy_words, offsets, 0, half)
    second.result()
