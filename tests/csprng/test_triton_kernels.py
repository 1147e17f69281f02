"""The Triton kernels (run on CPU tensors under Triton's interpreter) against the CPU sampler."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ember.csprng.chacha  # noqa: F401  (registers "chacha20")
from ember.csprng.distributions import NativeSampler
from ember.csprng.stream import BlockStream

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")
KEY = bytes(range(16))
COUNTERS = [5, 2**32 - 3, 2**64 - 5]
EXACT = [
    ("uniform_", torch.float32, ()), ("uniform_", torch.float64, (-2.0, 3.0)),
    ("uniform_", torch.float16, (-2.0, 3.0)), ("uniform_", torch.bfloat16, ()),
    ("random_range_", torch.int64, (-5, 2**31 + 1)),
    ("random_range_", torch.int64, (-2**62, 2**62 + 7)),
    ("random_range_", torch.int64, (0, 2**32)), ("random_", torch.bool, ()),
    ("random_", torch.int8, ()), ("bernoulli_", torch.float32, (0.3,)),
]


def _pair(cipher: str, counter: int, method: str, dtype: torch.dtype, n: int, params: tuple):
    from ember.csprng.cuda_backend import triton_fill_

    ref_s = NativeSampler(BlockStream(KEY, counter, cipher))
    ker_s = NativeSampler(BlockStream(KEY, counter, cipher))
    ref, got = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    getattr(ref_s, method)(ref, *params)
    assert triton_fill_(ker_s, got, method, params, interpret=True)
    assert ker_s.stream.counter == ref_s.stream.counter
    return ref, got


@pytest.mark.parametrize("cipher", ["aes128", "chacha20"])
@pytest.mark.parametrize("counter", COUNTERS)
@pytest.mark.parametrize("method,dtype,params", EXACT)
def test_kernel_matches_cpu_bit_for_bit(cipher, counter, method, dtype, params):
    ref, got = _pair(cipher, counter, method, dtype, 101, params)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("cipher", ["aes128", "chacha20"])
@pytest.mark.parametrize("method,dtype,params", [
    ("normal_", torch.float32, ()), ("normal_", torch.float64, (1.0, 2.0)),
    ("log_normal_", torch.float16, ()), ("exponential_", torch.float32, (2.0,)),
    ("geometric_", torch.int64, (0.3,)), ("normal_", torch.bfloat16, ()),
])
def test_transcendental_kernels_match_numpy_under_interpreter(cipher, method, dtype, params):
    ref, got = _pair(cipher, 7, method, dtype, 99, params)
    assert torch.equal(ref, got)
