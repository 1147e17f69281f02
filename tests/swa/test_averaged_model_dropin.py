"""ember's SWA/EMA run code written for ``torch.optim.swa_utils.AveragedModel`` unchanged and give
torch's numbers (issue 28, item 8)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim import swa_utils

from ember.swa import EMA, SWA, update_bn


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _loader(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 3, generator=g), torch.randint(0, 2, (16,), generator=g))
            for _ in range(n)]


def _train_with(make_avg, epochs: int = 4):
    """torch's documented AveragedModel loop, with ``make_avg`` building the averager."""
    model = _net()
    loader = _loader()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    swa_model = make_avg(model)
    scheduler = swa_utils.SWALR(optimizer, swa_lr=0.05, anneal_epochs=1)
    for _epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        swa_model.update_parameters(model)
        scheduler.step()
    update_bn(loader, swa_model)  # ember's, positional like torch's
    swa_utils.update_bn(loader, swa_model)  # torch's on ember's averager
    swa_model.eval()
    return swa_model, loader


@pytest.mark.parametrize("kwargs", [
    {},
    {"use_buffers": True},
    {"multi_avg_fn": swa_utils.get_ema_multi_avg_fn(0.9)},
    {"avg_fn": swa_utils.get_ema_avg_fn(0.9)},
    {"avg_fn": swa_utils.get_swa_avg_fn()},
])
def test_averaged_model_loop_matches_torch(kwargs):
    ours, loader = _train_with(lambda m: SWA(m, **kwargs))
    ref, _ = _train_with(lambda m: swa_utils.AveragedModel(m, **kwargs))
    assert isinstance(ours, nn.Module)
    assert int(ours.n_averaged) == int(ref.n_averaged) == 4
    assert ours.n_updates == 4  # the older name
    x = loader[0][0]
    torch.testing.assert_close(ours(x), ref(x))
    mine, theirs = ours.state_dict(), ref.state_dict()
    assert list(mine) == list(theirs)  # n_averaged, module.*: torch's layout
    for k in theirs:
        if k.endswith("num_batches_tracked"):
            continue  # update_bn reset and recounted both
        torch.testing.assert_close(mine[k], theirs[k], msg=k)


def test_state_dict_round_trips_with_torch_averaged_model():
    model = _net()
    ref = swa_utils.AveragedModel(model)
    for t in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * (t + 1))
        ref.update_parameters(model)
    ours = SWA(_net(5))
    ours.load_state_dict(ref.state_dict())
    assert ours.n_updates == 3 and int(ours.n_averaged) == 3
    for (k, a), b in zip(ours.module.state_dict().items(), ref.module.state_dict().values(),
                         strict=True):
        torch.testing.assert_close(a, b, msg=k)
    # and back: ember's state dict loads into torch's AveragedModel
    back = swa_utils.AveragedModel(_net(7))
    back.load_state_dict(ours.state_dict())
    assert int(back.n_averaged) == 3
    # both continue identically
    ref.update_parameters(model)
    ours.update_parameters(model)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_older_state_dict_layout_still_loads():
    model = _net()
    swa = SWA(model)
    swa.update(model)
    legacy = {"n_updates": 1, "module": swa.module.state_dict()}
    other = SWA(_net(3))
    other.load_state_dict(legacy)
    assert other.n_updates == 1
    with pytest.raises(KeyError, match="n_averaged"):
        other.load_state_dict({"module": legacy["module"]})


def test_update_bn_takes_device_positionally():
    model = _net()
    loader = _loader()
    ours = _net()
    ours.load_state_dict(model.state_dict())
    swa_utils.update_bn(loader, model, torch.device("cpu"))
    update_bn(loader, ours, "cpu")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k], v, msg=k)


def test_averagers_are_modules_that_move_and_switch_mode():
    model = _net()
    for avg in (SWA(model), EMA(model)):
        avg.to(torch.float64)
        assert avg.module[0].weight.dtype == torch.float64
        avg.eval()
        assert not avg.module.training
        avg.train()
        assert avg.module.training


def test_ema_copy_starts_in_eval_mode():
    model = _net()
    model.train()
    ema = EMA(model)
    assert model.training and not ema.module.training


def test_ema_power_warmup_matches_timm_formula():
    model = _net()
    ema = EMA(model, decay=0.999, warmup="power", warmup_gamma=2.0, warmup_power=0.75)
    for step in (0, 1, 10, 10_000_000):
        want = min(0.999, 1 - (1 + step / 2.0) ** -0.75)
        assert ema.current_decay(step) == pytest.approx(want)
    assert ema.current_decay(0) == 0.0  # the first update copies
    with pytest.raises(ValueError, match="warmup_gamma"):
        EMA(model, warmup="power", warmup_gamma=0.0)
    with pytest.raises(ValueError, match="warmup"):
        EMA(model, warmup="linear")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_copy_keeps_moving(dtype):
    # issue 28, item 6: a float16 average with decay 0.9999 rounded every update back to itself
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    ema = EMA(model, decay=0.9999, warmup=False)
    ema.module.to(dtype)
    ref = EMA(model, decay=0.9999, warmup=False)  # float32 reference
    start = ema.module.weight.detach().float().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    for _ in range(200):
        ema.update(model)
        ref.update(model)
    moved = (ema.module.weight.float() - start).mean().item()
    want = (ref.module.weight - start).mean().item()  # 1 - 0.9999^200 = 0.0198
    assert ema.module.weight.dtype == dtype
    assert moved == pytest.approx(want, rel=0.05)
