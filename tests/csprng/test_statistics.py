"""Goodness of fit of every ember distribution, through torch's API, against scipy.stats.

Fixed seeds make each test deterministic; the significance level 1e-4 keeps them meaningful (a
broken transform fails by many orders of magnitude) without being fragile.
"""

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

import ember.csprng as csprng

ALPHA = 1e-4
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
N = 20_000


def gen(seed=0):
    return csprng.create_generator(seed)


def as_np(t):
    return t.to(torch.float64).numpy()


def ks(sample, cdf):
    return stats.kstest(sample, cdf).pvalue


@pytest.mark.parametrize("dtype", FLOATS)
def test_rand_is_uniform_on_0_1(dtype):
    x = torch.rand(N, generator=gen(1), dtype=dtype)
    v = as_np(x)
    assert v.min() >= 0.0 and v.max() < 1.0
    if dtype in (torch.float32, torch.float64):
        assert ks(v, "uniform") > ALPHA
    else:  # exact grid of 2**-bits: chi-square over 16 equal bins is exact for these grids
        counts = np.histogram(v, bins=16, range=(0, 1))[0]
        assert stats.chisquare(counts).pvalue > ALPHA


@pytest.mark.parametrize("dtype", FLOATS)
def test_uniform_a_b_stays_in_half_open_interval(dtype):
    a, b = -3.0, 5.0
    x = torch.empty(N, dtype=dtype).uniform_(a, b, generator=gen(2))
    v = as_np(x)
    assert v.min() >= a and v.max() < b
    counts = np.histogram(v, bins=8, range=(a, b))[0]
    assert stats.chisquare(counts).pvalue > ALPHA


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_uniform_never_rounds_up_to_b(dtype):
    # an interval whose top values round to b in the dtype unless clamped
    b = 1.0 + torch.finfo(dtype).eps  # the next value above 1 in the dtype
    x = torch.empty(200_000, dtype=dtype).uniform_(0.999, b, generator=gen(3))
    assert float(x.max()) < b and float(x.min()) >= 0.999 - 1e-3


@pytest.mark.parametrize("dtype", FLOATS)
def test_randn_and_normal_fit_the_normal_distribution(dtype):
    z = as_np(torch.randn(N, generator=gen(4), dtype=dtype))
    tol = 0.0 if dtype in (torch.float32, torch.float64) else 2e-2
    if tol == 0.0:
        assert ks(z, "norm") > ALPHA
    else:  # 16-bit outputs are rounded: test quantiles
        qs = np.quantile(z, [0.1, 0.25, 0.5, 0.75, 0.9])
        assert np.allclose(qs, stats.norm.ppf([0.1, 0.25, 0.5, 0.75, 0.9]), atol=0.05)
    x = as_np(torch.empty(N, dtype=dtype).normal_(2.0, 3.0, generator=gen(5)))
    assert abs(x.mean() - 2.0) < 0.1 and abs(x.std() - 3.0) < 0.1


def test_normal_pairs_are_independent():
    group = 16384  # docs/csprng-stream.md: groups of 16384 pairs, cosines then sines
    z = as_np(torch.randn(4 * group, generator=gen(6), dtype=torch.float64)).reshape(-1, 2, group)
    # cos and sin outputs of one Box-Muller pair: uncorrelated, and their squares too
    even, odd = z[:, 0].reshape(-1), z[:, 1].reshape(-1)
    assert abs(np.corrcoef(even, odd)[0, 1]) < 4.5 / math.sqrt(even.size)
    assert abs(np.corrcoef(even**2, odd**2)[0, 1]) < 4.5 / math.sqrt(even.size)
    assert ks(np.hypot(even, odd) ** 2, stats.expon(scale=2).cdf) > ALPHA


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_normal(dtype):
    x = as_np(torch.empty(N, dtype=dtype).log_normal_(0.5, 0.75, generator=gen(7)))
    assert ks(x, stats.lognorm(s=0.75, scale=math.exp(0.5)).cdf) > ALPHA


@pytest.mark.parametrize("dtype", FLOATS)
def test_exponential(dtype):
    x = as_np(torch.empty(N, dtype=dtype).exponential_(2.5, generator=gen(8)))
    assert x.min() >= 0
    if dtype in (torch.float32, torch.float64):
        assert ks(x, stats.expon(scale=1 / 2.5).cdf) > ALPHA
    else:
        assert abs(x.mean() - 0.4) < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cauchy(dtype):
    x = as_np(torch.empty(N, dtype=dtype).cauchy_(1.0, 2.0, generator=gen(9)))
    assert np.isfinite(x).all()
    assert ks(x, stats.cauchy(loc=1.0, scale=2.0).cdf) > ALPHA


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32])
@pytest.mark.parametrize("p", [0.05, 0.5])
def test_geometric(dtype, p):
    x = as_np(torch.empty(N, dtype=dtype).geometric_(p, generator=gen(10)))
    assert x.min() >= 1
    k = np.arange(1, 12)
    observed = np.array([(x == i).sum() for i in k] + [(x >= 12).sum()])
    expected = N * np.append(stats.geom.pmf(k, p), stats.geom.sf(11, p))
    keep = expected > 5
    obs, exp = observed[keep], expected[keep]
    assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > ALPHA


@pytest.mark.parametrize("p", [1e-3, 0.3, 0.9])
def test_bernoulli_scalar_p(p):
    n = 200_000
    x = torch.empty(n).bernoulli_(p, generator=gen(11))
    assert set(torch.unique(x).tolist()) <= {0.0, 1.0}
    assert stats.binomtest(int(x.sum()), n, p).pvalue > ALPHA


def test_bernoulli_tensor_p_per_element():
    p = torch.tensor([0.0, 0.01, 0.5, 0.99, 1.0]).repeat(20_000)
    x = torch.bernoulli(p, generator=gen(12)).view(-1, 5)
    assert x[:, 0].sum() == 0 and x[:, 4].sum() == 20_000
    for j, pj in enumerate([0.01, 0.5, 0.99], start=1):
        assert stats.binomtest(int(x[:, j].sum()), 20_000, pj).pvalue > ALPHA


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                   torch.float32, torch.float64])
def test_randint_small_range_is_uniform(dtype):
    x = torch.randint(-3 if dtype != torch.uint8 else 0, 7, (N,), generator=gen(13), dtype=dtype)
    v = x.to(torch.int64).numpy()
    lo = -3 if dtype != torch.uint8 else 0
    counts = np.bincount(v - lo, minlength=7 - lo)
    assert len(counts) == 7 - lo
    assert stats.chisquare(counts).pvalue > ALPHA


def test_range_3_times_2_to_30_is_unbiased():
    # With `v % r` on 32-bit words (torchcsprng), values below 2**30 are twice as likely as the
    # others: P(v < 2**30) = 1/2 instead of 1/3. Thirds of the range must be equally likely; 60000
    # draws resolve a difference of a few percent, far below that bias.
    r = 3 * 2**30
    v = torch.randint(0, r, (60_000,), generator=gen(14)).numpy()
    thirds = np.bincount(v // 2**30, minlength=3)
    assert stats.chisquare(thirds).pvalue > ALPHA
    halves = np.bincount(v // (r // 2), minlength=2)
    assert stats.chisquare(halves).pvalue > ALPHA


def test_rejection_path_is_uniform_and_reproducible():
    # range 3 * 2**62 on 64-bit words: a quarter of the words are rejected and refilled
    lo = -(2**63)
    x = torch.randint(lo, lo + 3 * 2**62, (40_000,), generator=gen(15))
    parts = np.bincount(((x.numpy().astype(object) - lo) // 2**62).astype(np.int64), minlength=3)
    assert parts.size == 3 and stats.chisquare(parts).pvalue > ALPHA
    assert torch.equal(x, torch.randint(lo, lo + 3 * 2**62, (40_000,), generator=gen(15)))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int64,
                                   torch.float16, torch.float32])
def test_random_default_ranges(dtype):
    x = torch.empty(N, dtype=dtype).random_(generator=gen(16)).to(torch.float64)
    top = {torch.bool: 1, torch.uint8: 255, torch.int8: 127, torch.int16: 2**15 - 1,
           torch.int64: 2**63 - 1, torch.float16: 2**11, torch.float32: 2**24}[dtype]
    assert float(x.min()) >= 0 and float(x.max()) <= top
    counts = np.histogram(x.numpy(), bins=2 if dtype == torch.bool else 8, range=(0.0, float(top) + 1.0))[0]
    assert stats.chisquare(counts).pvalue > ALPHA


@pytest.mark.parametrize("n", [3, 4, 5])
def test_randperm_is_uniform_over_all_permutations(n):
    g = gen(17 + n)
    perms = list(itertools.permutations(range(n)))
    index = {p: i for i, p in enumerate(perms)}
    trials = 300 * len(perms)
    counts = np.zeros(len(perms), np.int64)
    for _ in range(trials):
        counts[index[tuple(torch.randperm(n, generator=g).tolist())]] += 1
    assert stats.chisquare(counts).pvalue > ALPHA


def test_randperm_large_is_a_permutation():
    p = torch.randperm(300_001, generator=gen(21))
    assert torch.equal(torch.sort(p).values, torch.arange(300_001))


def test_multinomial_with_replacement_matches_probabilities():
    w = torch.tensor([1.0, 0.0, 2.0, 5.0, 2.0])
    x = torch.multinomial(w, 40_000, replacement=True, generator=gen(22)).numpy()
    counts = np.bincount(x, minlength=5)
    assert counts[1] == 0
    keep = w.numpy() > 0
    assert stats.chisquare(counts[keep], 40_000 * (w.numpy()[keep] / w.sum().item())).pvalue > ALPHA


def test_multinomial_without_replacement_first_two_draws():
    w = np.array([1.0, 2.0, 3.0, 4.0])
    p = w / w.sum()
    g = gen(23)
    rows = 20_000
    draws = torch.multinomial(torch.tensor(w).repeat(rows, 1), 2, replacement=False, generator=g).numpy()
    assert (draws[:, 0] != draws[:, 1]).all()
    pairs = [(i, j) for i in range(4) for j in range(4) if i != j]
    # sequential sampling without replacement: P(i then j) = p_i * p_j / (1 - p_i)
    expected = np.array([p[i] * p[j] / (1 - p[i]) for i, j in pairs]) * rows
    observed = np.array([((draws[:, 0] == i) & (draws[:, 1] == j)).sum() for i, j in pairs])
    assert stats.chisquare(observed, expected).pvalue > ALPHA


def test_multinomial_with_too_few_non_zero_categories_takes_those_first():
    # torch accepts this draw: the non-zero categories come first
    got = torch.multinomial(torch.tensor([0.0, 1.0, 0.0]), 2, generator=gen())
    assert got[0] == 1 and got[1] in (0, 2)


@pytest.mark.parametrize("rate", [0.5, 5.0, 50.0, 500.0])
def test_poisson_matches_scipy(rate):
    x = torch.poisson(torch.full((N,), rate, dtype=torch.float64), generator=gen(24)).numpy()
    lo, hi = int(stats.poisson.ppf(1e-3, rate)), int(stats.poisson.ppf(1 - 1e-3, rate))
    edges = np.unique(np.linspace(lo, hi + 1, 12).astype(int))
    observed = np.histogram(x, bins=np.concatenate([[-np.inf], edges[1:-1], [np.inf]]))[0]
    cdf = stats.poisson.cdf(edges[1:-1] - 1, rate)
    expected = N * np.diff(np.concatenate([[0.0], cdf, [1.0]]))
    assert stats.chisquare(observed, expected).pvalue > ALPHA


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_complex_normal_has_unit_variance(dtype):
    cdtype = torch.complex64 if dtype == torch.float32 else torch.complex128
    z = torch.randn(N, dtype=cdtype, generator=gen(25))
    assert abs(float(z.abs().pow(2).mean()) - 1.0) < 0.05
