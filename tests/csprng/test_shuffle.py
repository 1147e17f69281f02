"""randperm's passes: the compiled ones (ember.csprng._shuffle) against their NumPy twins."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import ember.csprng as csprng
from ember.csprng import shuffle

compiled = pytest.mark.skipif(not shuffle.compiled_available(),
                              reason="ember.csprng._shuffle was not built (no C compiler)")


def _words(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, 2 * n, dtype=np.uint32)


def _refill(seed: int):
    rng = np.random.default_rng(seed)
    return lambda k: rng.integers(0, 2**32, k, dtype=np.uint32)


def test_bucket_bits_keep_buckets_near_2_to_the_15():
    assert [shuffle.bucket_bits(n) for n in (2, 2**15, 2**15 + 1, 2**16, 10**7)] == [0, 0, 1, 1, 9]
    assert shuffle.bucket_bits(2**60) == shuffle.MAX_BUCKET_BITS


@compiled
@pytest.mark.parametrize("n", [2, 3, 1000, 2**15 + 1, 200_003])
def test_compiled_passes_equal_the_numpy_twins(n):
    from ember.csprng import _shuffle

    w = _words(n, n)
    bits = shuffle.bucket_bits(n) + (2 if n > 3 else 0)  # more buckets than randperm uses, too
    out_c, out_n = np.empty(n, np.int64), np.empty(n, np.int64)
    off_c, off_n = np.empty((1 << bits) + 1, np.int64), np.empty((1 << bits) + 1, np.int64)
    _shuffle.scatter(w[:n], bits, out_c, off_c)
    shuffle.scatter_numpy(w[:n], bits, out_n, off_n)
    assert np.array_equal(off_c, off_n) and np.array_equal(out_c, out_n)
    assert np.array_equal(np.sort(out_c), np.arange(n))
    fy = w[n:].copy()
    fy[::97] = 0  # a zero word is rejected for every range that is not a power of two
    buckets = 1 << bits
    want = shuffle.rejects_numpy(fy, off_n, 0, buckets)
    assert _shuffle.rejects(fy, off_c, 0, buckets) == want
    assert len(want) > 0 or n < 100
    lo, hi = buckets // 3, buckets
    assert _shuffle.rejects(fy, off_c, lo, hi) == [q for q in want if q >= off_n[lo]]
    _shuffle.apply(out_c, fy, off_c, lo, hi)
    shuffle.apply_numpy(out_n, fy, off_n, lo, hi)
    assert np.array_equal(out_c, out_n)


@compiled
@pytest.mark.parametrize("n", [5, 70_001, (1 << 20) + 7])
def test_permutation_is_the_same_compiled_numpy_and_threaded(n):
    w = _words(n, 1)
    w[n::13] = 0  # forces rejected Fisher-Yates words, hence reject-stream rounds
    results = []
    for use_compiled, pool in ((True, None), (False, None), (True, ThreadPoolExecutor(1))):
        out = np.empty(n, np.int64)
        shuffle.permutation(w.copy(), out, _refill(2), pool=pool, use_compiled=use_compiled)
        results.append(out)
    assert np.array_equal(np.sort(results[0]), np.arange(n))
    assert all(np.array_equal(results[0], r) for r in results[1:])


def test_rejected_replacements_are_redrawn_until_accepted():
    # every Fisher-Yates word is 0 and the reject stream's first round is all 0 too: a second round
    n = 50
    w = np.zeros(2 * n, np.uint32)
    calls = []

    def refill(k):
        calls.append(k)
        return np.zeros(k, np.uint32) if len(calls) == 1 else _refill(3)(k)

    out = np.empty(n, np.int64)
    shuffle.permutation(w, out, refill, use_compiled=False)
    non_power_of_two = sum(1 for m in range(2, n + 1) if m & (m - 1))
    assert calls == [non_power_of_two, non_power_of_two]
    assert np.array_equal(np.sort(out), np.arange(n))


@compiled
def test_compiled_passes_refuse_bad_offsets_and_ranges():
    from ember.csprng import _shuffle

    w = np.zeros(10, np.uint32)
    out = np.arange(10, dtype=np.int64)
    with pytest.raises(ValueError, match="from 0 to the number"):
        _shuffle.apply(out, w, np.array([0, 5, 9], np.int64), 0, 2)
    with pytest.raises(ValueError, match="non-decreasing"):
        _shuffle.rejects(w, np.array([0, 7, 3, 10], np.int64), 0, 3)
    with pytest.raises(ValueError, match="outside"):
        _shuffle.apply(out, w, np.array([0, 10], np.int64), 0, 2)
    with pytest.raises(ValueError, match="bits"):
        _shuffle.scatter(w, 30, out, np.empty(2, np.int64))
    with pytest.raises(ValueError, match="one int64 per word"):
        _shuffle.scatter(w, 0, np.empty(3, np.int64), np.empty(2, np.int64))


def test_torch_randperm_is_the_same_without_the_compiled_module(monkeypatch):
    n = 70_001
    want = torch.randperm(n, generator=csprng.create_generator(4))
    monkeypatch.setattr(shuffle, "_compiled", None)
    got = torch.randperm(n, generator=csprng.create_generator(4))
    assert torch.equal(got, want)
    assert torch.equal(torch.sort(got).values, torch.arange(n))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.float32, torch.float64])
def test_other_dtypes_and_strided_out_hold_the_int64_permutation(dtype):
    n = 300
    want = torch.randperm(n, generator=csprng.create_generator(6))
    got = torch.randperm(n, generator=csprng.create_generator(6), dtype=dtype)
    assert got.dtype == dtype and torch.equal(got.to(torch.int64), want)
    out = torch.empty(n, 2, dtype=torch.int64)[:, 0]  # not contiguous
    torch.randperm(n, generator=csprng.create_generator(6), out=out)
    assert torch.equal(out, want)
