"""``.half()`` then ``.float()`` on an averager: the float32 masters of the half-precision phase are
dropped (no memory held for them) and never consulted again; the average then continues exactly as
an fp32 one (torch's ``AveragedModel`` loaded with the same state) does."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim import swa_utils

from ember.swa import EMA, SWA


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))  # 1.05M: 4 MiB


def _perturb(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))


def _held_bytes(obj, seen: set | None = None) -> int:
    """Bytes of every tensor storage reachable from ``obj``'s attributes (modules, dicts,
    tuples, lists), each storage counted once."""
    seen = set() if seen is None else seen
    total = 0
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        for v in obj.values():
            total += _held_bytes(v, seen)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            total += _held_bytes(v, seen)
    elif isinstance(obj, nn.Module):
        for v in vars(obj).values():
            total += _held_bytes(v, seen)
    return total


def _make(cls, model):
    if cls is EMA:
        ours = EMA(model, 0.99, warmup=False)
        ref = swa_utils.AveragedModel(model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.99))
    else:
        ours, ref = SWA(model), swa_utils.AveragedModel(model)
    return ours, ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls", [EMA, SWA])
def test_back_to_float32_drops_the_masters_and_averages_like_torch(cls, dtype):
    model = _net()
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    avg, ref = _make(cls, model)
    avg.to(dtype)
    for t in range(3):
        _perturb(model, t)
        avg.update_parameters(model)
    avg.float()
    held = _held_bytes(avg)
    assert held <= fp32_bytes + 1024, f"{held / 2**20:.2f} MiB held for a {fp32_bytes / 2**20:.2f} MiB copy"
    ref.load_state_dict(avg.state_dict())  # torch's average from the same (rounded) state
    for t in range(3, 6):
        _perturb(model, t)
        avg.update_parameters(model)
        ref.update_parameters(model)
    for a, b in zip(avg.module.parameters(), ref.module.parameters(), strict=True):
        assert a.dtype == torch.float32
        assert torch.equal(a, b)
    assert _held_bytes(avg) <= fp32_bytes + 1024


@pytest.mark.parametrize("cls", [EMA, SWA])
def test_converting_the_copy_itself_frees_the_masters_at_the_next_update(cls):
    model = _net()
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    avg, _ = _make(cls, model)
    avg.module.half()
    _perturb(model, 0)
    avg.update_parameters(model)
    avg.module.float()  # not through the averager: seen at the next update
    _perturb(model, 1)
    avg.update_parameters(model)
    assert _held_bytes(avg) <= fp32_bytes + 1024


def test_half_again_starts_fresh_masters():
    model = _net()
    avg = EMA(model, 0.99, warmup=False)
    avg.half()
    for t in range(3):
        _perturb(model, t)
        avg.update_parameters(model)
    avg.float()
    for t in range(3, 5):
        _perturb(model, t)
        avg.update_parameters(model)
    avg.half()
    fresh = EMA(_net(1), 0.99, warmup=False).half()  # a half averager holding the same state
    fresh.load_state_dict(avg.state_dict())
    for t in range(5, 8):
        _perturb(model, t)
        avg.update_parameters(model)
        fresh.update_parameters(model)
    for a, b in zip(avg.module.parameters(), fresh.module.parameters(), strict=True):
        assert torch.equal(a, b)
