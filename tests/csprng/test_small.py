"""Tiny draws take a plain-Python path; it must give exactly the values of the NumPy path."""

import pytest
import torch

import ember.csprng as csprng
from ember.csprng import small

DRAWS = {
    "rand f32": lambda g, n: torch.rand(n, generator=g),
    "rand f16": lambda g, n: torch.rand(n, generator=g, dtype=torch.float16),
    "rand f64": lambda g, n: torch.rand(n, generator=g, dtype=torch.float64),
    "uniform f64 range": lambda g, n: torch.empty(n, dtype=torch.float64).uniform_(-3, 0.1, generator=g),
    "uniform f64 tiny range": lambda g, n: torch.empty(n, dtype=torch.float64).uniform_(
        1.0, 1.0 + 2**-50, generator=g),
    "uniform f64 a == b": lambda g, n: torch.empty(n, dtype=torch.float64).uniform_(2, 2, generator=g),
    "uniform f32 range": lambda g, n: torch.empty(n).uniform_(-3, 0.1, generator=g),
    "uniform bf16": lambda g, n: torch.rand(n, generator=g, dtype=torch.bfloat16),
    "randint": lambda g, n: torch.randint(-7, 1000, (n,), generator=g),
    "randint pow2": lambda g, n: torch.randint(5, 5 + 2**20, (n,), generator=g),
    "randint 2**32": lambda g, n: torch.randint(0, 2**32, (n,), generator=g),
    "randint rejecting": lambda g, n: torch.randint(0, 3 * 2**30, (n,), generator=g),
    "randint wide rejecting": lambda g, n: torch.randint(-(2**62), 2**62 + 3 * 2**60, (n,), generator=g),
    "randint int32": lambda g, n: torch.randint(-100, 100, (n,), generator=g, dtype=torch.int32),
    "random_ full int64": lambda g, n: torch.empty(n, dtype=torch.int64).random_(generator=g),
    "random_ uint8": lambda g, n: torch.empty(n, dtype=torch.uint8).random_(generator=g),
    "random_ int8 range": lambda g, n: torch.empty(n, dtype=torch.int8).random_(-100, 27, generator=g),
    "random_ f16": lambda g, n: torch.empty(n, dtype=torch.float16).random_(0, 100, generator=g),
    "random_ f32": lambda g, n: torch.empty(n).random_(generator=g),
    "random_ bool": lambda g, n: torch.empty(n, dtype=torch.bool).random_(generator=g),
    "bernoulli f32": lambda g, n: torch.empty(n).bernoulli_(0.3, generator=g),
    "bernoulli int8": lambda g, n: torch.empty(n, dtype=torch.int8).bernoulli_(0.7, generator=g),
    "bernoulli bool": lambda g, n: torch.empty(n, dtype=torch.bool).bernoulli_(1e-3, generator=g),
    "randn": lambda g, n: torch.randn(n, generator=g),
    "randn f64": lambda g, n: torch.randn(n, generator=g, dtype=torch.float64),
    "randn f16": lambda g, n: torch.randn(n, generator=g, dtype=torch.float16),
    "randn bf16": lambda g, n: torch.randn(n, generator=g, dtype=torch.bfloat16),
    "normal affine": lambda g, n: torch.normal(2.5, 0.3, (n,), generator=g),
    "normal affine f64": lambda g, n: torch.normal(-1.0, 7.0, (n,), generator=g, dtype=torch.float64),
    "log_normal": lambda g, n: torch.empty(n).log_normal_(generator=g),
    "log_normal f64": lambda g, n: torch.empty(n, dtype=torch.float64).log_normal_(0.5, 0.25, generator=g),
    "normal_ std 0": lambda g, n: torch.empty(n).normal_(3.0, 0.0, generator=g),
}


def _three_draws(draw, n):
    g = csprng.create_generator(5)
    return [draw(g, n) for _ in range(3)], g.counter


@pytest.mark.parametrize("name", sorted(DRAWS))
@pytest.mark.parametrize("n", [1, 3, 17, small.SMALL_ITEMS])
def test_small_path_equals_numpy_path(monkeypatch, name, n):
    draw = DRAWS[name]
    fast, fast_counter = _three_draws(draw, n)
    monkeypatch.setattr(small, "SMALL_ITEMS", 0)  # every draw through NumPy
    slow, slow_counter = _three_draws(draw, n)
    assert fast_counter == slow_counter
    for a, b in zip(fast, slow, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_small_path_rejections_are_refilled():
    # with r = 3 * 2**30 a quarter of the 32-bit words are rejected: 64 draws surely hit some
    g = csprng.create_generator(1)
    start = g.counter
    start_block, bad = small.integers(g._stream, torch.empty(64, dtype=torch.int64), 64, 0, 3 * 2**30)
    assert start_block == start and bad
    x = torch.randint(0, 3 * 2**30, (64,), generator=g)
    assert int(x.min()) >= 0 and int(x.max()) < 3 * 2**30


def test_small_draws_write_the_output_in_place():
    g = csprng.create_generator(2)
    out = torch.full((2, 3), -1.0)
    ref = out.view(-1)
    torch.rand(2, 3, generator=g, out=out)
    assert ref.data_ptr() == out.data_ptr() and bool(((out >= 0) & (out < 1)).all())


def test_small_in_place_draw_bumps_the_autograd_version():
    g = csprng.create_generator(3)
    x = torch.zeros(4)
    before = x._version
    x.uniform_(generator=g)
    assert x._version > before


def test_small_normal_draws_fit_in_one_group():
    # small.normal pairs the first half of its words with the second half: one group of pairs
    from ember.csprng.distributions import NORMAL_GROUP

    assert (small.SMALL_ITEMS + 1) // 2 <= NORMAL_GROUP


@pytest.mark.parametrize("name", ["randn", "randn f64", "randn f16", "randn bf16", "normal affine",
                                  "normal affine f64", "log_normal", "log_normal f64", "normal_ std 0"])
@pytest.mark.parametrize("n", [65, 999, 1000, 2 * small.MEDIUM_PAIRS - 1, 2 * small.MEDIUM_PAIRS])
def test_medium_normal_path_equals_numpy_path(monkeypatch, name, n):
    draw = DRAWS[name]
    fast, fast_counter = _three_draws(draw, n)
    monkeypatch.setattr(small, "MEDIUM_PAIRS", 0)  # every draw through the chunked NumPy path
    slow, slow_counter = _three_draws(draw, n)
    assert fast_counter == slow_counter
    for a, b in zip(fast, slow, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
