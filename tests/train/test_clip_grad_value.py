"""StepConfig(max_grad_value=): every gradient element clamped before the step, as
torch.nn.utils.clip_grad_value_ in a hand-written loop; and its generated flag."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember.train import ConfigError, LogConfig, StepConfig, TrainConfig, fit


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(10 * torch.randn(24, 4, generator=g),
                                          torch.randint(0, 3, (24,), generator=g))
    return model, torch.optim.SGD(model.parameters(), lr=0.05), \
        torch.utils.data.DataLoader(data, batch_size=6)


def test_fit_clamps_gradients_as_torch_clip_grad_value_does():
    model, opt, loader = _setup()
    fit(model, opt, loader, TrainConfig(2, step=StepConfig(max_grad_value=0.01),
                                        log=LogConfig(progress=False)))
    hand, hand_opt, hand_loader = _setup()
    for _ in range(2):
        for x, y in hand_loader:
            nn.functional.cross_entropy(hand(x).float(), y).backward()
            nn.utils.clip_grad_value_(hand.parameters(), 0.01)
            hand_opt.step()
            hand_opt.zero_grad(set_to_none=True)
    for a, b in zip(model.parameters(), hand.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_bad_value_and_the_flag():
    with pytest.raises(ConfigError, match="max_grad_value must be > 0"):
        TrainConfig(step=StepConfig(max_grad_value=-1.0)).check()
    from ember.train.cli import config_options

    assert "--clip-grad-value" in {o.flag for o in config_options()}


def test_private_training_refuses_it():
    pytest.importorskip("opacus")
    from ember.train import PrivacyConfig

    model, opt, loader = _setup()
    with pytest.raises(ConfigError, match="per example"):
        fit(model, opt, loader, TrainConfig(1, step=StepConfig(max_grad_value=0.1),
                                            log=LogConfig(progress=False)),
            privacy=PrivacyConfig(noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0))
