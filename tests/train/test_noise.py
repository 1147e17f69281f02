"""Secure gradient noise: size, reproducibility from ember.csprng, per-rank substreams."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember.csprng import Generator, create_generator
from ember.train import ConfigError, GaussianGradientNoise, TrainConfig, fit


def _zero_grad_param(n: int) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(n))
    p.grad = torch.zeros(n)
    return p


def test_noise_has_the_stated_standard_deviation():
    p = _zero_grad_param(200_000)
    noise = GaussianGradientNoise(0.5, 2.0, create_generator(1))
    noise.add_([p])
    assert noise.std == 1.0
    assert p.grad.mean().item() == pytest.approx(0.0, abs=0.01)
    assert p.grad.std().item() == pytest.approx(1.0, rel=0.01)


def test_noise_is_reproducible_from_the_seed_and_differs_between_substreams():
    def draw(g):
        p = _zero_grad_param(1000)
        GaussianGradientNoise(1.0, 1.0, g).add_([p])
        return p.grad

    assert torch.equal(draw(create_generator(5).fold_in(0)), draw(create_generator(5).fold_in(0)))
    assert not torch.equal(draw(create_generator(5).fold_in(0)), draw(create_generator(5).fold_in(1)))


def test_fit_noise_comes_from_this_ranks_ember_substream():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(3)]
    result = fit(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                 TrainConfig(epochs=1, max_grad_norm=1.0, noise_multiplier=1.0, seed=9,
                             progress=False))
    assert isinstance(result.generator, Generator)
    expected = create_generator(9).fold_in(0)
    torch.randn(10, generator=expected)  # three steps of 10 noise values (4*2 weights + 2 biases)
    torch.randn(10, generator=expected)
    torch.randn(10, generator=expected)
    assert torch.equal(result.generator.get_state(), expected.get_state())


def test_noise_needs_a_clipping_bound():
    with pytest.raises(ConfigError, match="max_grad_norm"):
        TrainConfig(noise_multiplier=1.0).check()
    with pytest.raises(ConfigError, match="noise_multiplier must be > 0"):
        GaussianGradientNoise(0.0, 1.0, create_generator(0))
