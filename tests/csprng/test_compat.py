"""MT19937Sampler against an independent reference of the torchcsprng stream.

The reference here is written from the spec page and the published algorithms: a pure-Python
MT19937 (Matsumoto & Nishimura's init_genrand/genrand_int32) and pycryptodome's AES, one element at
a time with Python's ``math`` (the C library, as torchcsprng used).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from Crypto.Cipher import AES

from ember.csprng import compat  # noqa: E402

MT19937Sampler = compat.MT19937Sampler


class RefMT:
    """MT19937 from the published algorithm."""

    def __init__(self, seed: int) -> None:
        self.mt = [0] * 624
        self.mt[0] = seed & 0xFFFFFFFF
        for i in range(1, 624):
            prev = self.mt[i - 1]
            self.mt[i] = (1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF
        self.i = 624

    def _twist(self) -> None:
        mt = self.mt
        for k in range(624):
            y = (mt[k] & 0x80000000) | (mt[(k + 1) % 624] & 0x7FFFFFFF)
            mt[k] = mt[(k + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
        self.i = 0

    def __call__(self) -> int:
        if self.i >= 624:
            self._twist()
        y = self.mt[self.i]
        self.i += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        return y


class RefStream:
    """One op call: the key from four draws, then words of the counter blocks."""

    def __init__(self, mt: RefMT) -> None:
        key = b"".join(struct.pack("<I", mt()) for _ in range(4))
        self.aes = AES.new(key, AES.MODE_ECB)

    def words(self, n: int, width: int, per_value: int) -> list[tuple[int, ...]]:
        per_block = 16 // (width * per_value)
        fmt = {2: "H", 4: "I", 8: "Q"}[width]
        out = []
        for p in range(n):
            idx, slot = divmod(p, per_block)
            block = self.aes.encrypt(struct.pack("<QQ", idx, 0))
            ws = struct.unpack("<" + fmt * (16 // width), block)
            out.append(ws[slot * per_value:(slot + 1) * per_value])
        return out


def u53(v: int) -> float:
    return (v & ((1 << 53) - 1)) * 2.0**-53


def as_dtype(values: list, dtype: torch.dtype, integer: bool) -> torch.Tensor:
    """Values cast as C++ static_cast does (half/bfloat16 from double or int64 via float)."""
    t = torch.tensor(values, dtype=torch.int64 if integer else torch.float64)
    if dtype in (torch.float16, torch.bfloat16):
        t = t.to(torch.float32)
    if dtype == torch.bool:
        return t != 0
    return t.to(dtype)


FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
SEEDS = [None, 0, 1, 2**32 + 7, 123456789]
N = 37  # not a multiple of any per-block count


def ref_mt(seed):
    return RefMT(5489 if seed is None else seed & 0xFFFFFFFF)


def run(seed, dtype, method, *args, n=N, calls=2):
    s = MT19937Sampler(seed)
    outs = []
    for _ in range(calls):
        t = torch.empty(n, dtype=dtype)
        getattr(s, method)(t, *args)
        outs.append(t)
    return outs


def assert_match(got: torch.Tensor, want: torch.Tensor, ulps: int = 0) -> None:
    if ulps and got.dtype == torch.float64:
        np.testing.assert_array_max_ulp(got.numpy(), want.numpy(), maxulp=ulps)
    else:
        assert torch.equal(got, want), (got, want)


# ---------------------------------------------------------------------- the source
def test_mt19937_known_answer_10000th_output_of_default_seed():
    s = MT19937Sampler()
    assert int(s._raw(10000)[-1]) == 4123659995
    ref = RefMT(5489)
    assert [ref() for _ in range(10000)][-1] == 4123659995


def test_no_seed_and_seed_zero_differ():
    a, b = torch.empty(16), torch.empty(16)
    MT19937Sampler().uniform_(a)
    MT19937Sampler(0).uniform_(b)
    assert not torch.equal(a, b)
    assert MT19937Sampler().initial_seed == 5489


def test_seed_is_reduced_to_32_bits():
    a, b = torch.empty(16), torch.empty(16)
    MT19937Sampler(5).uniform_(a)
    MT19937Sampler(5 + 2**32).uniform_(b)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------- per-op streams
FULL = {torch.bool: (4, 2), torch.uint8: (4, 256), torch.int8: (4, 128), torch.int16: (4, 2**15),
        torch.int32: (4, 2**31), torch.int64: (8, 2**63), torch.float32: (4, 2**24 + 1),
        torch.float64: (8, 2**53 + 1), torch.float16: (2, 2049), torch.bfloat16: (2, 257)}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", list(FULL), ids=str)
def test_random_full_range_matches_reference(seed, dtype):
    width, mod = FULL[dtype]
    mt = ref_mt(seed)
    for got in run(seed, dtype, "random_"):
        ws = RefStream(mt).words(N, width, 1)
        vals = [(w[0] & 1) if dtype == torch.bool else w[0] % mod for w in ws]
        assert_match(got, as_dtype(vals, dtype, True))


RANGES = [(0, 10), (-5, 7), (3, 3 * 2**30), (-(2**40), 2**40 + 3), (0, 2**63)]


@pytest.mark.parametrize("seed", SEEDS[:3])
@pytest.mark.parametrize("dtype", [torch.bool] + INTS + FLOATS, ids=str)
@pytest.mark.parametrize("bounds", RANGES, ids=str)
def test_random_range_matches_reference(seed, dtype, bounds):
    low, high = bounds
    if dtype == torch.bool:
        low, high = 0, 2
    elif dtype in INTS:
        info = torch.iinfo(dtype)
        low, high = max(low, info.min), min(high, info.max + 1)
    else:
        m = {torch.float16: 2**11, torch.bfloat16: 2**8, torch.float32: 2**24,
             torch.float64: 2**53}[dtype]
        low, high = max(low, -m), min(high, m)
    span = high - low
    wide = dtype in (torch.int64, torch.float64, torch.float32, torch.bfloat16)
    mt = ref_mt(seed)
    for got in run(seed, dtype, "random_range_", low, high):
        ws = RefStream(mt).words(N, 8 if wide else 4, 1)
        vals = []
        for (w,) in ws:
            if not (wide and span >= 2**32):
                w &= 0xFFFFFFFF
            v = (w % span + low) % 2**64
            vals.append(v - 2**64 if v >= 2**63 else v)
        assert_match(got, as_dtype(vals, dtype, True))


def test_random_range_full_64_bits_int64():
    mt = RefMT(9)
    got = run(9, torch.int64, "random_range_", -(2**63), 2**63, calls=1)[0]
    vals = [w - 2**64 if w >= 2**63 else w for (w,) in RefStream(mt).words(N, 8, 1)]
    assert torch.equal(got, torch.tensor(vals))


def _ref_real(seed, dtype, fn, per_value=1, calls=2, n=N):
    mt = ref_mt(seed)
    res = []
    for _ in range(calls):
        ws = RefStream(mt).words(n, 8, per_value)
        res.append(as_dtype([fn(*w) for w in ws], dtype, False))
    return res


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_uniform_matches_reference(seed, dtype):
    a, b = -1.5, 2.25
    want = _ref_real(seed, dtype, lambda v: u53(v) * (b - a) + a)
    for g, w in zip(run(seed, dtype, "uniform_", a, b), want, strict=True):
        assert_match(g, w)


def _box_muller(v0, v1, mean, std):
    z = math.sqrt(-2 * math.log1p(-u53(v1))) * math.cos(2 * math.pi * u53(v0))
    return z * std + mean


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_normal_matches_reference(seed, dtype):
    want = _ref_real(seed, dtype, lambda v0, v1: _box_muller(v0, v1, 0.5, 3.0), per_value=2)
    for g, w in zip(run(seed, dtype, "normal_", 0.5, 3.0), want, strict=True):
        assert_match(g, w)  # bit for bit, float64 included (libm on both sides)


@pytest.mark.parametrize("seed", SEEDS[:3])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_log_normal_matches_reference(seed, dtype):
    want = _ref_real(seed, dtype, lambda v0, v1: math.exp(_box_muller(v0, v1, 0.25, 0.75)),
                     per_value=2)
    for g, w in zip(run(seed, dtype, "log_normal_", 0.25, 0.75), want, strict=True):
        assert_match(g, w)  # bit for bit, float64 included (libm on both sides)


@pytest.mark.parametrize("seed", SEEDS[:3])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_exponential_matches_reference(seed, dtype):
    lam = 2.5
    want = _ref_real(seed, dtype, lambda v: -1 / lam * math.log1p(-u53(v)))
    for g, w in zip(run(seed, dtype, "exponential_", lam), want, strict=True):
        assert_match(g, w)  # bit for bit, float64 included (libm on both sides)


@pytest.mark.parametrize("seed", SEEDS[:3])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_cauchy_matches_reference(seed, dtype):
    want = _ref_real(seed, dtype, lambda v: 1.0 + 0.5 * math.tan(math.pi * (u53(v) - 0.5)))
    for g, w in zip(run(seed, dtype, "cauchy_", 1.0, 0.5), want, strict=True):
        assert_match(g, w)  # bit for bit, float64 included (libm on both sides)


GEO = {torch.float64: (8, 53), torch.float32: (4, 24), torch.float16: (2, 11),
       torch.bfloat16: (2, 8)}


@pytest.mark.parametrize("seed", SEEDS[:3])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_geometric_matches_reference(seed, dtype):
    p = 0.3
    width, bits = GEO[dtype]
    mt = ref_mt(seed)
    for got in run(seed, dtype, "geometric_", p, n=200):
        vals = []
        for (v,) in RefStream(mt).words(200, width, 1):
            x = (v & ((1 << bits) - 1)) * 2.0**-bits
            if dtype == torch.float64:
                vals.append(math.inf if x == 0 else math.ceil(math.log(x) / math.log1p(-p)))
            else:
                f32 = np.float32
                lg = f32(-math.inf) if x == 0 else f32(math.log(x))
                with np.errstate(divide="ignore"):
                    vals.append(float(np.ceil(lg / f32(math.log1p(-float(f32(p)))))))
        assert_match(got, as_dtype(vals, dtype, False))


@pytest.mark.parametrize("seed", SEEDS[:3])
@pytest.mark.parametrize("n", [0, 1, 2, 10, 1000])
def test_randperm_matches_reference(seed, n):
    mt = ref_mt(seed)
    s = MT19937Sampler(seed)
    for _ in range(2):
        got = torch.empty(n, dtype=torch.int64)
        s.randperm_(got)
        perm = list(range(n))
        for i in range(n - 1):
            j = i + mt() % (n - i)
            perm[i], perm[j] = perm[j], perm[i]
        assert got.tolist() == perm


def test_randperm_other_integer_dtype():
    a, b = torch.empty(50, dtype=torch.int32), torch.empty(50, dtype=torch.int64)
    MT19937Sampler(4).randperm_(a)
    MT19937Sampler(4).randperm_(b)
    assert torch.equal(a.long(), b) and sorted(b.tolist()) == list(range(50))


def test_multi_block_chunks_match_reference_on_large_tensor(monkeypatch):
    monkeypatch.setattr(compat, "_CHUNK_BLOCKS", 3)
    n = 1001
    got = run(11, torch.float32, "uniform_", 0.0, 1.0, n=n, calls=1)[0]
    want = _ref_real(11, torch.float32, u53, calls=1, n=n)[0]
    assert torch.equal(got, want)


def test_multidimensional_out_is_row_major():
    a, b = torch.empty(3, 5, 7), torch.empty(105)
    MT19937Sampler(3).uniform_(a)
    MT19937Sampler(3).uniform_(b)
    assert torch.equal(a.view(-1), b)


# ---------------------------------------------------------------------- state
def test_each_call_uses_exactly_four_draws_even_when_empty():
    s = MT19937Sampler(21)
    s.normal_(torch.empty(0))
    s.uniform_(torch.empty(1000))
    mt = RefMT(21)
    for _ in range(8):
        mt()
    assert int(s._raw(1)[0]) == mt()


def test_state_round_trip_reproduces_the_stream():
    s = MT19937Sampler(77)
    s.uniform_(torch.empty(5))
    s.randperm_(torch.empty(700, dtype=torch.int64))  # position past one twist
    state = s.state_bytes()
    assert len(state) == compat.STATE_BYTES == 2500
    first = torch.empty(20)
    s.normal_(first)
    r = MT19937Sampler(1)
    r.load_state_bytes(state)
    assert r.state_bytes() == state
    second = torch.empty(20)
    r.normal_(second)
    assert torch.equal(first, second)


def test_state_layout_is_words_then_position():
    s = MT19937Sampler(5)
    s._raw(10)
    b = s.state_bytes()
    assert int.from_bytes(b[-4:], "little") == 10
    ref = RefMT(5)
    ref._twist()
    assert list(np.frombuffer(b[:-4], "<u4")) == ref.mt


def test_load_state_rejects_bad_input():
    s = MT19937Sampler()
    with pytest.raises(ValueError, match="2500 bytes"):
        s.load_state_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="position"):
        s.load_state_bytes(b"\0" * 2496 + (625).to_bytes(4, "little"))


# ---------------------------------------------------------------------- errors
def test_unimplemented_ops_raise():
    s = MT19937Sampler()
    with pytest.raises(NotImplementedError, match="torchcsprng did not implement bernoulli_"):
        s.bernoulli_(torch.empty(3), 0.5)
    with pytest.raises(NotImplementedError, match="multinomial"):
        s.multinomial(torch.ones(3), 2, False)
    with pytest.raises(NotImplementedError, match="poisson"):
        s.poisson(torch.ones(3))


@pytest.mark.parametrize("method,args,dtype", [
    ("uniform_", (0.0, 1.0), torch.int32), ("normal_", (0.0, 1.0), torch.int64),
    ("random_", (), torch.complex64), ("geometric_", (0.5,), torch.uint8),
    ("randperm_", (), torch.bool), ("exponential_", (1.0,), torch.int16),
])
def test_unsupported_dtype_raises_type_error(method, args, dtype):
    with pytest.raises(TypeError, match=method.rstrip("_")):
        getattr(MT19937Sampler(), method)(torch.empty(4, dtype=dtype), *args)


def test_non_contiguous_out_is_rejected():
    with pytest.raises(ValueError, match="contiguous"):
        MT19937Sampler().uniform_(torch.empty(4, 4).t(), 0.0, 1.0)
