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
