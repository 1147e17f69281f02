"""A half-precision EMA whose first update ran under ``torch.inference_mode`` keeps a normal float32
master: later updates work and give the same weights as an EMA updated under ``no_grad``."""

from __future__ import annotations

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
