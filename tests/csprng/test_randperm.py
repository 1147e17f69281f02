"""randperm is uniform over all permutations: chi-square over every permutation of small n,
position and pair frequencies for larger n. Seeds are fixed, so the outcomes are deterministic."""

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

import ember.csprng as csprng

P_MIN = 1e-4  # a fixed seed: a uniform sampler passes every test below with this seed or it never does


def _perm_counts(n: int, draws: int, seed: int) -> np.ndarray:
    g = csprng.create_generator(seed)
    index = {p: i for i, p in enumerate(itertools.permutations(range(n)))}
    counts = np.zeros(len(index), np.int64)
    for _ in range(draws):
        counts[index[tuple(torch.randperm(n, generator=g).tolist())]] += 1
    return counts


def _chi2_uniform(counts: np.ndarray) -> float:
    return stats.chisquare(counts).pvalue


def test_all_24_permutations_of_4_are_equally_likely():
    counts = _perm_counts(4, 12_000, seed=1)
    assert counts.min() > 0
    assert _chi2_uniform(counts) > P_MIN


@pytest.mark.slow
def test_all_120_permutations_of_5_are_equally_likely():
    counts = _perm_counts(5, 120_000, seed=2)
    assert _chi2_uniform(counts) > P_MIN


def test_a_biased_sampler_fails_the_same_check():
    # the check has power: the classic "swap with any position" shuffle is biased for n = 4
    rng = np.random.default_rng(3)
    index = {p: i for i, p in enumerate(itertools.permutations(range(4)))}
    counts = np.zeros(24, np.int64)
    for _ in range(12_000):
        a = list(range(4))
        for i in range(4):
            j = int(rng.integers(0, 4))
            a[i], a[j] = a[j], a[i]
        counts[index[tuple(a)]] += 1
    assert _chi2_uniform(counts) < P_MIN


def test_values_are_uniform_over_positions_and_neighbours_are_unordered():
    n, draws = 64, 4000
    g = csprng.create_generator(4)
    perms = np.stack([torch.randperm(n, generator=g).numpy() for _ in range(draws)])
    assert (np.sort(perms, axis=1) == np.arange(n)).all()
    # value v at position j: every cell has expectation draws / n
    table = np.zeros((n, n), np.int64)
    np.add.at(table, (np.tile(np.arange(n), draws), perms.reshape(-1)), 1)
    assert stats.chisquare(table.reshape(-1)).pvalue > P_MIN
    # perm[j] < perm[j + 1] has probability 1/2 for every adjacent pair of positions
    up = (perms[:, 1:] < perms[:, :-1]).sum(axis=0)
    z = (up - draws / 2) / math.sqrt(draws / 4)
    assert np.abs(z).max() < 4.5
    # the values at positions 0 and 1 cover all n * (n - 1) ordered pairs evenly
    pairs = np.zeros((n, n), np.int64)
    np.add.at(pairs, (perms[:, 0], perms[:, 1]), 1)
    assert np.diag(pairs).sum() == 0
    off = pairs[~np.eye(n, dtype=bool)]
    assert stats.chisquare(off).pvalue > P_MIN


def test_a_large_randperm_is_a_permutation_with_uniform_first_values():
    n = 1 << 20
    g = csprng.create_generator(5)
    firsts = []
    for _ in range(3):
        p = torch.randperm(n, generator=g)
        assert torch.equal(torch.sort(p).values, torch.arange(n))
        firsts.append(p[:4096].numpy())
    # the first 3 * 4096 values, in 16 equal ranges of 0..n-1
    hist = np.bincount(np.concatenate(firsts) * 16 // n, minlength=16)
    assert stats.chisquare(hist).pvalue > P_MIN
