"""SWA, EMA and SWAG share one averager protocol: ``update(model, step=)``, ``state_dict()``,
``load_state_dict()`` (what ember.train's averaging component relies on)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember.swa import EMA, SWA, SWAG


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _flat(state: dict) -> list[torch.Tensor]:
    out = []
    for v in state.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            out.extend(_flat(v))
    return out


@pytest.mark.parametrize("make", [lambda m: SWA(m), lambda m: EMA(m, 0.9),
                                  lambda m: SWAG(m, max_rank=2)], ids=["swa", "ema", "swag"])
def test_update_with_step_and_a_state_dict_round_trip(make):
    model = _model(0)
    averager, twin = make(model), make(_model(1))
    for step in range(1, 5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * step)
        averager.update(model, step=step)
    twin.load_state_dict(averager.state_dict())
    mine, theirs = _flat(averager.state_dict()), _flat(twin.state_dict())
    assert len(mine) == len(theirs) > 0
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_swag_update_is_collect():
    model = _model(0)
    a, b = SWAG(model, max_rank=2), SWAG(model, max_rank=2)
    for k in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.1 + k)
        a.update(model, step=k + 1)
        b.collect(model)
    assert a.n_collected == b.n_collected == 3
    assert all(torch.equal(x, y) for x, y in zip(_flat(a.state_dict()), _flat(b.state_dict()),
                                                 strict=True))
