"""ember's SWA/EMA run code written for ``torch.optim.swa_utils.AveragedModel`` unchanged and give
torch's numbers."""

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
    with pytest.raises(RuntimeError, match="n_averaged"):  # torch's missing-key error
        other.load_state_dict({f"module.{k}": v for k, v in legacy["module"].items()})


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
    for k in (1, 10, 10_000_000):  # timm's step k + 1 (its first update is step 1)
        want = min(0.999, 1 - (1 + k / 2.0) ** -0.75)
        assert ema.current_decay(k + 1) == pytest.approx(want)
    assert ema.current_decay(1) == ema.current_decay() == 0.0  # the first update copies
    with pytest.raises(ValueError, match="warmup_gamma"):
        EMA(model, warmup="power", warmup_gamma=0.0)
    with pytest.raises(ValueError, match="warmup"):
        EMA(model, warmup="linear")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_copy_keeps_moving(dtype):
    # a float16 average without a float32 master with decay 0.9999 rounded every update back to itself
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


def _step(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("cls", [swa_utils.AveragedModel, SWA, EMA])
def test_count_survives_a_load_through_a_parent_module(cls):
    # a checkpoint of a parent (ModuleDict, Lightning module) restores n_averaged; the count
    # ember's updates use must follow it, or the average would restart
    model = _net()
    holder = nn.ModuleDict({"avg": cls(model)})
    for t in range(10):
        _step(model, t)
        holder["avg"].update_parameters(model)
    ckpt = holder.state_dict()
    other = _net(3)
    restored = nn.ModuleDict({"avg": cls(other)})
    restored.load_state_dict(ckpt)
    if cls is EMA:
        assert restored["avg"].n_updates == 10
        assert restored["avg"].current_decay() == holder["avg"].current_decay()
    _step(model, 99)
    holder["avg"].update_parameters(model)
    restored["avg"].update_parameters(model)
    assert int(restored["avg"].n_averaged) == 11
    for k, v in holder.state_dict().items():
        assert torch.equal(restored.state_dict()[k], v), k


@pytest.mark.parametrize("cls", [swa_utils.AveragedModel, SWA])
def test_zeroing_n_averaged_restarts_the_average(cls):
    model = _net()
    avg = cls(model)
    for t in range(5):
        _step(model, t)
        avg.update_parameters(model)
    avg.n_averaged.zero_()
    _step(model, 42)
    avg.update_parameters(model)
    for a, b in zip(avg.module.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert int(avg.n_averaged) == 1


@pytest.mark.parametrize("cls", [swa_utils.AveragedModel, SWA, EMA])
def test_averaged_copy_can_be_fine_tuned(cls):
    model = _net()
    avg = cls(model)
    avg.update_parameters(model)
    assert all(p.requires_grad for p in avg.parameters())
    opt = torch.optim.SGD(avg.parameters(), lr=0.1)
    before = [p.detach().clone() for p in avg.parameters()]
    avg.train()
    avg(torch.randn(8, 3)).pow(2).mean().backward()
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, avg.parameters(), strict=True))
    _step(model, 1)
    avg.update_parameters(model)  # updates do not record autograd history
    assert all(p.grad_fn is None for p in avg.parameters())


def test_non_strict_load_reports_missing_n_averaged_like_torch():
    sd = {"module.weight": torch.zeros(3, 3), "module.bias": torch.zeros(3)}
    ref = swa_utils.AveragedModel(nn.Linear(3, 3)).load_state_dict(sd, strict=False)
    ours = SWA(nn.Linear(3, 3)).load_state_dict(sd, strict=False)
    assert ours.missing_keys == ref.missing_keys == ["n_averaged"]
    assert ours.unexpected_keys == ref.unexpected_keys == []


@pytest.mark.parametrize("wrap", ["compile", "data_parallel", "data_parallel_compile"])
def test_wrapped_model_state_dict_has_torchs_layout(wrap):
    # torch deep-copies the wrapper: keys module._orig_mod.*, module.module.*
    def make(seed):
        m = nn.Sequential(nn.Linear(4, 3))
        torch.manual_seed(seed)
        nn.init.normal_(m[0].weight)
        if wrap == "compile":
            return torch.compile(m)
        if wrap == "data_parallel":
            return nn.DataParallel(m)
        return torch.compile(nn.DataParallel(m))
    model = make(0)
    ref = swa_utils.AveragedModel(model)
    ours = SWA(model)
    _step(model, 1)
    ref.update_parameters(model)
    ours.update_parameters(model)
    assert list(ours.state_dict()) == list(ref.state_dict())
    back = swa_utils.AveragedModel(make(5))
    back.load_state_dict(ours.state_dict(), strict=True)
    there = SWA(make(6))
    there.load_state_dict(ref.state_dict(), strict=True)
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
        assert torch.equal(there.state_dict()[k], v), k
    # ember's extra: the plain layout (and a plain model's copy) still loads
    plain = SWA(nn.Sequential(nn.Linear(4, 3)))
    plain.update_parameters(model)
    there.load_state_dict(plain.state_dict(), strict=True)
    ours.load_state_dict(plain.state_dict(), strict=True)
    for a, b in zip(there.module.parameters(), plain.module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert list(ours.module.state_dict()) == ["0.weight", "0.bias"]  # loads into a plain model


@pytest.mark.parametrize("use_buffers", [False, True])
def test_default_swa_is_bit_identical_to_torch_over_50_updates(use_buffers):
    def run(make):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                              nn.Linear(8 * 6 * 6, 10))
        avg = make(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(2)
        for _ in range(50):
            x = torch.randn(16, 3, 8, 8, generator=g)
            y = torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            avg.update_parameters(model)
        return avg, model
    ref, _ = run(lambda m: swa_utils.AveragedModel(m, use_buffers=use_buffers))
    ours, model = run(lambda m: SWA(m, use_buffers=use_buffers))
    mine = ours.state_dict()
    for k, v in ref.state_dict().items():
        if k.endswith("num_batches_tracked"):  # copied, not blended (a documented difference)
            assert torch.equal(mine[k], model.state_dict()[k[len("module."):]])
            continue
        assert torch.equal(mine[k], v), k


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("use_buffers", [False, True])
def test_default_swa_is_bit_identical_to_torch_on_cuda(use_buffers):
    # on CUDA torch takes its foreach-lerp path; ember must take the same one
    def run(make):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(),
                              nn.Linear(64, 10)).cuda()
        avg = make(model)
        g = torch.Generator(device="cuda").manual_seed(2)
        for _ in range(50):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, device="cuda", generator=g))
            model(torch.randn(16, 32, device="cuda", generator=g))  # moves the BN statistics
            avg.update_parameters(model)
        return avg
    ref = run(lambda m: swa_utils.AveragedModel(m, use_buffers=use_buffers))
    ours = run(lambda m: SWA(m, use_buffers=use_buffers))
    mine = ours.state_dict()
    for k, v in ref.state_dict().items():
        if not k.endswith("num_batches_tracked"):
            assert torch.equal(mine[k], v), k


def test_foreach_swa_is_torchs_foreach_path():
    # the kernel torch uses on CUDA, checked on CPU: foreach=True is get_swa_multi_avg_fn's lerp
    def run(make):
        model = _net()
        avg = make(model)
        for t in range(20):
            _step(model, t)
            avg.update_parameters(model)
        return avg
    ref = run(lambda m: swa_utils.AveragedModel(m, multi_avg_fn=swa_utils.get_swa_multi_avg_fn()))
    ours = run(lambda m: SWA(m, foreach=True))
    plain = run(lambda m: swa_utils.AveragedModel(m))
    mine = ours.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(mine[k], v), k
    # and the two kernels do differ in the last bits, so the default's equality is not vacuous
    assert any(not torch.equal(mine[k], v) for k, v in plain.state_dict().items())
