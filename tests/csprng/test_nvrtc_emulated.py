"""The NVRTC kernels' source, compiled as C++ for the CPU (tests/csprng/cuda_emulation), driven by
the real host code (cuda_fast) on CPU tensors: values and stream positions against the CPU sampler.

This checks on a machine without a GPU everything but the CUDA compiler and the hardware: the
counter and word mapping of both ciphers, the groups of normal pairs, the fused transforms, the
stores and the on-device rejection refill. Float64 functions are the C library's here (libdevice's
on a GPU), so transcendental values are compared within the documented ulp bounds.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ember.csprng import cuda_fast, nvrtc_kernels
from ember.csprng.distributions import NativeSampler
from ember.csprng.stream import BlockStream

HERE = Path(__file__).parent / "cuda_emulation"
KEY = bytes(range(3, 19))
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    build = tmp_path_factory.mktemp("emu")
    (build / "kernels.inc").write_text(nvrtc_kernels.source())
    lib = build / "emu.so"
    proc = subprocess.run(
        ["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-pthread",
         f"-I{build}", str(HERE / "emulation.cpp"), "-o", str(lib)],
        capture_output=True, text=True)
    if proc.returncode != 0:
        if "_Float16" in proc.stderr or "barrier" in proc.stderr:
            pytest.skip("this g++ lacks _Float16 or std::barrier")
        raise AssertionError(proc.stderr[-4000:])
    so = ctypes.CDLL(str(lib))
    assert so.emu_params_size() == ctypes.sizeof(nvrtc_kernels.Params)

    class Emulated:
        calls: list[str] = []

        def resident_blocks(self, device: int, name: str) -> int:
            return 8  # at most 8 blocks: grid-stride loops run several rounds

        def launch(self, device, name, grid, params, stream) -> None:
            self.calls.append(name)
            assert so.emu_launch(name.encode(), grid, ctypes.byref(params)) == 0

    old = cuda_fast.set_launcher(Emulated())
    yield
    cuda_fast.set_launcher(old)


def _pair(cipher, counter, method, dtype, n, params):
    cpu_s = NativeSampler(BlockStream(KEY, counter, cipher))
    emu_s = NativeSampler(BlockStream(KEY, counter, cipher))
    cpu = torch.full((n,), 7, dtype=dtype)
    emu = torch.full((n,), 7, dtype=dtype)
    getattr(cpu_s, method)(cpu, *params)
    cuda_fast.fast_fill_(emu_s, emu, method, params)
    assert cpu_s.stream.counter == emu_s.stream.counter
    return cpu, emu


CIPHERS = ["aes128", "chacha20"]
COUNTERS = {"aes128": [0, 2**32 - 3, 2**64 - 5], "chacha20": [0, 5, 2**34 - 7, 2**66 - 9]}
EXACT = [
    ("uniform_", torch.float32, ()), ("uniform_", torch.float32, (-2.0, 3.0)),
    ("uniform_", torch.float64, ()), ("uniform_", torch.float64, (-2.0, 3.0)),
    ("uniform_", torch.float16, ()), ("uniform_", torch.float16, (-2.0, 3.0)),
    ("uniform_", torch.bfloat16, ()), ("uniform_", torch.bfloat16, (-1.0, 7.0)),
    ("random_range_", torch.int64, (-5, 2**31 + 1)), ("random_range_", torch.int64, (-(2**62), 2**62 + 7)),
    ("random_range_", torch.int64, (0, 2**32)), ("random_range_", torch.int64, (-(2**63), 2**63)),
    ("random_range_", torch.int32, (-1000, 1000)), ("random_range_", torch.uint8, (0, 200)),
    ("random_range_", torch.float32, (-1000, 1000)), ("random_range_", torch.bfloat16, (0, 100)),
    ("random_range_", torch.float16, (-5, 5)), ("random_range_", torch.bool, (0, 2)),
    ("random_", torch.int8, ()), ("random_", torch.float64, ()),
    ("bernoulli_", torch.bool, (0.3,)), ("bernoulli_", torch.float32, (0.7,)),
    ("bernoulli_", torch.int64, (1e-12,)), ("bernoulli_", torch.float16, (0.3,)),
]


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("n", [1, 7, 4099, 20_011])
@pytest.mark.parametrize("case", EXACT, ids=[f"{c[0]}-{str(c[1])[6:]}-{c[2]}" for c in EXACT])
def test_emulated_kernels_are_bit_identical(emulator, cipher, n, case):
    method, dtype, params = case
    for counter in COUNTERS[cipher][:2] if n > 5000 else COUNTERS[cipher]:
        cpu, emu = _pair(cipher, counter, method, dtype, n, params)
        assert torch.equal(cpu, emu), (counter, (cpu != emu).nonzero()[:5])


def test_emulated_bernoulli_tensor_p(emulator):
    p = torch.rand(3001, dtype=torch.float64)
    p[::7] = 1.0
    p[::11] = 0.0
    for cipher in CIPHERS:
        cpu, emu = _pair(cipher, 6, "bernoulli_", torch.float32, 3001, (p,))
        assert torch.equal(cpu, emu)


def _ulp(a: torch.Tensor, b: torch.Tensor) -> int:
    it = {torch.float32: np.int32, torch.float64: np.int64, torch.float16: np.int16, torch.bfloat16: np.int16}
    ia = a.view(torch.int16 if a.element_size() == 2 else a.dtype).numpy().view(it[a.dtype]).astype(np.int64)
    ib = b.view(torch.int16 if b.element_size() == 2 else b.dtype).numpy().view(it[b.dtype]).astype(np.int64)
    low = np.int64((1 << (8 * a.element_size() - 1)) - 1)  # all bits but the sign
    ia = np.where(ia < 0, -(ia & low), ia)
    ib = np.where(ib < 0, -(ib & low), ib)
    return int(np.abs(ia - ib).max())


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 999, 2 * 16384 * 2 + 77])
@pytest.mark.parametrize("method,params", [("normal_", ()), ("exponential_", ()), ("normal_", (2.0, 0.5)),
                                           ("log_normal_", (0.0, 0.25))])
def test_emulated_transcendental_within_ulps(emulator, cipher, dtype, n, method, params):
    """Normal groups (full and partial), both ciphers: within a few ulp of the CPU (C library
    float64 functions here against NumPy float32 functions there)."""
    cpu, emu = _pair(cipher, 2**32 - 2 if cipher == "aes128" else 7, method, dtype, n, params)
    bound = {torch.float32: 8, torch.float64: 4, torch.float16: 1, torch.bfloat16: 1}[dtype]
    assert _ulp(cpu, emu) <= bound


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("mean,std", [(0.0, 1.0), (0.0, 1.3)])
def test_emulated_normal_multi_equals_per_tensor_calls(emulator, cipher, mean, std):
    """One launch for many tensors (normal_foreach_ on CUDA): each tensor gets the values of its
    own normal_ call, in order; empty tensors and several dtypes included."""
    specs = [((1, 1), torch.float32), ((0,), torch.float32), ((3, 5), torch.float64), ((1, 1), torch.float32),
             ((40_000,), torch.float32), ((7,), torch.bfloat16), ((2 * 16384 + 9,), torch.float64),
             ((1,), torch.float16), ((0,), torch.float64)]
    cpu_s = NativeSampler(BlockStream(KEY, 2**32 - 9, cipher))
    emu_s = NativeSampler(BlockStream(KEY, 2**32 - 9, cipher))
    cpu = [torch.empty(s, dtype=d) for s, d in specs]
    emu = [torch.full(s, 7.0, dtype=d) for s, d in specs]
    for t in cpu:
        cpu_s.normal_(t, mean, std)
    cuda_fast.normal_multi_(emu_s, emu, mean, std)
    assert cpu_s.stream.counter == emu_s.stream.counter
    for a, b in zip(cpu, emu, strict=True):
        bound = {torch.float32: 8, torch.float64: 4}.get(a.dtype, 1)
        assert a.shape == b.shape and (a.numel() == 0 or _ulp(a.view(-1), b.view(-1)) <= bound)


def test_emulated_secure_noise_equals_opacus_procedure(emulator):
    """One launch for Opacus's secure noise of many tensors: per tensor a throw-away draw and four
    draws summed and halved, against the same procedure with per-call CPU draws."""
    shapes = [(16, 3, 3, 3), (16,), (1,), (0,), (3, 16384 * 2 + 5), (7,)]
    std = 1.3
    cpu_s = NativeSampler(BlockStream(KEY, 41))
    emu_s = NativeSampler(BlockStream(KEY, 41))
    want = []
    for s in shapes:
        cpu_s.normal_(torch.empty(1, 1), 0.0, std)
        total = torch.zeros(s)
        for _ in range(4):
            z = torch.empty(s)
            cpu_s.normal_(z, 0.0, std)
            total += z
        want.append(total / 2)
    got = [torch.full(s, 7.0) for s in shapes]
    cuda_fast.secure_noise_(emu_s, got, std)
    assert cpu_s.stream.counter == emu_s.stream.counter
    for a, b in zip(want, got, strict=True):
        # four float32 normals each within a few ulp (C library vs NumPy functions)
        assert a.shape == b.shape and (a.numel() == 0 or float((a - b).abs().max()) <= 4e-5 * std)
