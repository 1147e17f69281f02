"""``EMA(warmup="power")`` is timm's ``ModelEmaV3`` with ``use_warmup=True``, step for step.

The reference below is written from timm's ``ModelEmaV3.get_decay`` (timm/utils/model_ema.py)
and its training loop (timm's train.py increments ``num_updates`` after the optimizer step and then
calls ``model_ema.update(model, step=num_updates)``, so the first update is step 1):

    step = max(0, step - update_after_step - 1)
    if step <= 0: return 0.0
    decay = 1 - (1 + step / warmup_gamma) ** -warmup_power
    return max(min(decay, decay_max), min_decay)

and an update is ``ema.lerp_(model, weight=1 - decay)``; timm's copy is a deep copy made at
construction.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ember.swa import EMA


def timm_get_decay(step: int, decay: float, *, min_decay: float = 0.0,
                   update_after_step: int = 0, warmup_gamma: float = 1.0,
                   warmup_power: float = 2 / 3) -> float:
    step = max(0, step - update_after_step - 1)
    if step <= 0:
        return 0.0
    d = 1 - (1 + step / warmup_gamma) ** -warmup_power
    return max(min(d, decay), min_decay)


CASES = [
    dict(decay=0.9999),
    dict(decay=0.999, warmup_gamma=2.0, warmup_power=0.75),
    dict(decay=0.99, update_after_step=3),
    dict(decay=0.99, min_decay=0.5, update_after_step=5),
    dict(decay=0.9, min_decay=0.3, warmup_power=0.75),
    dict(decay=0.5, min_decay=0.7),  # min_decay above decay: timm's max(min(.), min_decay)
]


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


@pytest.mark.parametrize("kw", CASES)
def test_power_warmup_decay_is_timms_at_every_step(kw):
    ema = EMA(_net(), warmup="power", **kw)
    for step in range(60):
        assert ema.current_decay(step) == timm_get_decay(step, **kw), step
    assert ema.current_decay(10**9) == timm_get_decay(10**9, **kw)
    # timm's loop: step 1 is the first update, a copy (also with min_decay > 0)
    assert ema.current_decay(1) == 0.0
    assert ema.current_decay() == timm_get_decay(1, **kw)  # default: n_updates + 1


def _perturb(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))
        for b in model.buffers():
            if b.is_floating_point():
                b.add_(torch.rand(b.shape, generator=g))


@pytest.mark.parametrize("explicit_step", [True, False])
@pytest.mark.parametrize("kw", CASES)
def test_power_warmup_weights_follow_timms_loop(kw, explicit_step):
    model = _net()
    ours = EMA(model, warmup="power", **kw)
    ref = {k: v.detach().clone() for k, v in copy.deepcopy(model).state_dict().items()}
    num_updates = 0
    for t in range(12):
        _perturb(model, t)  # the optimizer step
        num_updates += 1  # noqa: SIM113 -- timm train.py: incremented after the optimizer step
        d = timm_get_decay(num_updates, **kw)
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                ref[k].lerp_(v, 1.0 - d)
            else:
                ref[k].copy_(v)
        if explicit_step:
            ours.update(model, step=num_updates)
        else:
            ours.update(model)
    for k, v in ours.module.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=1e-6, atol=1e-7, msg=k)


def test_update_after_step_holds_timms_number_of_copies():
    model = _net()
    ema = EMA(model, 0.99, warmup="power", update_after_step=3)
    for step in (1, 2, 3, 4):  # timm: max(0, step - 3 - 1) <= 0: copies
        _perturb(model, step)
        ema.update(model, step=step)
        for a, b in zip(ema.module.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b), step
    _perturb(model, 5)
    ema.update(model, step=5)
    assert not torch.equal(ema.module[0].weight, model[0].weight)
