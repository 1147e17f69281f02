"""Edge cases from the second review of issue 28: a half-precision EMA updated under
``torch.inference_mode`` keeps working; ``update(step=)`` takes any integer type (timm's
``get_decay`` takes any number). The ``_orig_mod`` child case is in test_wrapper_names.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ember.swa import EMA


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_half_ema_updated_under_inference_mode_keeps_working(dtype):
    model = nn.Linear(8, 8)
    ema = EMA(model, 0.9, warmup=False).to(dtype)
    ref = EMA(model, 0.9, warmup=False).to(dtype)
    with torch.inference_mode():
        ema.update(model)
    with torch.no_grad():
        ref.update(model)
    for i in range(3):
        with torch.no_grad():
            model.weight.add_(0.1 * (i + 1))
        ema.update(model)
        ref.update(model)
    for a, b in zip(ema.module.parameters(), ref.module.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("step", [np.int64(5), np.int32(5), torch.tensor(5), 5], ids=repr)
def test_update_step_takes_any_integer_type(step):
    model = nn.Linear(3, 3)
    a = EMA(model, 0.999, warmup="power")
    b = EMA(model, 0.999, warmup="power")
    with torch.no_grad():
        model.weight.add_(1.0)
    a.update(model, step=step)
    b.update(model, step=5)
    assert a.current_decay(step) == b.current_decay(5) and 0.0 < b.current_decay(5) < 0.999
    assert all(torch.equal(x, y) for x, y in zip(a.module.parameters(), b.module.parameters(), strict=True))


@pytest.mark.parametrize("step", [5.0, True, -1, torch.tensor(5.0), "5"], ids=repr)
def test_update_step_refuses_non_integers(step):
    ema = EMA(nn.Linear(3, 3), 0.999)
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        ema.update(nn.Linear(3, 3), step=step)
