"""The native stream against an independent implementation of docs/csprng-stream.md.

The reference here is written from the document alone: pycryptodome's AES over big-endian counter
blocks, little-endian words, and the per-op formulas in plain Python and NumPy.
"""

import hashlib
import math
import warnings

import numpy as np
import pytest
import torch
from Crypto.Cipher import AES

import ember.csprng as csprng


def key_of(seed: int) -> bytes:
    return hashlib.sha256(b"ember.csprng/v1/seed\x00" + seed.to_bytes(16, "little")).digest()[:16]


class Reference:
    """Keystream of the documented layout, consumed draw by draw like a generator."""

    def __init__(self, seed: int, counter: int = 0):
        self.ecb = AES.new(key_of(seed), AES.MODE_ECB)
        self.counter = counter

    def words(self, n: int, width: int) -> list[int]:
        nblocks = -(-n * width // 16)
        data = self.ecb.encrypt(b"".join((self.counter + i).to_bytes(16, "big") for i in range(nblocks)))
        self.counter += nblocks
        return [int.from_bytes(data[i * width:(i + 1) * width], "little") for i in range(n)]


def generator_at(seed: int, counter: int):
    g = csprng.create_generator(seed)
    raw = bytearray(bytes(g.get_state().numpy()))
    raw[24:41] = counter.to_bytes(17, "little")
    return g.set_state(torch.frombuffer(raw, dtype=torch.uint8))


COUNTERS = [0, 2**32 - 3, 2**64 - 2]


def normal_pairs(n: int):
    """(radius word, angle word, cosine element, sine element) of each Box-Muller pair of an
    ``n``-value draw, from the document's group rule (sine element ``None`` where it is dropped)."""
    group, pairs = 16384, (n + 1) // 2
    out = []
    for j in range(pairs):
        g, i = divmod(j, group)
        q = min(group, pairs - g * group)
        base = 2 * g * group
        out.append((base + i, base + q + i, base + i, base + q + i if base + q + i < n else None))
    return out


def normal_values(n: int, words: list[int], pair_values) -> list:
    """Place ``pair_values(k0, k1) -> (cos value, sin value)`` of every pair at its elements."""
    got = [None] * n
    for kr, kt, ec, es in normal_pairs(n):
        zc, zs = pair_values(words[kr], words[kt])
        got[ec] = zc
        if es is not None:
            got[es] = zs
    assert None not in got
    return got


@pytest.mark.parametrize("counter", COUNTERS)
def test_uniform_float32_and_float64(counter):
    ref = Reference(3, counter)
    g = generator_at(3, counter)
    got32 = torch.rand(37, generator=g).numpy()
    want32 = np.array([(w & (2**24 - 1)) * 2.0**-24 for w in ref.words(37, 4)], np.float32)
    assert np.array_equal(got32, want32)
    got64 = torch.rand(11, generator=g, dtype=torch.float64).numpy()
    want64 = np.array([(w & (2**53 - 1)) * 2.0**-53 for w in ref.words(11, 8)])
    assert np.array_equal(got64, want64)
    assert g.counter == ref.counter


def test_uniform_16_bit_grids():
    ref, g = Reference(4), csprng.create_generator(4)
    got = torch.rand(21, generator=g, dtype=torch.float16).to(torch.float64).numpy()
    assert np.array_equal(got, [(w & 2047) * 2.0**-11 for w in ref.words(21, 2)])
    got = torch.rand(21, generator=g, dtype=torch.bfloat16).to(torch.float64).numpy()
    assert np.array_equal(got, [(w & 255) * 2.0**-8 for w in ref.words(21, 2)])
    assert g.counter == ref.counter


def test_uniform_general_interval_float32():
    ref, g = Reference(5), csprng.create_generator(5)
    got = torch.empty(20).uniform_(-2.0, 3.0, generator=g).numpy()
    s, a = np.float32((3.0 - -2.0) * 2.0**-24), np.float32(-2.0)
    want = [np.float32(np.float32(w & (2**24 - 1)) * s) + a for w in ref.words(20, 4)]
    assert np.array_equal(got, np.array(want, np.float32))


def pair64(k0, k1):
    """The float64 Box-Muller values of one pair, in plain Python."""
    r = math.sqrt(-2.0 * math.log(((k0 & (2**53 - 1)) + 1) * 2.0**-53))
    t = (k1 & (2**53 - 1)) * (2 * math.pi * 2.0**-53)
    return r * math.cos(t), r * math.sin(t)


@pytest.mark.parametrize("n", [1, 8, 9, 2 * 16384, 2 * 16384 + 1, 4 * 16384 + 7])
def test_normal_float64_pairs(n):
    ref, g = Reference(6), csprng.create_generator(6)
    got = torch.randn(n, generator=g, dtype=torch.float64).numpy()
    w = ref.words(2 * ((n + 1) // 2), 8)

    want = normal_values(n, w, pair64)
    np.testing.assert_allclose(got, want, rtol=4e-16, atol=4e-16)  # libm vs NumPy: an ulp or two
    assert g.counter == ref.counter


def test_normal_groups_through_chunks_and_threads(monkeypatch):
    """Chunked and threaded draws keep whole groups together (small chunks force many of them)."""
    from ember.csprng import distributions

    n = 6 * 16384 + 5  # four groups, the last one short
    ref = Reference(8)
    w = ref.words(2 * ((n + 1) // 2), 8)

    want = normal_values(n, w, pair64)
    monkeypatch.setattr(distributions, "CHUNK_BYTES", 4096)
    got = torch.randn(n, generator=csprng.create_generator(8), dtype=torch.float64).numpy()
    np.testing.assert_allclose(got, want, rtol=4e-16, atol=4e-16)
    monkeypatch.setattr(distributions, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(distributions, "PARALLEL_CHUNK_BYTES", 4096)
    monkeypatch.setattr(distributions, "_threads", lambda nbytes: 3)
    got = torch.randn(n, generator=csprng.create_generator(8), dtype=torch.float64).numpy()
    np.testing.assert_allclose(got, want, rtol=4e-16, atol=4e-16)


def test_exponential_cauchy_geometric_float64():
    ref, g = Reference(7), csprng.create_generator(7)
    got = torch.empty(9, dtype=torch.float64).exponential_(2.0, generator=g).numpy()
    want = [-math.log(((w & (2**53 - 1)) + 1) * 2.0**-53) / 2.0 for w in ref.words(9, 8)]
    np.testing.assert_allclose(got, want, rtol=1e-15)
    got = torch.empty(9, dtype=torch.float64).cauchy_(1.0, 2.0, generator=g).numpy()
    want = [1.0 + 2.0 * math.tan((((w & (2**52 - 1)) + 0.5) * 2.0**-52 - 0.5) * math.pi)
            for w in ref.words(9, 8)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    got = torch.empty(9, dtype=torch.float64).geometric_(0.3, generator=g).numpy()
    want = [math.ceil(math.log(((w & (2**52 - 1)) + 0.5) * 2.0**-52) / math.log1p(-0.3))
            for w in ref.words(9, 8)]
    assert np.array_equal(got, want)
    assert g.counter == ref.counter


def test_geometric_counts_past_float16_range_are_inf_without_a_warning():
    # torch rounds such counts to inf as well; NumPy's cast warning must not leak to the user
    n = 500  # above the small-draw path
    ref, g = Reference(12), csprng.create_generator(12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.empty(n, dtype=torch.float16).geometric_(1e-5, generator=g).numpy()
    exact = [math.ceil(math.log(((w & (2**52 - 1)) + 0.5) * 2.0**-52) / math.log1p(-1e-5))
             for w in ref.words(n, 8)]
    want = np.array(exact, dtype=np.float64)
    big = want > 65504
    assert big.any() and (~big).any()
    assert np.isinf(got[big]).all()
    assert np.array_equal(got[~big], want[~big].astype(np.float16))
    assert g.counter == ref.counter


def test_bernoulli_thresholds():
    ref, g = Reference(8), csprng.create_generator(8)
    got = torch.empty(30).bernoulli_(0.3, generator=g).numpy()
    t = math.floor(math.ldexp(0.3, 64))
    assert np.array_equal(got, [float(w < t) for w in ref.words(30, 8)])
    p = torch.linspace(0, 1, 30, dtype=torch.float64)
    got = torch.bernoulli(p, generator=g).numpy()
    want = [1.0 if pi >= 1 else float(w < math.floor(math.ldexp(pi, 64)))
            for w, pi in zip(ref.words(30, 8), p.tolist(), strict=True)]
    assert np.array_equal(got, want)


def lemire(words, r, bits):
    out, rejected = [], []
    for i, w in enumerate(words):
        if r & (r - 1) == 0:
            out.append(w & (r - 1))
            continue
        prod = w * r
        if prod % 2**bits < 2**bits % r:
            rejected.append(i)
        out.append(prod >> bits)
    return out, rejected


@pytest.mark.parametrize("low,high", [(0, 10), (-5, 123456), (0, 2**20), (0, 2**32), (-(2**31), 2**31),
                                      (7, 7 + 3 * 2**40), (0, 2**40), (-(2**63), 2**63 - 1)])
def test_integer_ranges_without_rejection(low, high):
    r = high - low
    width = 4 if r <= 2**32 else 8
    ref, g = Reference(9), csprng.create_generator(9)
    got = torch.randint(low, high, (50,), generator=g).tolist()
    values, rejected = lemire(ref.words(50, width), r, 8 * width)
    assert rejected == []  # these ranges reject with probability < 2**-12 per word
    assert got == [v + low for v in values]
    assert g.counter == ref.counter


def test_integer_rejections_are_refilled_from_the_reject_stream():
    import hmac

    low, r = -(2**63), 3 * 2**62
    seed = 10
    g = csprng.create_generator(seed)
    got = torch.randint(low, low + r, (40,), generator=g).tolist()
    ref = Reference(seed)
    values, pending = lemire(ref.words(40, 8), r, 64)
    assert pending  # about a quarter of the words are rejected
    key = hmac.new(key_of(seed), b"ember.csprng/v1/reject\x00" + (0).to_bytes(16, "little"),
                   hashlib.sha256).digest()[:16]
    refill = Reference(0)
    refill.ecb = AES.new(key, AES.MODE_ECB)
    while pending:
        new, again = lemire(refill.words(len(pending), 8), r, 64)
        for slot, v in zip(pending, new, strict=True):
            values[slot] = v
        pending = [pending[i] for i in again]
    assert got == [v + low for v in values]


def test_multinomial_with_replacement_inversion():
    ref, g = Reference(12), csprng.create_generator(12)
    w = [0.5, 0.0, 1.5, 2.0]
    got = torch.multinomial(torch.tensor(w, dtype=torch.float64), 15, True, generator=g).tolist()
    cdf = np.cumsum(w) / sum(w)
    want = [min(int(np.searchsorted(cdf, (x & (2**53 - 1)) * 2.0**-53, side="right")), 3)
            for x in ref.words(15, 8)]
    assert got == want


def test_fold_in_stream_uses_the_hmac_key():
    import hmac

    g = csprng.create_generator(13).fold_in(5)
    key = hmac.new(key_of(13), b"ember.csprng/v1/fold_in\x00" + (5).to_bytes(16, "little"),
                   hashlib.sha256).digest()[:16]
    ref = Reference(0)
    ref.ecb = AES.new(key, AES.MODE_ECB)
    got = torch.rand(8, generator=g).numpy()
    assert np.array_equal(got, np.array([(w & (2**24 - 1)) * 2.0**-24 for w in ref.words(8, 4)], np.float32))


def hmac_key(parent: bytes, label: bytes, index: int) -> bytes:
    import hmac

    return hmac.new(parent, b"ember.csprng/v1/" + label + b"\x00" + index.to_bytes(16, "little"),
                    hashlib.sha256).digest()[:16]


def rand32_from_key(key: bytes, n: int) -> np.ndarray:
    ref = Reference(0)
    ref.ecb = AES.new(key, AES.MODE_ECB)
    return np.array([(w & (2**24 - 1)) * 2.0**-24 for w in ref.words(n, 4)], np.float32)


def test_spawn_indices_count_across_calls():
    g = csprng.create_generator(21)
    children = g.spawn(2) + g.spawn(1)
    for j, child in enumerate(children):
        want = rand32_from_key(hmac_key(key_of(21), b"spawn", j), 6)
        assert np.array_equal(torch.rand(6, generator=child).numpy(), want)


def test_seed_kdf_uses_all_128_bits():
    seed = 2**127 + 2**64 + 7
    got = torch.rand(5, generator=csprng.create_generator(seed)).numpy()
    assert np.array_equal(got, rand32_from_key(key_of(seed), 5))


RANDOM_DEFAULT_RANGES = [(torch.int8, 2**7), (torch.int16, 2**15), (torch.int32, 2**31), (torch.uint8, 256),
                         (torch.bool, 2), (torch.float32, 2**24 + 1), (torch.float64, 2**53 + 1)]


@pytest.mark.parametrize("dtype,r", RANDOM_DEFAULT_RANGES)
def test_random_default_range_per_dtype(dtype, r):
    # the float ranges are not powers of two: Lemire, and this seed happens to reject nothing
    # (rejection odds are 2^m mod r / 2^m per element), which the reference checks before comparing
    ref, g = Reference(31), csprng.create_generator(31)
    got = torch.empty(40, dtype=dtype).random_(generator=g)
    width = 4 if r <= 2**32 else 8
    m = 8 * width
    words = ref.words(40, width)
    if r & (r - 1) == 0:
        want = [w & (r - 1) for w in words]
    else:
        assert all((w * r) % 2**m >= 2**m % r for w in words)
        want = [(w * r) >> m for w in words]
    assert [int(v) for v in got.tolist()] == want
    assert g.counter == ref.counter


@pytest.mark.parametrize("n", [1, 7, 65, 2 * 16384 + 3])
def test_normal_float32_pairs_odd_lengths(n):
    ref, g = Reference(33), csprng.create_generator(33)
    got = torch.randn(n, generator=g).numpy()
    w = ref.words(2 * ((n + 1) // 2), 4)
    f = np.float32

    def pair(k0, k1):
        r = np.sqrt(f(-2) * np.log(f((k0 & (2**24 - 1)) + 1) * f(2.0**-24)))
        t = f(k1 & (2**24 - 1)) * f(2 * math.pi * 2.0**-24)
        return r * np.cos(t), r * np.sin(t)

    want = normal_values(n, w, pair)
    # float32 log/sqrt/cos/sin may differ by a few ulp between libraries; |z| < 6 and t < 2*pi, so 1e-5
    # absolute covers several float32 ulps of every intermediate
    np.testing.assert_allclose(got, np.array(want, np.float32), rtol=1e-5, atol=1e-5)
    assert g.counter == ref.counter


@pytest.mark.parametrize("rate", [0.5, 4.0, 9.5])
def test_poisson_inverts_the_cdf_below_rate_10(rate):
    from scipy.special import gammaincc

    ref, g = Reference(34), csprng.create_generator(34)
    got = torch.poisson(torch.full((25,), rate, dtype=torch.float64), generator=g).tolist()
    want = []
    for w in ref.words(50, 8)[::2]:  # two words per element; inversion uses the first
        u = (w & (2**53 - 1)) * 2.0**-53
        k = 0
        while not gammaincc(k + 1, rate) > u:
            k += 1
        want.append(float(k))
    assert got == want
    assert g.counter == ref.counter


def ptrs(rate: float, u: float, v: float):
    """One PTRS trial (Hörmann 1993) as the document gives it: the count, or None if rejected."""
    slam = math.sqrt(rate)
    b = 0.931 + 2.53 * slam
    a = -0.059 + 0.02483 * b
    inv_alpha = 1.1239 + 1.1328 / (b - 3.4)
    vr = 0.9277 - 3.6224 / (b - 2)
    uc = u - 0.5
    us = 0.5 - abs(uc)
    if us == 0:
        return None
    k = math.floor((2 * a / us + b) * uc + rate + 0.43)
    if us >= 0.07 and v <= vr:
        return k
    if k < 0 or (us < 0.013 and v > us):
        return None
    log_pmf = -rate + k * math.log(rate) - math.lgamma(k + 1)
    lhs = (math.log(v) if v > 0 else -math.inf) + math.log(inv_alpha) - math.log(a / (us * us) + b)
    return k if lhs <= log_pmf else None


@pytest.mark.parametrize("rate", [10.0, 300.0, 12345.6])
def test_poisson_ptrs_with_refills_from_the_reject_stream(rate):
    import hmac

    seed, n = 35, 400
    g = csprng.create_generator(seed)
    got = torch.poisson(torch.full((n,), rate, dtype=torch.float64), generator=g).tolist()
    ref = Reference(seed)

    def u53(w):
        return (w & (2**53 - 1)) * 2.0**-53

    words = ref.words(2 * n, 8)
    values = [ptrs(rate, u53(words[2 * i]), u53(words[2 * i + 1])) for i in range(n)]
    pending = [i for i, v in enumerate(values) if v is None]
    assert pending  # PTRS rejects about one trial in ten at these rates
    key = hmac.new(key_of(seed), b"ember.csprng/v1/reject\x00" + (0).to_bytes(16, "little"),
                   hashlib.sha256).digest()[:16]
    refill = Reference(0)
    refill.ecb = AES.new(key, AES.MODE_ECB)
    while pending:
        w = refill.words(2 * len(pending), 8)
        for j, i in enumerate(pending):
            values[i] = ptrs(rate, u53(w[2 * j]), u53(w[2 * j + 1]))
        pending = [i for i in pending if values[i] is None]
    assert got == [float(v) for v in values]
    assert g.counter == ref.counter


def test_multinomial_without_replacement_smallest_keys():
    p = [0.1, 0.4, 0.0, 0.2, 0.3]
    ref, g = Reference(35), csprng.create_generator(35)
    got = torch.multinomial(torch.tensor([p, p[::-1]], dtype=torch.float64), 3, replacement=False,
                            generator=g).tolist()
    words = ref.words(10, 8)
    want = []
    for row, probs in enumerate([p, p[::-1]]):
        keys = []
        for c, pc in enumerate(probs):
            e = -math.log(((words[5 * row + c] & (2**53 - 1)) + 1) * 2.0**-53)
            keys.append(e / pc if pc > 0 else math.inf)
        want.append(sorted(range(5), key=lambda c: keys[c])[:3])
    assert got == want
    assert g.counter == ref.counter


def keystream_u32(key: bytes, counter: int, nblocks: int) -> np.ndarray:
    blocks = b"".join((counter + i).to_bytes(16, "big") for i in range(nblocks))
    return np.frombuffer(AES.new(key, AES.MODE_ECB).encrypt(blocks), dtype="<u4")


def randperm_reference(seed: int, n: int) -> tuple[list[int], int]:
    """docs/csprng-stream.md, randperm (layout 3), in plain Python: (permutation, rejected words)."""
    key = key_of(seed)
    words = [int(w) for w in keystream_u32(key, 0, -(-8 * n // 16))[:2 * n]]
    bits = min(24, max(0, (n - 1).bit_length() - 15))
    buckets: list[list[int]] = [[] for _ in range(2**bits)]
    for i in range(n):
        buckets[words[i] >> (32 - bits) if bits else 0].append(i)
    fy = words[n:]
    starts, q = [], 0
    for b in buckets:
        starts.append(q)
        q += len(b)

    def rejected(w: int, m: int) -> bool:
        return (w * m) % 2**32 < 2**32 % m

    pending = [(start + p, p + 1) for start, b in zip(starts, buckets, strict=True)
               for p in range(1, len(b)) if rejected(fy[start + p], p + 1)]
    n_rejected = len(pending)
    reject_key, counter = hmac_key(key, b"reject", 0), 0
    while pending:  # a round: one word per pending position, from the next whole block on
        nblocks = -(-4 * len(pending) // 16)
        new = [int(w) for w in keystream_u32(reject_key, counter, nblocks)[:len(pending)]]
        counter += nblocks
        again = []
        for (pos, m), w in zip(pending, new, strict=True):
            if rejected(w, m):
                again.append((pos, m))
            else:
                fy[pos] = w
        pending = again
    out = []
    for start, b in zip(starts, buckets, strict=True):
        a = list(b)
        for p in range(len(a) - 1, 0, -1):
            j = (fy[start + p] * (p + 1)) >> 32
            a[p], a[j] = a[j], a[p]
        out += a
    return out, n_rejected


@pytest.mark.parametrize("n", [2, 25, 2**15 + 1, 2**16 + 3])
def test_randperm_buckets_then_fisher_yates(n):
    # 1, 1, 2 and 4 buckets
    seed = 11
    g = csprng.create_generator(seed)
    got = torch.randperm(n, generator=g).tolist()
    want, _ = randperm_reference(seed, n)
    assert got == want
    assert g.counter == -(-n // 2)  # 2n 32-bit words


def test_randperm_rejected_fisher_yates_words_come_from_the_reject_stream():
    # one bucket of 2^15: about one seed in 16 has a word Lemire's method rejects; find one with
    # the reference's own rule (vectorised here only to find it quickly)
    n = 2**15
    m = np.arange(n, dtype=np.uint64) + np.uint64(1)
    for seed in range(400):
        fy = keystream_u32(key_of(seed), 0, n // 2)[n:2 * n].astype(np.uint64)
        if ((fy * m) % np.uint64(2**32) < np.uint64(2**32) % m).any():
            break
    else:
        pytest.fail("no seed below 400 rejects a word")
    want, n_rejected = randperm_reference(seed, n)
    assert n_rejected >= 1
    assert torch.randperm(n, generator=csprng.create_generator(seed)).tolist() == want


def words_np(ref: Reference, n: int) -> np.ndarray:
    """``n`` little-endian 32-bit words of the reference keystream as a NumPy array."""
    nblocks = -(-n * 4 // 16)
    blocks = b"".join((ref.counter + i).to_bytes(16, "big") for i in range(nblocks))
    ref.counter += nblocks
    return np.frombuffer(ref.ecb.encrypt(blocks), "<u4")[:n].astype(np.uint64)


# drawn in several chunks and on two threads (more than 1 MiB of keystream)
LARGE = 300_001


# 2**32 mod r is 6 and 296 for r = 10 and 1000: a rejection has probability < 1e-7 per word
@pytest.mark.parametrize("low,high", [(0, 10), (-5, 995), (0, 2**20), (0, 2**32), (-(2**31), 2**31)])
def test_large_integer_draws_without_rejection(low, high):
    r = high - low
    ref, g = Reference(12), csprng.create_generator(12)
    got = torch.randint(low, high, (LARGE,), generator=g).numpy()
    w = words_np(ref, LARGE)
    if r & (r - 1):
        assert not ((w * np.uint64(r)) % np.uint64(2**32) < np.uint64(2**32 % r)).any()
        values = (w * np.uint64(r)) >> np.uint64(32)
    else:
        values = w & np.uint64(r - 1)
    assert np.array_equal(got, values.astype(np.int64) + low)
    assert g.counter == ref.counter


@pytest.mark.parametrize("out", [False, True])
def test_large_uniform_float32_draws(out):
    ref, g = Reference(13), csprng.create_generator(13)
    n = 700_003
    if out:
        got = torch.empty(n)
        torch.rand(n, generator=g, out=got)
    else:
        got = torch.rand(n, generator=g)
    want = (words_np(ref, n) & np.uint64(2**24 - 1)).astype(np.float32) * np.float32(2.0**-24)
    assert np.array_equal(got.numpy(), want)
    assert g.counter == ref.counter
