"""EMA/SWA/SWAG on realistic models: moved copies, DDP/DataParallel and torch.compile prefixes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember.swa import EMA, SWA, SWAG, expected_calibration_error, nll


class Block(nn.Module):
    """A small ResNet-style block: conv-BN-ReLU-conv-BN plus the identity."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.block = Block(4)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 6 * 6, 8), nn.BatchNorm1d(8),
                                  nn.Dropout(0.3), nn.Linear(8, 3))
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim parameter
        self.register_buffer("offset", torch.tensor(0.25))  # 0-dim float buffer

    def forward(self, x):
        return self.head(self.block(self.stem(x))) * self.scale + self.offset


def _train_a_bit(model: nn.Module, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for _ in range(steps):
        x = torch.randn(8, 1, 6, 6)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        model.offset.add_(0.5)


def _state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("cls", [EMA, SWA])
def test_copy_moved_to_float64_keeps_following_the_model(cls):
    torch.manual_seed(0)
    model = Net()
    avg = cls(model, decay=0.0, warmup=False) if cls is EMA else cls(model, use_buffers=True)
    avg.module.to(torch.float64)  # replaces every tensor of the copy
    _train_a_bit(model)
    if cls is SWA:
        avg.n_updates = 0  # the next update copies the weights (weight 1)
    avg.update(model)
    got = avg.module.state_dict()
    for name, want in model.state_dict().items():
        assert got[name].dtype == (torch.float64 if want.is_floating_point() else want.dtype)
        torch.testing.assert_close(got[name], want.to(got[name].dtype), rtol=0, atol=1e-6,
                                   msg=name)
    # running statistics moved with the rest (the old bug left them at their initial values)
    assert not torch.equal(got["block.bn1.running_mean"], torch.zeros(4, dtype=torch.float64))


def test_copy_moved_with_half_is_averaged_in_half():
    torch.manual_seed(0)
    model = Net()
    ema = EMA(model, decay=0.5, warmup=False)
    ema.module.half()
    before = _state(ema.module)
    _train_a_bit(model)
    ema.update(model)
    w = ema.module.head[1].weight
    assert w.dtype == torch.float16
    want = before["head.1.weight"].float().lerp(model.head[1].weight.detach(), 0.5)
    torch.testing.assert_close(w.float(), want, rtol=0, atol=2e-3)


def _wrappers():
    return {
        "dataparallel": lambda m: nn.DataParallel(m),
        "compiled": lambda m: torch.compile(m),
        "dp_of_compiled": lambda m: nn.DataParallel(torch.compile(m)),
        "compiled_dp": lambda m: torch.compile(nn.DataParallel(m)),
    }


@pytest.mark.parametrize("wrap_source", list(_wrappers()))
@pytest.mark.parametrize("wrap_base", [None, "dataparallel"])
def test_wrapped_models_match_by_name(wrap_source, wrap_base):
    torch.manual_seed(0)
    model = Net()
    base = Net() if wrap_base is None else _wrappers()[wrap_base](Net())
    source = _wrappers()[wrap_source](model)
    ema = EMA(base, decay=0.0, warmup=False)
    swa = SWA(base, use_buffers=True)
    swag = SWAG(base, max_rank=2)
    _train_a_bit(model)
    ema.update(source)
    swa.update(source)
    swag.collect(source)
    for avg in (ema, swa):
        got = avg.module.state_dict()
        names = {k.replace("module.", "", 1) if k.startswith("module.") else k for k in got}
        assert names == set(model.state_dict())
        for k, v in got.items():
            key = k[len("module."):] if k.startswith("module.") else k
            torch.testing.assert_close(v, model.state_dict()[key], rtol=0, atol=0, msg=k)
    assert swag.n_collected == 1


def test_deep_copy_of_a_wrapped_model_is_the_inner_module():
    model = Net()
    ema = EMA(nn.DataParallel(torch.compile(model)))
    assert isinstance(ema.module, Net)
    assert set(ema.module.state_dict()) == set(model.state_dict())


def test_averaged_state_dict_loads_straight_into_a_model():
    torch.manual_seed(0)
    model = Net()
    ema = EMA(model, decay=0.9)
    _train_a_bit(model)
    ema.update(model)
    fresh = Net()
    fresh.load_state_dict(ema.module.state_dict())
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, ema.module.state_dict()[k])


def _tied_rows():
    # 10 rows, 5 equal-mass bins of 2: confidence 0.9 is shared by rows 3..6, across a bin edge
    conf = torch.tensor([0.5, 0.6, 0.7, 0.9, 0.9, 0.9, 0.9, 0.95, 0.97, 0.99],
                        dtype=torch.float64)
    correct = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1, 1, 1])
    probs = torch.stack([conf, 1 - conf], dim=1)
    labels = torch.where(correct.bool(), 0, 1)
    return probs, labels


def test_equal_mass_ece_does_not_depend_on_row_order():
    probs, labels = _tied_rows()
    values = set()
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        perm = torch.randperm(len(labels), generator=g)
        values.add(round(expected_calibration_error(probs[perm], labels[perm], n_bins=5), 12))
    assert len(values) == 1
    # documented rule: among equal confidences incorrect rows come first; hand count of the bins
    # [0.5 c, 0.6 x] [0.7 c, 0.9 x] [0.9 x, 0.9 c] [0.9 c, 0.95 c] [0.97 c, 0.99 c]
    want = (abs(0.5 - 0.55) + abs(0.5 - 0.8) + abs(0.5 - 0.9) + abs(1 - 0.925) + abs(1 - 0.98)) / 5
    assert values.pop() == pytest.approx(want, abs=1e-12)


def test_metrics_refuse_logits_and_unnormalised_rows():
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.1, 3.0, -2.0]])
    labels = torch.tensor([0, 1])
    for bad in (logits, logits.abs()):
        with pytest.raises(ValueError, match=r"pass probabilities, e\.g\. softmax\(logits\)"):
            nll(bad, labels)
        with pytest.raises(ValueError, match="softmax"):
            expected_calibration_error(bad, labels)
    # float32 softmax rows pass
    assert nll(torch.softmax(logits, dim=1), labels) > 0


def test_ema_step_min_decay_and_update_after_step():
    torch.manual_seed(0)
    model = Net()
    ema = EMA(model, decay=0.99, min_decay=0.5, update_after_step=3)
    # steps count from 1 (timm's loop); the schedule runs on k = step - 1 - update_after_step
    assert ema.current_decay(3) == 0.0  # up to update_after_step: a copy
    assert ema.current_decay(4) == 0.5  # k=0: warm-up (1+0)/(10+0)=0.1 is raised to min_decay
    assert ema.current_decay(4 + 90) == pytest.approx(91 / 100)  # warm-up (1+k)/(10+k), k=90
    assert ema.current_decay(4 + 10**6) == 0.99  # capped at decay
    before = ema.module.head[1].weight.detach().clone()
    _train_a_bit(model)
    ema.update(model, step=1)
    assert torch.equal(ema.module.head[1].weight, model.head[1].weight)
    assert not torch.equal(before, model.head[1].weight)
    with pytest.raises(ValueError, match="step"):
        ema.update(model, step=-1)


def test_swapped_into_evaluates_the_average_and_restores_exactly():
    torch.manual_seed(0)
    model = Net()
    ema = EMA(model, decay=0.5, warmup=False)
    _train_a_bit(model)
    ema.update(model)
    own = _state(model)
    avg = _state(ema.module)
    x = torch.randn(4, 1, 6, 6)
    model.eval()
    ema.module.eval()
    with ema.swapped_into(model) as m:
        assert m is model
        for k, v in model.state_dict().items():
            assert torch.equal(v, avg[k]), k
        assert torch.equal(model(x), ema.module(x))
    for k, v in model.state_dict().items():
        assert torch.equal(v, own[k]), k
    with pytest.raises(RuntimeError), ema.swapped_into(model):
        raise RuntimeError("boom")
    for k, v in model.state_dict().items():
        assert torch.equal(v, own[k]), k
