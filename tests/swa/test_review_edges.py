"""Edge cases from the second review of issue 28: a plain model's own ``_orig_mod`` child is not
a compile wrapper; a half-precision EMA updated under ``torch.inference_mode`` keeps working;
``update(step=)`` takes any integer type. References: torch's ``AveragedModel`` and timm's
``ModelEmaV3.get_decay`` formula (written out in tests/swa/test_timm_warmup.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim import swa_utils

from ember.swa import EMA, SWA, SWAG


class OwnOrigMod(nn.Module):
    """A plain model (nothing compiled) whose first child the user called ``_orig_mod``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self._orig_mod = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)
        self.weight = nn.Parameter(torch.randn(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self._orig_mod(x)) @ self.weight


def _step(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("cls", [SWA, EMA])
def test_a_child_called_orig_mod_is_not_a_compile_wrapper(cls):
    model = OwnOrigMod()
    kw = {} if cls is SWA else {"multi_avg_fn": swa_utils.get_ema_multi_avg_fn(0.9)}
    ours, ref = cls(model, **kw), swa_utils.AveragedModel(model, **kw)
    for i in range(4):
        _step(model, i)
        ours.update_parameters(model)
        ref.update_parameters(model)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    x = torch.randn(5, 3)
    assert torch.equal(ours(x), ref(x))


def test_swag_names_of_a_model_with_its_own_orig_mod_child():
    model = OwnOrigMod()
    swag = SWAG(model, max_rank=2)
    assert swag.names == [n for n, _ in model.named_parameters()]
    swag.collect(model)
    swag.collect(torch.compile(model, backend="eager"))  # a real wrapper around it: same names
    assert swag.n_collected == 2
    target = OwnOrigMod(1)
    swag.sample(scale=0.0, model=target)  # the mean of two equal snapshots: the model
    for (n, p), (_, q) in zip(target.named_parameters(), model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q.detach(), msg=n)


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
        _step(model, i)
        ema.update(model)
        ref.update(model)
    for a, b in zip(ema.module.parameters(), ref.module.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("step", [np.int64(5), np.int32(5), torch.tensor(5), 5], ids=repr)
def test_update_step_takes_any_integer_type(step):
    model = nn.Linear(3, 3)
    a = EMA(model, 0.999, warmup="power")
    b = EMA(model, 0.999, warmup="power")
    _step(model, 0)
    a.update(model, step=step)
    b.update(model, step=5)
    assert a.current_decay(step) == b.current_decay(5) and 0.0 < b.current_decay(5) < 0.999
    assert all(torch.equal(x, y) for x, y in zip(a.module.parameters(), b.module.parameters(), strict=True))


@pytest.mark.parametrize("step", [5.0, True, -1, torch.tensor(5.0), "5"], ids=repr)
def test_update_step_refuses_non_integers(step):
    ema = EMA(nn.Linear(3, 3), 0.999)
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        ema.update(nn.Linear(3, 3), step=step)
