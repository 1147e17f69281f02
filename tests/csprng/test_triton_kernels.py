"""The Triton kernels (run on CPU tensors under Triton's interpreter) against the CPU sampler.

What is asserted (docs/csprng-stream.md, "CUDA"):

- integers (every dtype, 32- and 64-bit words, power-of-two and Lemire ranges with rejections),
  bernoulli (scalar and tensor p), uniform (every float dtype, with and without a range) and
  geometric (every dtype, including the int64 cap): bit-identical to the CPU sampler;
- float64 normal, log_normal, exponential, cauchy: bit-identical under the interpreter (both use
  NumPy's float64 functions); on a GPU, within the bounds in ``F64_GPU_BOUND``;
- float32: the kernel is bit-identical to :func:`reference_f32` (the documented arithmetic with
  correctly rounded float32 log/exp/sin/cos/tan), and within ``F32_BOUND`` ulp of the CPU sampler,
  whose NumPy float32 functions are not correctly rounded (``test_f32_bounds_on_a_large_sample``
  measures the bounds on 2**20 values per case); float16/bfloat16: within 1 ulp;
- for AES-128 and ChaCha20, with counters whose cipher blocks cross 2**32, 2**64 and 2**96, at the
  end of the counter space, and lengths that are not a multiple of the block.

The ``cuda`` tests at the end run the same comparisons on a GPU (skipped without one).
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

import ember.csprng.chacha  # noqa: F401  (registers "chacha20")
from ember.csprng.ciphers import COUNTER_LIMIT
from ember.csprng.distributions import NativeSampler, blocks_for
from ember.csprng.stream import BlockStream, CounterExhausted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
KEY = bytes(range(16))
CIPHERS = ["aes128", "chacha20"]
# stream positions (16-byte units) where the cipher's own block counter crosses 2^32, 2^64, 2^96:
# AES block = unit; ChaCha20 block = unit // 4 (and a start inside a ChaCha block)
COUNTERS = {"aes128": [5, 2**32 - 3, 2**64 - 5, 2**96 - 3], "chacha20": [5, 2**34 - 7, 2**66 - 9, 2**98 - 9]}
CROSS = {c: v[1] for c, v in COUNTERS.items()}
INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]

# ulp bounds of the float32 kernel against the CPU sampler: the largest distance seen on 2**24
# values per cipher (NumPy 2.4, AVX-512 float32 log/exp/sin/cos/tan; the counts fall off fast:
# normal had 7 values at 5 ulp and none above). normal and cauchy with standard parameters, and the
# B of check_f32's affine bound; exponential for any rate; log_normal: lognormal_bound.
F32_BOUND = {"normal_": 5, "exponential_": 5, "cauchy_": 3}
# float64 on a GPU: libdevice (log, exp 1 ulp; sin, cos, tan 2 ulp, CUDA Programming Guide) against
# NumPy (1 ulp), propagated through the transform (derived, see docs/csprng-stream.md)
F64_GPU_BOUND = {"normal_": 12, "exponential_": 6, "cauchy_": 8}  # log_normal: lognormal_bound


def sampler(cipher: str, counter: int) -> NativeSampler:
    return NativeSampler(BlockStream(KEY, counter, cipher))


def fill_pair(cipher: str, counter: int, method: str, out: torch.Tensor, params: tuple):
    """(CPU sampler's values, kernel's values) for the same stream position, and equal counters."""
    from ember.csprng.cuda_backend import triton_fill_

    ref_s, ker_s = sampler(cipher, counter), sampler(cipher, counter)
    ref = torch.empty(out.shape, dtype=out.dtype)
    getattr(ref_s, method)(ref, *params)
    assert triton_fill_(ker_s, out, method, params, interpret=True)
    assert ker_s.stream.counter == ref_s.stream.counter
    return ref, out


def pair(cipher: str, counter: int, method: str, dtype: torch.dtype, n: int, params: tuple):
    return fill_pair(cipher, counter, method, torch.empty(n, dtype=dtype), params)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Number of representable values between a and b (same float dtype), per element."""
    assert a.dtype == b.dtype and a.dtype.is_floating_point
    it = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    lo = -(2 ** (8 * a.element_size() - 1))

    def ordered(t: torch.Tensor) -> np.ndarray:
        i = t.detach().cpu().contiguous().view(it).numpy().astype(np.int64)
        return np.where(i < 0, lo - i, i)  # sign-magnitude -> one increasing integer line

    return np.abs(ordered(a) - ordered(b))


def spacing(x: np.ndarray, dtype: type) -> np.ndarray:
    return np.spacing(np.abs(x).astype(dtype)).astype(np.float64)


# ---------------------------------------------------------------------------- reference (float32)
def words(cipher: str, counter: int, n: int, wb: int) -> np.ndarray:
    """The first ``n`` little-endian ``wb``-byte words of the stream at ``counter``."""
    nb = blocks_for(n * wb)
    buf = np.empty(nb * 16, np.uint8)
    BlockStream(KEY, counter, cipher).draw(nb).fill(memoryview(buf))
    return buf[: n * wb].view(f"<u{wb}").copy()


def _cr(name: str):
    """NumPy's float32 function ``name``, correctly rounded (evaluated in float64, rounded once)."""
    return lambda x: getattr(np, name)(x.astype(np.float64)).astype(np.float32)


def normal_pair_words(n: int, group: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """(radius word, angle word) indexes of each pair of an ``n``-value normal draw: groups of 16384
    pairs, each with its radius words first and its angle words second (docs/csprng-stream.md)."""
    pairs = (n + 1) // 2
    j = np.arange(pairs)
    g = j // group
    q = np.minimum(pairs - g * group, group)
    radius = 2 * g * group + (j - g * group)
    return radius, radius + q


def reference_f32(method: str, w: np.ndarray, n: int, params: tuple, group: int = 16384) -> np.ndarray:
    """The float32 values of docs/csprng-stream.md from 32-bit words ``w``, with correctly rounded
    log/exp/sin/cos/tan: what the kernels compute (see triton_kernels)."""
    f32 = np.float32
    m = 24
    k = w & np.uint32((1 << m) - 1)
    if method in ("normal_", "log_normal_"):
        mean, std = params or ((1.0, 2.0) if method == "log_normal_" else (0.0, 1.0))
        radius, angle = normal_pair_words(n, group)  # the sine element of a pair sits at its angle word
        u = (k[radius] + 1).astype(f32) * f32(2.0**-m)
        r = np.sqrt(_cr("log")(u) * f32(-2.0))
        t = k[angle].astype(f32) * f32(2 * math.pi * 2.0**-m)
        z = np.empty(2 * len(radius), f32)
        z[radius], z[angle] = r * _cr("cos")(t), r * _cr("sin")(t)
        z = z[:n]
        if not (mean == 0.0 and std == 1.0):
            z = z * f32(std) + f32(mean)
        return _cr("exp")(z) if method == "log_normal_" else z
    if method == "exponential_":
        (lambd,) = params or (1.0,)
        u = (k[:n] + 1).astype(f32) * f32(2.0**-m)
        return _cr("log")(u) * f32(-1.0 / lambd)
    assert method == "cauchy_"
    median, sigma = params or (0.0, 1.0)
    k = w[:n] & np.uint32((1 << (m - 1)) - 1)
    u = (k.astype(f32) + f32(0.5)) * f32(2.0 ** -(m - 1))
    return _cr("tan")((u - f32(0.5)) * f32(math.pi)) * f32(sigma) + f32(median)


def nwords(method: str, n: int) -> int:
    return 2 * ((n + 1) // 2) if method in ("normal_", "log_normal_") else n


def lognormal_bound(zs: np.ndarray, arg: np.ndarray, b_normal: float, b_exp: float) -> np.ndarray:
    """ulp bound of log_normal: exp turns the absolute error of its argument ``mean + z * std``
    (b_normal ulp of ``z * std`` plus one ulp of the argument) into a relative one, plus exp's own
    error; ``zs = |z * std|``, ``arg = |mean + z * std|`` (one relative ulp is at most 2 ulp)."""
    return b_exp + 2 * (b_normal * zs + arg + 1)


def check_f32(method: str, params: tuple, cpu: np.ndarray, got: np.ndarray, z: np.ndarray) -> None:
    """|kernel - CPU| for float32 within the stated bound (``z``: the same draw with standard
    parameters). Standard parameters (and exponential for every rate): F32_BOUND ulp. An affine map
    ``z * s + c`` scales the error of ``z``: B ulp(z * s) + 1 ulp(result) (cancellation makes
    ulp(result) alone meaningless); log_normal: :func:`lognormal_bound`."""
    d = ulp_distance(torch.from_numpy(cpu), torch.from_numpy(got))
    if method == "log_normal_":
        zs = np.abs(z.astype(np.float64) * (params or (1.0, 2.0))[1])
        bound = lognormal_bound(zs, np.abs(np.log(got.astype(np.float64))), F32_BOUND["normal_"], 3)
        assert (d <= bound).all(), f"max {d.max()} ulp"
        return
    b = F32_BOUND[method]
    if method == "exponential_" or params in ((), (0.0, 1.0)):
        assert d.max() <= b, f"max {d.max()} ulp"
        return
    zs = np.abs(z.astype(np.float64) * params[1])
    assert_within(cpu, got, b * spacing(zs, np.float32) + spacing(got, np.float32))


def standard_draw(method: str, w: np.ndarray, n: int) -> np.ndarray | None:
    """The same draw with standard parameters (normal or cauchy), before the affine map."""
    if method == "exponential_":
        return None
    return reference_f32("cauchy_" if method == "cauchy_" else "normal_", w, n, ())


def assert_within(got: np.ndarray, want: np.ndarray, tol: np.ndarray) -> None:
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bad = np.flatnonzero(~(err <= tol))
    assert bad.size == 0, (
        f"{bad.size} values outside the bound, e.g. index {bad[0]}: "
        f"{got[bad[0]]!r} vs {want[bad[0]]!r} (tolerance {tol[bad[0]]!r})"
    )


# ---------------------------------------------------------------------------- bit-identical
EXACT = [
    ("uniform_", torch.float32, ()),
    ("uniform_", torch.float32, (-2.0, 3.0)),
    ("uniform_", torch.float32, (0.0, 10.0)),
    ("uniform_", torch.float32, (1.5, 1.5)),
    ("uniform_", torch.float64, ()),
    ("uniform_", torch.float64, (-2.0, 3.0)),
    ("uniform_", torch.float16, ()),
    ("uniform_", torch.float16, (-2.0, 3.0)),
    ("uniform_", torch.bfloat16, ()),
    ("uniform_", torch.bfloat16, (-1.0, 7.0)),
    ("random_range_", torch.int64, (-5, 2**31 + 1)),  # 32-bit Lemire, about half rejected
    ("random_range_", torch.int64, (-(2**62), 2**62 + 7)),  # 64-bit Lemire, about half rejected
    ("random_range_", torch.int64, (0, 2**32)),  # power of two, 32-bit words
    ("random_range_", torch.int64, (3, 3 + 2**40)),  # power of two, 64-bit words
    ("random_range_", torch.int64, (-(2**63), 2**63)),  # the full 64-bit range
    ("random_range_", torch.int32, (-1000, 1000)),
    ("random_range_", torch.int16, (0, 16)),
    ("random_range_", torch.uint8, (0, 200)),
    ("random_range_", torch.int8, (-128, 127)),
    ("random_range_", torch.float32, (-1000, 1000)),
    ("random_range_", torch.float64, (0, 2**40 + 3)),
    ("random_range_", torch.float16, (-5, 5)),
    ("random_range_", torch.bfloat16, (0, 100)),
    ("random_range_", torch.bool, (0, 2)),
    *[("random_", d, ()) for d in [torch.bool, *INT_DTYPES, *FLOAT_DTYPES]],
    *[
        ("bernoulli_", d, (0.3,))
        for d in [
            torch.bool,
            torch.uint8,
            torch.int64,
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
        ]
    ],
    ("bernoulli_", torch.float32, (0.0,)),
    ("bernoulli_", torch.float32, (1.0,)),
    ("bernoulli_", torch.int32, (1e-12,)),
    *[("geometric_", d, (0.3,)) for d in [*INT_DTYPES, *FLOAT_DTYPES]],
    *[
        ("geometric_", d, (1e-7,))
        for d in [torch.int16, torch.int32, torch.int64, torch.bfloat16, torch.float32, torch.float64]
    ],
    ("geometric_", torch.float16, (1e-3,)),
    ("geometric_", torch.int64, (1e-19,)),  # beyond 2**63: the int64 cap
    ("geometric_", torch.int64, (1.0,)),
    *[("normal_", torch.float64, p) for p in [(), (1.0, 2.0)]],
    *[("log_normal_", torch.float64, p) for p in [(), (0.0, 1.0)]],
    *[("exponential_", torch.float64, p) for p in [(), (2.5,)]],
    *[("cauchy_", torch.float64, p) for p in [(), (1.0, 2.0)]],
]


def _ids(case):
    method, dtype, params = case
    return f"{method}-{str(dtype).replace('torch.', '')}-{params}"


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("case", EXACT, ids=[_ids(c) for c in EXACT])
def test_kernel_matches_cpu_bit_for_bit(cipher, case):
    """Every exact case at a position where the cipher's block counter crosses 2**32."""
    method, dtype, params = case
    ref, got = pair(cipher, CROSS[cipher], method, dtype, 101, params)
    assert torch.equal(ref, got)


def test_geometric_int64_cap_is_int64_max():
    ref, got = pair("aes128", 5, "geometric_", torch.int64, 300, (1e-19,))
    top = int(torch.iinfo(torch.int64).max)
    assert torch.equal(ref, got) and (got == top).any() and (got > 0).all()
    assert int(got[got != top].max()) <= 2**63 - 1024


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("counter_index", range(4))
@pytest.mark.parametrize(
    "case",
    [
        ("uniform_", torch.float32, ()),
        ("uniform_", torch.float16, ()),
        ("random_range_", torch.int64, (-(2**62), 2**62 + 7)),
        ("normal_", torch.float64, ()),
        ("bernoulli_", torch.bool, (0.5,)),
    ],
    ids=_ids,
)
def test_every_counter_crossing(cipher, counter_index, case):
    method, dtype, params = case
    ref, got = pair(cipher, COUNTERS[cipher][counter_index], method, dtype, 203, params)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 17, 63, 257, 1031])
@pytest.mark.parametrize(
    "case",
    [
        ("uniform_", torch.float32, ()),
        ("uniform_", torch.bfloat16, ()),
        ("random_range_", torch.int64, (0, 10**15)),
        ("normal_", torch.float64, (0.5, 3.0)),
    ],
    ids=_ids,
)
def test_lengths_that_are_not_a_multiple_of_the_block(cipher, n, case):
    method, dtype, params = case
    ref, got = pair(cipher, 7, method, dtype, n, params)
    assert torch.equal(ref, got)


def test_normal_across_groups():
    """Two full groups of pairs and a short odd one: the documented pairing, bit for bit."""
    n = 4 * 16384 + 9
    cpu, got = pair("aes128", 7, "normal_", torch.float32, n, (0.5, 3.0))
    ref = reference_f32("normal_", words("aes128", 7, nwords("normal_", n), 4), n, (0.5, 3.0))
    assert np.array_equal(got.numpy(), ref)
    assert float((cpu - got).abs().max()) < 1e-4  # a few float32 ulp (|z * 3 + 0.5| < 20)


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_normal_groups_follow_the_group_size(monkeypatch, cipher, dtype):
    """With groups of 64 pairs (patched on both sides, to keep the interpreter quick) the kernel
    and the CPU sampler still pair the same words."""
    from ember.csprng import distributions

    monkeypatch.setattr(distributions, "NORMAL_GROUP", 64)
    n = 4 * 64 + 9
    cpu, got = pair(cipher, 7, "normal_", dtype, n, (0.5, 3.0))
    if dtype == torch.float64:
        assert torch.equal(cpu, got)
    else:
        assert float((cpu - got).abs().max()) < 1e-4
    monkeypatch.setattr(distributions, "NORMAL_GROUP", 16384)
    other, _ = pair(cipher, 7, "normal_", dtype, n, (0.5, 3.0))
    assert not torch.equal(other, cpu)  # the group size matters: the patch took effect


NORMAL_CASES = [("normal_", ()), ("normal_", (0.5, 3.0)), ("log_normal_", ()), ("log_normal_", (-1.0, 0.5))]


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_normal_one_kernel_every_group_shape(monkeypatch, cipher, dtype):
    """Box-Muller in the fill kernel, with groups of 16 pairs (patched on both sides): odd and even
    counts, one and several full groups with and without a short last group, after other draws
    (every start inside a ChaCha20 block), normal and log_normal with standard and other
    parameters in turn. float64: the CPU sampler bit for bit; float32 and 16-bit:
    :func:`reference_f32` bit for bit (rounded once to the 16-bit dtype)."""
    from ember.csprng import distributions
    from ember.csprng.cuda_backend import triton_fill_

    group = 16  # the smallest whose halves are whole ChaCha20 blocks (32-bit words)
    monkeypatch.setattr(distributions, "NORMAL_GROUP", group)
    ref_s, ker_s = sampler(cipher, 4), sampler(cipher, 4)
    for i, n in enumerate([1, 2, 3, 31, 32, 33, 65, 2 * 16 * 3 - 3, 2 * 16 * 3 + 30, 101]):
        before = torch.empty(i % 4 + 1)  # moves the next draw's start within a ChaCha20 block
        ref_s.uniform_(before)
        assert triton_fill_(ker_s, torch.empty(i % 4 + 1), "uniform_", (), interpret=True)
        counter = ref_s.stream.counter
        assert ker_s.stream.counter == counter
        method, params = NORMAL_CASES[i % len(NORMAL_CASES)]
        ref = torch.empty(n, dtype=dtype)
        getattr(ref_s, method)(ref, *params)
        got = torch.empty(n, dtype=dtype)
        assert triton_fill_(ker_s, got, method, params, interpret=True)
        assert ker_s.stream.counter == ref_s.stream.counter
        if dtype == torch.float64:
            assert torch.equal(ref, got), n
        else:
            want = reference_f32(method, words(cipher, counter, nwords(method, n), 4), n, params, group)
            assert torch.equal(got, torch.from_numpy(want).to(dtype)), n


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("counter", [5, 6], ids=["start1", "start2"])
def test_normal_real_group_size_with_a_short_last_group(cipher, counter):
    """One full group of 16384 pairs and a short last group of 2 pairs (float64, bit for bit)."""
    ref, got = pair(cipher, counter, "normal_", torch.float64, 2 * 16384 + 3, (0.5, 3.0))
    assert torch.equal(ref, got)


def _record_launches(monkeypatch, k) -> list[str]:
    """Patch every kernel of the kernels module ``k`` to record its name at each launch."""
    launched: list[str] = []

    class Recorder:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.fn[grid]

    for name in dir(k):
        if name.endswith("_kernel"):
            monkeypatch.setattr(k, name, Recorder(name, getattr(k, name)))
    return launched


@pytest.mark.parametrize("cipher", CIPHERS)
def test_parameters_are_kernel_scalars(monkeypatch, cipher):
    """No tensor is made or copied for a fill's parameters (on a GPU each was a host-to-device copy
    and a wait): the kernels take them as scalars. The cipher table is cached per key and device."""
    from ember.csprng.cuda_backend import triton_fill_

    cases = [("uniform_", torch.float32, (-2.0, 3.0)), ("normal_", torch.float32, (0.5, 3.0)),
             ("exponential_", torch.float64, (2.5,)), ("cauchy_", torch.float32, (1.0, 2.0)),
             ("geometric_", torch.int64, (0.3,)), ("random_range_", torch.int32, (0, 16)),
             ("bernoulli_", torch.bool, (0.3,))]
    for method, dtype, params in cases:  # warm the table cache
        triton_fill_(sampler(cipher, 3), torch.empty(5, dtype=dtype), method, params, interpret=True)
    made: list = []
    real_tensor, real_to = torch.tensor, torch.Tensor.to

    def tensor(*a, **kw):
        if "device" in kw:
            made.append(("tensor", a, kw))
        return real_tensor(*a, **kw)

    def to(self, *a, **kw):
        made.append(("to", a, kw))
        return real_to(self, *a, **kw)

    for method, dtype, params in cases:
        ref_s, ker_s = sampler(cipher, 3), sampler(cipher, 3)
        ref, got = torch.empty(37, dtype=dtype), torch.empty(37, dtype=dtype)
        getattr(ref_s, method)(ref, *params)
        with monkeypatch.context() as m:  # only the kernel side is watched
            m.setattr(torch, "tensor", tensor)
            m.setattr(torch.Tensor, "to", to)
            assert triton_fill_(ker_s, got, method, params, interpret=True)
        assert torch.equal(ref, got) or method in ("normal_", "cauchy_"), method  # float32: ulp
    assert made == []


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("method", ["normal_", "log_normal_"])
def test_normal_draw_is_one_launch(monkeypatch, cipher, method):
    from ember.csprng.cuda_backend import kernels, triton_fill_

    launched = _record_launches(monkeypatch, kernels(True))
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        launched.clear()
        assert triton_fill_(sampler(cipher, 3), torch.empty(1001, dtype=dtype), method, (), interpret=True)
        assert launched == ["normal_fill_kernel"], (dtype, launched)


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize(
    "case",
    [("uniform_", torch.float32, ()), ("random_", torch.int64, ()), ("normal_", torch.float64, ())],
    ids=_ids,
)
def test_end_of_the_counter_space(cipher, case):
    """A draw that ends exactly at 2**128 matches; one block more raises for both, moving nothing."""
    from ember.csprng.cuda_backend import triton_fill_

    method, dtype, params = case
    n = 37
    need = {
        "uniform_": blocks_for(n * 4),
        "random_": blocks_for(n * 8),
        "normal_": blocks_for((n + 1) // 2 * 16),
    }[method]
    ref, got = pair(cipher, COUNTER_LIMIT - need, method, dtype, n, params)
    assert torch.equal(ref, got)
    for s in (sampler(cipher, COUNTER_LIMIT - need + 1),):
        with pytest.raises(CounterExhausted):
            getattr(s, method)(torch.empty(n, dtype=dtype), *params)
        with pytest.raises(CounterExhausted):
            triton_fill_(s, torch.empty(n, dtype=dtype), method, params, interpret=True)
        assert s.stream.counter == COUNTER_LIMIT - need + 1


@pytest.mark.parametrize("cipher", CIPHERS)
def test_non_contiguous_and_shaped_outputs(cipher):
    out = torch.empty(7, 13, dtype=torch.float32).t()  # filled in row-major order of (13, 7)
    ref, got = fill_pair(cipher, 3, "uniform_", out, ())
    assert torch.equal(ref, got)
    out = torch.empty(3, 4, 5, dtype=torch.int32)
    ref, got = fill_pair(cipher, 3, "random_range_", out, (-7, 1000))
    assert torch.equal(ref, got)


@pytest.mark.parametrize("cipher", CIPHERS)
def test_bernoulli_tensor_p(cipher):
    p = torch.rand(9, 1, generator=torch.Generator().manual_seed(0))
    p[0], p[1], p[2] = 0.0, 1.0, 1 - 2**-53
    for dtype in (torch.float32, torch.bool, torch.int64):
        out = torch.empty(9, 11, dtype=dtype)
        ref_s, ker_s = sampler(cipher, CROSS[cipher]), sampler(cipher, CROSS[cipher])
        ref = torch.empty_like(out)
        ref_s.bernoulli_(ref, p)
        from ember.csprng.cuda_backend import triton_fill_

        assert triton_fill_(ker_s, out, "bernoulli_", (p,), interpret=True)
        assert torch.equal(ref, out) and ker_s.stream.counter == ref_s.stream.counter


# integer rejections (refilled on the device, list overflow): tests/csprng/test_triton_refill.py


@pytest.mark.parametrize("method", ["uniform_", "normal_", "random_"])
def test_errors_match_the_cpu_sampler(method):
    from ember.csprng.cuda_backend import triton_fill_

    bad = {"uniform_": (2.0, 1.0), "normal_": (0.0, -1.0), "random_": ()}[method]
    dtype = torch.complex64 if method == "random_" else torch.float32
    with pytest.raises((ValueError, TypeError)) as cpu_err:
        getattr(sampler("aes128", 0), method)(torch.empty(3, dtype=dtype), *bad)
    s = sampler("aes128", 0)
    if dtype.is_complex:  # complex outputs are left to the adapter (it fills the real view)
        assert not triton_fill_(s, torch.empty(3, dtype=dtype), method, bad, interpret=True)
        return
    with pytest.raises(type(cpu_err.value)):
        triton_fill_(s, torch.empty(3, dtype=dtype), method, bad, interpret=True)
    assert s.stream.counter == 0


# ---------------------------------------------------------------------------- transcendental
TRANSCENDENTAL = [
    ("normal_", ()),
    ("normal_", (1.0, 2.0)),
    ("normal_", (-3.0, 0.5)),
    ("log_normal_", ()),
    ("log_normal_", (0.0, 1.0)),
    ("log_normal_", (-1.0, 0.5)),
    ("exponential_", ()),
    ("exponential_", (2.5,)),
    ("cauchy_", ()),
    ("cauchy_", (1.0, 2.0)),
]
T_IDS = [f"{m}-{p}" for m, p in TRANSCENDENTAL]


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("method,params", TRANSCENDENTAL, ids=T_IDS)
def test_f32_kernel_is_the_correctly_rounded_pipeline_and_within_bound_of_cpu(cipher, method, params):
    n = 2001
    counter = CROSS[cipher]
    cpu, got = pair(cipher, counter, method, torch.float32, n, params)
    w = words(cipher, counter, nwords(method, n), 4)
    ref = reference_f32(method, w, n, params)
    assert np.array_equal(got.numpy(), ref)  # bit for bit: the documented float32 arithmetic
    check_f32(method, params, cpu.numpy(), got.numpy(), standard_draw(method, w, n))


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "method,params",
    [c for c in TRANSCENDENTAL if c[1] == ()],
    ids=[i for i, c in zip(T_IDS, TRANSCENDENTAL, strict=True) if c[1] == ()],
)
def test_16_bit_outputs_within_one_ulp(cipher, dtype, method, params):
    n = 1001
    counter = CROSS[cipher]
    cpu, got = pair(cipher, counter, method, dtype, n, params)
    ref = torch.from_numpy(reference_f32(method, words(cipher, counter, nwords(method, n), 4), n, params)).to(
        dtype
    )
    assert torch.equal(got, ref)  # the float32 pipeline, rounded once to the 16-bit dtype
    d = ulp_distance(cpu, got)
    assert d.max() <= 1, f"max {d.max()} ulp"


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("method,params", TRANSCENDENTAL, ids=T_IDS)
def test_f64_bit_identical_under_the_interpreter(cipher, method, params):
    cpu, got = pair(cipher, CROSS[cipher], method, torch.float64, 501, params)
    assert int(ulp_distance(cpu, got).max()) == 0


@pytest.mark.parametrize("cipher", CIPHERS)
def test_f32_bounds_on_a_large_sample(cipher):
    """The bounds of check_f32 on 2**20 values per case (NumPy only: the test above shows that the
    kernel computes reference_f32 exactly). F32_BOUND itself comes from 2**24 values per cipher
    (about 30 s; the same loop with a larger n)."""
    n = 1 << 20
    worst = {}
    for method, params in TRANSCENDENTAL:
        s = sampler(cipher, 12345)
        cpu = torch.empty(n, dtype=torch.float32)
        getattr(s, method)(cpu, *params)
        w = words(cipher, 12345, nwords(method, n), 4)
        ref = reference_f32(method, w, n, params)
        check_f32(method, params, cpu.numpy(), ref, standard_draw(method, w, n))
        worst[(method, params)] = int(ulp_distance(cpu, torch.from_numpy(ref)).max())
    for method, bound in F32_BOUND.items():
        assert worst[(method, ())] <= bound, (method, worst[(method, ())])


# ---------------------------------------------------------------------------- compiled for sm_90
# Triton compiles to PTX and a cubin (its bundled ptxas) without a GPU: that checks the kernels
# build for a real device, with the types of real launches, and that float32 arithmetic outside
# libdevice is not contracted into FMAs (docs: no fused multiply-add).
_OPS = {
    "uniform_": 0,
    "normal_": 1,
    "log_normal_": 2,
    "exponential_": 3,
    "cauchy_": 4,
    "geometric_": 5,
    "integer": 6,
    "bernoulli_": 7,
}
# (name, out pointer type, OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
AOT_CASES = [
    ("uniform_ f32", "*fp32", "uniform_", 4, 24, False, True, True, False),
    ("uniform_ f64", "*fp64", "uniform_", 8, 53, True, True, True, False),
    ("uniform_ f16", "*fp16", "uniform_", 2, 11, False, True, True, False),
    ("uniform_ bf16", "*i16", "uniform_", 2, 8, False, False, False, True),
    ("exponential_ f32", "*fp32", "exponential_", 4, 24, False, False, False, False),
    ("exponential_ f64", "*fp64", "exponential_", 8, 53, True, False, False, False),
    ("cauchy_ f32", "*fp32", "cauchy_", 4, 23, False, False, False, False),
    ("cauchy_ f64", "*fp64", "cauchy_", 8, 52, True, False, False, False),
    ("geometric_ i64", "*i64", "geometric_", 8, 52, True, True, False, False),
    ("geometric_ f32", "*fp32", "geometric_", 8, 52, True, False, False, False),
    ("geometric_ bf16", "*i16", "geometric_", 8, 52, True, False, False, True),
    ("random_ i64 32-bit Lemire", "*i64", "integer", 4, 0, False, False, False, False),
    ("random_ i64 64-bit Lemire", "*i64", "integer", 8, 0, False, False, False, False),
    ("random_ u8 power of two", "*u8", "integer", 4, 0, False, True, False, False),
    ("random_ i32 power of two", "*i32", "integer", 4, 0, False, True, False, False),
    ("random_ f32", "*fp32", "integer", 4, 0, False, False, False, False),
    ("random_ bf16", "*i16", "integer", 4, 0, False, False, False, True),
    ("bernoulli_ tensor p", "*u8", "bernoulli_", 8, 0, False, True, False, False),
    ("bernoulli_ f64", "*fp64", "bernoulli_", 8, 0, False, False, False, False),
]
FAST_AOT = {"uniform_ f32", "random_ i32 power of two"}


def _nvidia_compiler():
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no NVIDIA backend here")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ember.csprng.cuda_backend import kernels

    k = kernels(False)
    assert not k.INTERPRETED

    def compile_ptx(fn, signature: dict, constexprs: dict) -> str:
        src = ASTSource(
            fn, signature, constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()}
        )
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm[
            "ptx"
        ]

    return k, compile_ptx


def _aot_params():
    for cipher in CIPHERS:
        for case in AOT_CASES:
            marks = () if case[0] in FAST_AOT and cipher == "chacha20" else (pytest.mark.slow,)
            yield pytest.param(cipher, case, id=f"{cipher}-{case[0]}", marks=marks)


@pytest.mark.parametrize("cipher,case", list(_aot_params()))
def test_fill_kernel_compiles_for_sm90(cipher, case):
    """Fast: ChaCha20 uniform float32 and normal's words; the rest are ``slow`` (about 8 s per AES
    case)."""
    k, compile_ptx = _nvidia_compiler()
    name, out_ty, op, wb, mbits, f64, flag, flag2, via = case
    scalars = ("fa", "fb", "fc", "fd", "ia", "ib", "ic", "c0", "c1", "c2", "c3", "skip", "n", "nlanes", "cap")
    sig = {"out_ptr": out_ty, "tab_ptr": "*i32", "p_ptr": "*fp64" if op == "bernoulli_" else "*i32",
           "cnt_ptr": "*i32", "pos_ptr": "*i64" if op == "integer" and not flag else "*i32",
           **{a: "i64" for a in scalars}}
    ptx = compile_ptx(
        k.fill_kernel,
        sig,
        dict(
            CIPHER=0 if cipher == "aes128" else 1,
            OP=_OPS[op],
            WB=wb,
            MBITS=mbits,
            F64=f64,
            FLAG=flag,
            FLAG2=flag2,
            VIA_F32=via,
            BLOCK=256 if cipher == "aes128" else 128,
        ),
    )
    assert "fma.rn.f32" not in ptx  # float32 steps stay separate multiplies and adds
    assert ".approx.f32" not in ptx and ".approx.ftz.f32" not in ptx  # no fast float32 math
    if op in ("uniform_", "integer", "bernoulli_"):
        assert "fma." not in ptx


def fill_store_layouts(k, cipher: str, out_ty: str, wb: int, mbits: int) -> list[tuple[list, list, list]]:
    """(sizePerThread, threadsPerWarp, order) of every ``tt.store`` of the uniform fill kernel of
    the kernels module ``k`` compiled for sm_90 (Triton's GPU IR)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = k.fill_kernel
    scalars = ("fa", "fb", "fc", "fd", "ia", "ib", "ic", "c0", "c1", "c2", "c3", "skip", "n", "nlanes", "cap")
    sig = {"out_ptr": out_ty, "tab_ptr": "*i32", "p_ptr": "*i32", "cnt_ptr": "*i32", "pos_ptr": "*i32",
           **{a: "i64" for a in scalars}}
    consts = dict(CIPHER=0 if cipher == "aes128" else 1, OP=0, WB=wb, MBITS=mbits, F64=wb == 8, FLAG=False,
                  FLAG2=False, VIA_F32=False, BLOCK=256 if cipher == "aes128" else 128)
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()})
    options = {"enable_fp_fusion": False}
    ir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ttgir"]
    layouts = dict(re.findall(r"^(#blocked\d*) = #ttg\.blocked<(.*)>$", ir, re.M))
    out = []
    for name in re.findall(r"tt\.store .*, (#blocked\d*)>", ir):
        fields = dict(re.findall(r"(\w+) = \[([\d, ]*)\]", layouts[name]))
        keys = ("sizePerThread", "threadsPerWarp", "order")
        out.append(tuple([int(v) for v in fields[f].split(",")] for f in keys))
    return out


@pytest.mark.parametrize(
    "cipher,out_ty,wb,mbits",
    [("chacha20", "*fp32", 4, 24), ("chacha20", "*fp64", 8, 53), ("aes128", "*fp32", 4, 24)],
    ids=["chacha20-f32", "chacha20-f64", "aes128-f32"],
)
def test_fill_kernel_stores_are_coalesced(cipher, out_ty, wb, mbits):
    """One store of the program's [lanes, words per block] tile, laid out so that consecutive
    threads of a warp write consecutive elements (whole rows of a block's words per warp), instead
    of one store per word with lanes a cipher block apart (ChaCha20: 64 bytes)."""
    k, _ = _nvidia_compiler()
    words = (4 if cipher == "aes128" else 16) * 4 // wb
    stores = fill_store_layouts(k, cipher, out_ty, wb, mbits)
    assert len(stores) == 1, stores
    (size, threads, order), = stores
    assert order == [1, 0] and size[1] * threads[1] == words, stores


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize(
    "out_ty,wb,mbits,f64,affine,log,bf16",
    [
        ("*fp32", 4, 24, False, True, False, False),
        ("*fp64", 8, 53, True, True, False, False),
        pytest.param("*fp16", 4, 24, False, False, True, False, marks=pytest.mark.slow),
        pytest.param("*i16", 4, 24, False, True, True, True, marks=pytest.mark.slow),
    ],
    ids=["normal f32", "normal f64", "log_normal f16", "log_normal bf16"],
)
def test_normal_fill_kernel_compiles_for_sm90(cipher, out_ty, wb, mbits, f64, affine, log, bf16):
    k, compile_ptx = _nvidia_compiler()
    scalars = ("c0", "c1", "c2", "c3", "skip", "n", "pairs", "full_lanes", "full_programs")
    scalars += ("su", "st", "std", "mean")
    sig = {"out_ptr": out_ty, "tab_ptr": "*i32", **{a: "i64" for a in scalars}}
    ptx = compile_ptx(
        k.normal_fill_kernel,
        sig,
        dict(
            CIPHER=0 if cipher == "aes128" else 1,
            GROUP=16384,
            WB=wb,
            MBITS=mbits,
            F64=f64,
            AFFINE=affine,
            LOG=log,
            BF16=bf16,
            BLOCK=256 if cipher == "aes128" else 64,
        ),
    )
    assert "fma.rn.f32" not in ptx  # float32 steps stay separate multiplies and adds
    assert ".approx.f32" not in ptx and ".approx.ftz.f32" not in ptx  # no fast float32 math
    assert "sqrt.rn.f32" in ptx or f64


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("ECB_ENCRYPT", marks=pytest.mark.slow),
        "ECB_DECRYPT",
        pytest.param("CTR", marks=pytest.mark.slow),
    ],
)
def test_crypt_kernel_compiles_for_sm90(mode):
    k, compile_ptx = _nvidia_compiler()
    sig = {"in_ptr": "*i32", "out_ptr": "*i32", "tab_ptr": "*i32", "nblocks": "i64", "f0": "i32", "f1": "i32"}
    ptx = compile_ptx(k.crypt_kernel, sig, dict(MODE=int(getattr(k, mode).value), BLOCK=256))
    assert ".entry crypt_kernel" in ptx


# ---------------------------------------------------------------------------- on a GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_vs_cpu(method: str, dtype: torch.dtype, params: tuple, n: int, cipher: str):
    from ember.csprng import create_generator

    g_cpu, g_gpu = create_generator(1234, cipher=cipher), create_generator(1234, cipher=cipher)
    cpu = torch.empty(n, dtype=dtype)
    gpu = torch.empty(n, dtype=dtype, device="cuda")
    getattr(cpu, method.replace("random_range_", "random_"))(*params, generator=g_cpu)
    getattr(gpu, method.replace("random_range_", "random_"))(*params, generator=g_gpu)
    assert g_cpu.get_state().equal(g_gpu.get_state())
    return cpu, gpu.cpu()


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize(
    "case", [c for c in EXACT if not (c[0] in dict(TRANSCENDENTAL) or c[0] == "geometric_")], ids=_ids
)
def test_cuda_exact(cipher, case):
    method, dtype, params = case
    cpu, gpu = _gpu_vs_cpu(method, dtype, params, 100_003, cipher)
    assert torch.equal(cpu, gpu)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32], ids=str)
def test_cuda_geometric(cipher, dtype):
    """Equal, except where log(u) / log1p(-p) is within a few ulp of an integer (then +-1)."""
    cpu, gpu = _gpu_vs_cpu("geometric_", dtype, (1e-3,), 1_000_003, cipher)
    diff = (cpu.double() - gpu.double()).abs()
    assert diff.max() <= 1 and int((diff != 0).sum()) <= 2


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(
    "method,params",
    [c for c in TRANSCENDENTAL if c[1] == ()],
    ids=[i for i, c in zip(T_IDS, TRANSCENDENTAL, strict=True) if c[1] == ()],
)
def test_cuda_transcendental_bounds(cipher, dtype, method, params):
    """float32: F32_BOUND + 1 (the +1: libdevice's float64 result may round to float32 differently
    from NumPy's in about one case in 2**28); 16-bit: 1 ulp; float64: F64_GPU_BOUND (derived)."""
    cpu, gpu = _gpu_vs_cpu(method, dtype, params, 1_000_001, cipher)
    d = ulp_distance(cpu, gpu)
    arg = np.log(cpu.double().numpy())  # log_normal: mean + z * std, default (1, 2)
    if dtype == torch.float64:
        bound = (
            lognormal_bound(np.abs(arg - 1.0), np.abs(arg), F64_GPU_BOUND["normal_"], 2)
            if (method == "log_normal_")
            else F64_GPU_BOUND[method]
        )
    elif dtype == torch.float32:
        bound = 1 + (
            lognormal_bound(np.abs(arg - 1.0), np.abs(arg), F32_BOUND["normal_"], 3)
            if method == "log_normal_"
            else F32_BOUND[method]
        )
    else:
        bound = 1
    assert (d <= bound).all(), f"max {d.max()} ulp"
