"""SWAP's phase-2 learning-rate schedule and fresh optimizer, and phase 1's stop at a training
accuracy; one process: these parts need no process group."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ember.train import TrainConfig
from ember.train.recipes import swap as swap_recipe
from ember.train.recipes.swap import refine_locally


def _data(n: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return [(x[i:i + 16], y[i:i + 16]) for i in range(0, n, 16)]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
def test_phase2_rate_follows_the_schedule_per_step(schedule):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    loader = _data()
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))
    refine_locally(model, opt, loader, epochs=2, lr=0.1, schedule=schedule)
    total = 2 * len(loader)
    want = {"linear": [0.1 * (1 - s / total) for s in range(total)],
            "cosine": [0.1 * (1 + math.cos(math.pi * s / total)) / 2 for s in range(total)],
            "constant": [0.1] * total}[schedule]
    assert seen == pytest.approx(want)


def test_phase2_starts_with_a_fresh_optimizer_state():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = _data()
    for x, y in loader:  # phase 1 leaves momentum behind
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    first = {}

    def grab(o, a, k):
        if not first:
            first.update({id(p): o.state[p].get("momentum_buffer") for p in model.parameters()})
    opt.register_step_pre_hook(grab)
    refine_locally(model, opt, loader, epochs=1, fresh_optimizer=True)
    assert all(v is None for v in first.values())  # no momentum carried over from phase 1


def test_phase1_stops_at_the_training_accuracy_threshold():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    loader = _data(192)
    accs = []
    result, epochs = swap_recipe._phase1(model, opt, loader, TrainConfig(epochs=30, progress=False),
                                         target_accuracy=0.9, on_epoch=accs.append)
    assert epochs == len(accs) < 30
    assert accs[-1] >= 0.9 and all(a < 0.9 for a in accs[:-1])
    assert result.steps == epochs * len(loader)
