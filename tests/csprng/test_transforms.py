"""ember.csprng._transforms (one-pass randint and rand transforms) against their NumPy
formulations in ember.csprng.transforms, on the same words; and the draws through torch with and
without the compiled code give the same values."""

import numpy as np
import pytest
import torch

import ember.csprng as csprng
from ember.csprng import transforms

compiled = pytest.mark.skipif(not transforms.compiled_available(),
                              reason="ember.csprng._transforms was not built (no C compiler)")

RANGES = [1, 2, 3, 7, 10, 1000, 2**16, 2**31 - 1, 2**31, 2**31 + 1, 3 * 2**30 + 5, 2**32 - 1, 2**32]
OFFSETS = [0, 5, 2**63, 2**64 - 3]


def _words(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint32)


@compiled
@pytest.mark.parametrize("r", RANGES)
@pytest.mark.parametrize("offset", OFFSETS)
def test_bounded32_equals_numpy(r, offset):
    w = _words(10_001, r % 97)
    a, b = np.empty(w.size, np.uint64), np.empty(w.size, np.uint64)
    want = transforms.bounded32_numpy(w, r, offset, a)
    got = transforms._compiled.bounded32(w, r, offset, b)
    assert got == want
    assert np.array_equal(a, b)


def test_bounded32_numpy_is_lemire_by_python_integers():
    """The reference itself, checked with Python's integers on a few words."""
    w = _words(200, 1)
    for r in (3, 2**31 + 1, 2**32 - 1):
        out = np.empty(w.size, np.uint64)
        rejected = transforms.bounded32_numpy(w, r, 7, out)
        want = [((int(x) * r) >> 32) + 7 for x in w]
        assert out.tolist() == want
        assert rejected == sum((int(x) * r) % 2**32 < 2**32 % r for x in w)


@compiled
def test_bounded32_rejects_bad_arguments():
    w, out = _words(4, 0), np.empty(4, np.uint64)
    with pytest.raises(ValueError, match="r must be"):
        transforms._compiled.bounded32(w, 0, 0, out)
    with pytest.raises(ValueError, match="same number"):
        transforms._compiled.bounded32(w, 3, 0, np.empty(3, np.uint64))


@compiled
@pytest.mark.parametrize("bits", [1, 11, 23, 24])
@pytest.mark.parametrize("scale", [2.0**-24, 2.0**-23 * 3.0, 0.1, 1e30])
@pytest.mark.parametrize("in_place", [False, True])
def test_unit_float32_equals_numpy(bits, scale, in_place):
    w = _words(4099, bits)
    want = np.empty(w.size, np.float32)
    transforms.unit_float32_numpy(w, bits, float(np.float32(scale)), want)
    if in_place:
        buf = w.copy()
        transforms._compiled.unit_float32(buf, bits, float(np.float32(scale)), buf.view(np.float32))
        got = buf.view(np.float32)
    else:
        got = np.empty(w.size, np.float32)
        transforms._compiled.unit_float32(w, bits, float(np.float32(scale)), got)
    assert np.array_equal(want.view(np.uint32), got.view(np.uint32))


def _draws(seed: int) -> list[torch.Tensor]:
    g = csprng.create_generator(seed)
    out = [torch.randint(0, 10, (300_000,), generator=g),
           torch.randint(-(2**31), 2**31 - 7, (70_000,), generator=g),
           torch.randint(5, 5 + 2**32, (70_001,), generator=g, dtype=torch.int64),
           torch.randint(0, 3 * 2**30 + 1, (1 << 20,), generator=g),
           torch.randint(0, 200, (50_000,), generator=g, dtype=torch.uint8),
           torch.rand(600_000, generator=g),
           torch.empty(300_000).uniform_(0.0, 3.5, generator=g),
           torch.rand(3 << 20, generator=g)]
    return out + [torch.tensor(g.counter)]


def test_draws_equal_with_and_without_the_compiled_transforms(monkeypatch):
    fast = _draws(3)
    monkeypatch.setattr(transforms, "_compiled", None)
    slow = _draws(3)
    for a, b in zip(fast, slow, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


# ---------------------------------------------------------------- Box-Muller's exact steps
compiled_normal = pytest.mark.skipif(not transforms.normal_compiled(),
                                     reason="normal transforms not built (no C compiler, or a "
                                            "C compiler without FLT_EVAL_METHOD 0)")
_BITS = {np.float32: 24, np.float64: 53}


def _normal_words(m: int, cd, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if cd is np.float64:
        w = rng.integers(0, 2**64, 2 * m, dtype=np.uint64)
        edge = np.array([0, 2**64 - 1, 2**53 - 1, 2**53], np.uint64)
    else:
        w = rng.integers(0, 2**32, 2 * m, dtype=np.uint32)
        edge = np.array([0, 2**32 - 1, 2**24 - 1, 2**24], np.uint32)
    e = edge[: m]
    w[: e.size] = e  # k = 0 and k = 2**bits - 1 (log r = 0, a zero radius) among the radii
    w[m: m + e.size] = e  # ... and among the angles
    return w


def _both(words, m, group, cd, c_and_s_in_z=False):
    """(NumPy's z, the compiled z) from the same words, through log, cos and sin."""
    bits = _BITS[cd]
    angle = float(cd(2.0 * np.pi * 2.0**-bits))
    results = []
    for inputs, outputs in ((transforms._normal_inputs_any, transforms._normal_outputs_any),
                            (transforms._compiled.normal_inputs,
                             transforms._compiled.normal_outputs)):
        r, th = np.empty(m, cd), np.empty(m, cd)
        inputs(words.copy(), m, group, bits, angle, r, th, cd is np.float64)
        np.log(r, out=r)
        z = np.empty(2 * m, cd)
        if c_and_s_in_z:  # one group: cosines and sines already in z's halves (normal_medium)
            np.cos(th, out=z[:m])
            np.sin(th, out=z[m:])
            outputs(r, z[:m], z[m:], m, group, z, cd is np.float64)
        else:
            c = np.cos(th)
            np.sin(th, out=th)
            outputs(r, c, th, m, group, z, cd is np.float64)
        results.append(z)
    return results


@compiled_normal
@pytest.mark.parametrize("cd", [np.float32, np.float64])
@pytest.mark.parametrize("m, group", [(1, 16384), (500, 16384), (16384, 16384), (40001, 16384),
                                      (10, 3), (7, 7)])
def test_normal_transforms_equal_numpy_bit_for_bit(cd, m, group):
    want, got = _both(_normal_words(m, cd, m), m, group, cd)
    assert np.array_equal(want.view(np.uint8), got.view(np.uint8))  # -0.0 and +0.0 differ here
    assert np.isfinite(got).all()


@compiled_normal
@pytest.mark.parametrize("cd", [np.float32, np.float64])
def test_normal_outputs_may_read_cosines_and_sines_from_z_itself(cd):
    m = 777
    want, got = _both(_normal_words(m, cd, 5), m, m, cd, c_and_s_in_z=True)
    assert np.array_equal(want.view(np.uint8), got.view(np.uint8))


@compiled_normal
def test_normal_inputs_read_the_first_2m_words_of_a_longer_keystream_buffer():
    m, cd = 300, np.float32
    w = _normal_words(m, cd, 9)
    r1, t1, r2, t2 = (np.empty(m, cd) for _ in range(4))
    transforms._compiled.normal_inputs(w, m, m, 24, 1e-7, r1, t1, False)
    longer = bytearray(w.tobytes() + bytes(16))
    transforms._compiled.normal_inputs(longer, m, m, 24, 1e-7, r2, t2, False)
    assert np.array_equal(r1, r2) and np.array_equal(t1, t2)


@compiled_normal
def test_normal_transforms_refuse_wrong_lengths():
    w = _normal_words(4, np.float32, 0)
    r = np.empty(4, np.float32)
    with pytest.raises(ValueError, match="at least 2m"):
        transforms._compiled.normal_inputs(w[:7], 4, 4, 24, 1e-7, r, r.copy(), False)
    with pytest.raises(ValueError, match="r and th m"):
        transforms._compiled.normal_inputs(w, 4, 4, 24, 1e-7, r[:3], r.copy(), False)
    with pytest.raises(ValueError, match="bits"):
        transforms._compiled.normal_inputs(w, 4, 4, 25, 1e-7, r, r.copy(), False)
    with pytest.raises(ValueError, match="z 2m"):
        transforms._compiled.normal_outputs(r, r, r, 4, 4, np.empty(7, np.float32), False)


def _normal_draws(seed: int) -> list[torch.Tensor]:
    g = csprng.create_generator(seed)
    out = []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for n in (1, 10, 64, 65, 999, 1000, 32768, 32769, 100_001, 600_000):
            out.append(torch.randn(n, dtype=dtype, generator=g))
        out.append(torch.empty(3001, dtype=dtype).log_normal_(0.5, 0.7, generator=g))
        out.append(torch.normal(1.5, 0.3, (2, 501), generator=g).to(dtype))
    ts = [torch.empty(s) for s in (3, 1000, 70000, 5)]
    csprng.normal_foreach_(ts, 0.7, generator=g)
    return out + ts + [torch.tensor(g.counter)]


def test_normal_draws_equal_with_and_without_the_compiled_transforms(monkeypatch):
    fast = _normal_draws(4)
    monkeypatch.setattr(transforms, "_compiled_normal", None)
    monkeypatch.setattr(transforms, "normal_inputs", transforms._normal_inputs_any)
    monkeypatch.setattr(transforms, "normal_outputs", transforms._normal_outputs_any)
    slow = _normal_draws(4)
    for a, b in zip(fast, slow, strict=True):  # bytes: -0.0 and +0.0 must not pass as equal
        assert a.dtype == b.dtype
        if a.dim():
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        else:  # the generator's counter
            assert torch.equal(a, b)


@compiled_normal
def test_normal_transforms_refuse_a_pair_count_whose_byte_length_overflows():
    empty = np.empty(0, np.float32)
    with pytest.raises(ValueError, match="bad m"):
        transforms._compiled.normal_inputs(b"", 2**62, 1, 24, 1.0, empty, empty, False)
    with pytest.raises(ValueError, match="bad m"):
        transforms._compiled.normal_outputs(empty, empty, empty, 2**62, 1, empty, False)
