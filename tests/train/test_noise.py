"""The retired home-made gradient noise: every way in gives an error pointing to privacy=."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember.train import ConfigError, GaussianGradientNoise, TrainConfig, fit


def test_gaussian_gradient_noise_is_removed_with_a_migration_error():
    with pytest.raises(ConfigError, match=r"not differential privacy.*privacy=PrivacyConfig"):
        GaussianGradientNoise(1.0, 1.0, None)


def test_train_config_noise_multiplier_points_to_privacy():
    with pytest.raises(ConfigError, match=r"noise_multiplier was removed.*privacy=PrivacyConfig"):
        TrainConfig(noise_multiplier=1.0, max_grad_norm=1.0).check()


def test_fit_with_noise_multiplier_refuses_before_training():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    before = model.weight.detach().clone()
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
    with pytest.raises(ConfigError, match="noise_multiplier was removed"):
        fit(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
            TrainConfig(epochs=1, max_grad_norm=1.0, noise_multiplier=1.0, progress=False))
    assert torch.equal(model.weight, before)
