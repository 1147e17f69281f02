"""Integer rejections of the Triton path are refilled on the device.

``random_``/``random_range_`` with a range that is not a power of two (Lemire, docs/csprng-stream.md)
reject some words; the rejected elements are refilled, in increasing element order, from the draw's
``reject`` stream: one word per pending element per round, each round at the next whole block.
The fill kernel lists the rejected positions on the device, they are sorted there and one program of
``refill_kernel`` runs the rounds, so the host never reads the count back (no ``.item()``, no copy
to the host: on a GPU each was a wait for the device). Run under Triton's interpreter on CPU
tensors and compared with the CPU sampler, bit for bit; a list overflow raises.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ember.csprng.chacha  # noqa: F401  (registers "chacha20")
from ember.csprng.distributions import NativeSampler
from ember.csprng.stream import BlockStream

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
KEY = bytes(range(16))
CIPHERS = ["aes128", "chacha20"]
# (dtype, (low, high)) with about half the words rejected (many rounds), and a few usual ranges
HEAVY = [
    (torch.int64, (-5, 2**31 + 1 - 5)),  # r = 2**31 + 1: 32-bit words, rejection ~ 1/2
    (torch.int64, (-(2**62), 2**62 + 1)),  # r = 2**63 + 1: 64-bit words, rejection ~ 1/2
    (torch.int32, (-(2**30), 2**30 + 1)),  # r = 2**31 + 1 into int32
    (torch.float64, (0, 2**31 + 1)),  # r = 2**31 + 1 into float64
    (torch.int64, (-(2**63), 2**62)),  # r = 3 * 2**62: 64-bit words, rejection 1/4
]
USUAL = [(torch.int16, (-1000, 1000)), (torch.uint8, (0, 200)), (torch.bfloat16, (0, 100))]


def sampler(cipher: str, counter: int) -> NativeSampler:
    return NativeSampler(BlockStream(KEY, counter, cipher))


def pair(cipher: str, counter: int, dtype: torch.dtype, n: int, rng: tuple[int, int]):
    """(CPU sampler's values, Triton kernels' values) of ``random_range_`` at one stream position."""
    from ember.csprng.cuda_backend import triton_fill_

    ref_s, ker_s = sampler(cipher, counter), sampler(cipher, counter)
    ref, got = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    ref_s.random_range_(ref, *rng)
    assert triton_fill_(ker_s, got, "random_range_", rng, interpret=True)
    assert ker_s.stream.counter == ref_s.stream.counter
    return ref, got


def _ids(case):
    dtype, (lo, hi) = case
    return f"{str(dtype).replace('torch.', '')}-r={hi - lo}"


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("n", [1, 3, 17, 263])
@pytest.mark.parametrize("case", HEAVY, ids=_ids)
def test_many_rejections_match_the_cpu_sampler(cipher, n, case):
    """About half the words rejected: ~log2(n) refill rounds, bit for bit; odd sizes; ChaCha20
    starting inside a block (counter 11)."""
    dtype, rng = case
    ref, got = pair(cipher, 11, dtype, n, rng)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("case", USUAL, ids=_ids)
def test_usual_ranges_match_the_cpu_sampler(cipher, case):
    dtype, rng = case
    ref, got = pair(cipher, 2**32 - 3, dtype, 333, rng)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("case", HEAVY[:2], ids=_ids)
def test_small_refill_program_compacts_across_chunks(monkeypatch, cipher, case):
    """A refill program of 16 lanes: every round walks its pending list in many chunks and
    compacts the still-rejected positions in order across them."""
    from ember.csprng import cuda_backend

    monkeypatch.setattr(cuda_backend, "_refill_block", lambda cipher, interpret: 16)
    dtype, rng = case
    ref, got = pair(cipher, 5, dtype, 301, rng)
    assert torch.equal(ref, got)


def _watch_host_reads(monkeypatch, k) -> tuple[list, list]:
    """Record reads of tensor data on the host (``.item()``, ``.cpu()``, ``.numpy()``, ``.tolist()``,
    ``int()``/``float()``/``bool()`` of a tensor) outside kernel launches (Triton's interpreter reads
    its arguments on the host itself), and the kernels launched."""
    reads: list = []
    launched: list = []
    inside = [0]

    def watch(name):
        real = getattr(torch.Tensor, name)

        def wrapper(self, *a, **kw):
            if not inside[0]:
                reads.append(name)
            return real(self, *a, **kw)

        return wrapper

    for name in ("item", "cpu", "numpy", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, watch(name))

    class Launch:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def run(*a, **kw):
                launched.append(self.name)
                inside[0] += 1
                try:
                    return self.fn[grid](*a, **kw)
                finally:
                    inside[0] -= 1

            return run

    for name in dir(k):
        if name.endswith("_kernel"):
            monkeypatch.setattr(k, name, Launch(name, getattr(k, name)))
    return reads, launched


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("case", HEAVY[:2], ids=_ids)
def test_integer_fill_never_reads_the_device(monkeypatch, cipher, case):
    """A Lemire fill with many rejections reads nothing back on the host (the count, the positions:
    each a wait for the GPU queue): the fill kernel, then the refill kernel, values bit for bit."""
    from ember.csprng.cuda_backend import kernels, triton_fill_

    dtype, rng = case
    n = 97
    ref_s, ker_s = sampler(cipher, 9), sampler(cipher, 9)
    ref, got = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    ref_s.random_range_(ref, *rng)
    with monkeypatch.context() as m:
        reads, launched = _watch_host_reads(m, kernels(True))
        assert triton_fill_(ker_s, got, "random_range_", rng, interpret=True)
    assert reads == []
    assert launched == ["fill_kernel", "refill_kernel"]
    assert torch.equal(ref, got) and ker_s.stream.counter == ref_s.stream.counter


@pytest.mark.parametrize("cipher", CIPHERS)
def test_rejection_list_overflow_raises(monkeypatch, cipher):
    """More rejections than the list holds (beyond 8 standard deviations): an error (on a GPU a
    device-side assert, torch._assert_async), never values that were not refilled."""
    from ember.csprng import cuda_backend

    monkeypatch.setattr(cuda_backend, "_reject_capacity", lambda n, thresh, wb: 1)
    with pytest.raises(RuntimeError, match="overflow"):
        pair(cipher, 11, torch.int64, 300, (0, 3 * 2**30))
    # a list with room for every element refills as usual
    monkeypatch.setattr(cuda_backend, "_reject_capacity", lambda n, thresh, wb: n)
    ref, got = pair(cipher, 11, torch.int64, 300, (0, 3 * 2**30))
    assert torch.equal(ref, got)


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("wb", [4, 8])
def test_refill_kernel_compiles_for_sm90(cipher, wb):
    """The refill kernel (a while loop of rounds, chunks, scan and barriers) compiles for sm_90 with
    triton's NVIDIA backend (no GPU needed), in a few seconds."""
    import time

    import triton
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no NVIDIA backend here")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ember.csprng.cuda_backend import _refill_block, kernels

    k = kernels(False)
    fn = k.refill_kernel
    sig = {
        "out_ptr": "*i64",
        "tab_ptr": "*i32",
        "cnt_ptr": "*i32",
        "pos_ptr": "*i64",
        **{a: "i64" for a in ("ia", "ib", "ic", "n", "cap")},
    }
    consts = dict(
        CIPHER=0 if cipher == "aes128" else 1, WB=wb, VIA_F32=False, BLOCK=_refill_block(cipher, False)
    )
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()})
    t = time.perf_counter()
    ptx = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False, "num_warps": 8}
    ).asm["ptx"]
    secs = time.perf_counter() - t
    assert ".entry refill_kernel" in ptx and "bar.sync" in ptx
    assert secs < 30, secs
