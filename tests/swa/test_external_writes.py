"""The averager's tensors are the truth, also after writes that bypass autograd's version counter.

``.data`` writes, ``dist.broadcast`` over gloo and numpy views write into a tensor without bumping
its version. torch's ``AveragedModel`` reads ``n_averaged`` and the copy's tensors on every update,
so such a write counts there; it must count here too: for the update count and for the float32
master copies behind a float16/bfloat16 copy.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim import swa_utils

from ember.swa import EMA, SWA


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))


def _step(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("write", ["data", "numpy"])
@pytest.mark.parametrize("kind", ["swa", "ema_avg_fn"])
def test_zeroing_n_averaged_without_a_version_bump_restarts_like_torch(kind, write):
    model = _net()
    if kind == "swa":
        ours, ref = SWA(model), swa_utils.AveragedModel(model)
    else:
        fn = swa_utils.get_ema_multi_avg_fn(0.9)
        ours, ref = EMA(model, multi_avg_fn=fn), swa_utils.AveragedModel(model, multi_avg_fn=fn)
    for t in range(3):
        _step(model, t)
        ours.update_parameters(model)
        ref.update_parameters(model)
    for avg in (ours, ref):
        if write == "data":
            avg.n_averaged.data.zero_()
        else:
            avg.n_averaged.numpy()[...] = 0
    assert ours.n_updates == 0
    _step(model, 10)
    ours.update_parameters(model)
    ref.update_parameters(model)  # torch: n_averaged == 0, so this update copies the model
    assert int(ours.n_averaged) == int(ref.n_averaged) == 1
    for a, b, m in zip(ours.module.parameters(), ref.module.parameters(), model.parameters(),
                       strict=True):
        assert torch.equal(b, m)
        assert torch.equal(a, b)


def test_n_averaged_data_write_sets_the_ema_schedule():
    model = _net()
    ema = EMA(model, 0.999, warmup="power")
    for t in range(5):
        _step(model, t)
        ema.update(model)
    ema.n_averaged.data.fill_(1000)
    assert ema.n_updates == 1000
    fresh = EMA(model, 0.999, warmup="power")
    fresh.n_averaged.fill_(1000)
    assert ema.current_decay() == fresh.current_decay()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("write", ["data", "numpy_view"])
def test_half_copy_written_behind_the_version_counter_is_the_truth(dtype, write):
    model = _net()
    ema = EMA(model, 0.99, warmup=False)
    ema.module.to(dtype)
    for t in range(5):  # the float32 masters now hold bits below the copy's rounding
        _step(model, t)
        ema.update(model)
    g = torch.Generator().manual_seed(42)
    new = {n: torch.randn(p.shape, generator=g).to(dtype) for n, p in ema.module.named_parameters()}
    for n, p in ema.module.named_parameters():
        if write == "data":
            p.data.copy_(new[n])
        else:  # what a gloo broadcast does: the bytes change, the version does not
            p.detach().view(torch.int16).numpy()[...] = new[n].view(torch.int16).numpy()
    for n, p in ema.module.named_parameters():
        assert torch.equal(p, new[n])
    # a fresh average from that state: a half copy holding exactly those weights
    fresh = EMA(model, 0.99, warmup=False)
    fresh.module.to(dtype)
    fresh.module.load_state_dict(new, strict=False)
    fresh.n_averaged.fill_(int(ema.n_averaged))
    _step(model, 99)
    ema.update(model)
    fresh.update(model)
    for (n, a), b, m in zip(ema.module.named_parameters(), fresh.module.parameters(),
                            model.parameters(), strict=True):
        want = new[n].float().lerp(m.detach(), 0.01).to(dtype)  # 0.99 * written + 0.01 * model
        assert torch.equal(b, want), n
        assert torch.equal(a, b), n


def _broadcast_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = _net()
        _step(model, 100 + rank)  # each rank its own weights
        ema = EMA(model, 0.999, warmup=False)
        ema.module.to(torch.bfloat16)
        for t in range(20):
            _step(model, 10 * t + rank)
            ema.update(model)
        for p in ema.module.parameters():  # sync the average from rank 0
            dist.broadcast(p.data, src=0)
        synced = [p.detach().clone() for p in ema.module.parameters()]
        same = _net(7)  # then both ranks fold in the same weights
        for _ in range(3):
            ema.update(same)
        torch.save({"synced": synced, "after": [p.detach().clone() for p in ema.module.parameters()]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available()
                    or sys.platform == "win32", reason="needs torch.distributed with gloo")
def test_broadcast_bf16_ema_stays_in_sync(tmp_path):
    import torch.multiprocessing as mp

    init_file = str(tmp_path / "init").replace("\\", "/")
    mp.spawn(_broadcast_worker, args=(init_file, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for a, b in zip(r0["synced"], r1["synced"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(r0["after"], r1["after"], strict=True):
        # the masters may keep different bits below bfloat16's rounding (each rank's own, where
        # the broadcast left the value as it was): at most one unit in the last place apart
        ulp = torch.finfo(torch.bfloat16).eps * a.float().abs().clamp_min(1e-30)
        assert ((a.float() - b.float()).abs() <= ulp).all()
