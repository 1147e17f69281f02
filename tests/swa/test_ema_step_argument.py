"""``EMA.update(model, step=)`` takes any integer type (NumPy integers, 0-dim integer tensors, as
timm's ``get_decay`` takes any number) and refuses non-integers and negative steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ember.swa import EMA


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
