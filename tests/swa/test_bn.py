"""update_bn: agreement with torch's, batch shapes, custom forward, restoration, limits."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim import swa_utils

from ember.swa import update_bn


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5), nn.BatchNorm1d(5, momentum=0.3),
    )


def _loader(n: int = 5, batch: int = 6, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, 8, 8, generator=g) * 2 + 1 for _ in range(n)]


def _stats(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "batches" in k}


def _assert_same_stats(a: nn.Module, b: nn.Module) -> None:
    sa, sb = _stats(a), _stats(b)
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-6, atol=1e-6, msg=k)


def test_matches_torch_update_bn_on_plain_tensors():
    ours, ref = _model(), _model()
    loader = _loader()
    n = update_bn(loader, ours)
    swa_utils.update_bn(loader, ref)
    assert n == len(loader)
    _assert_same_stats(ours, ref)


def test_matches_torch_on_tuple_and_list_batches():
    loader = _loader()
    labels = [torch.zeros(6, dtype=torch.long) for _ in loader]
    ref = _model()
    swa_utils.update_bn(loader, ref)
    pairs = list(zip(loader, labels, strict=True))
    for batches in ([(x, y) for x, y in pairs], [[x, y] for x, y in pairs]):
        ours = _model()
        update_bn(batches, ours)
        _assert_same_stats(ours, ref)


class _DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _model()

    def forward(self, image, mask):
        return self.inner(image * mask)


def test_dict_batches_are_passed_as_keywords():
    loader = _loader()
    dict_loader = [{"image": x, "mask": torch.ones_like(x)} for x in loader]
    ours = _DictModel()
    update_bn(dict_loader, ours)
    ref = _model()
    swa_utils.update_bn(loader, ref)
    _assert_same_stats(ours.inner, ref)


def test_custom_forward_is_used():
    loader = _loader()
    wrapped = [{"x": x, "unused": "text"} for x in loader]
    calls = []

    def forward(model, batch):
        calls.append(batch["unused"])
        return model(batch["x"])

    ours, ref = _model(), _model()
    update_bn(wrapped, ours, forward=forward)
    swa_utils.update_bn(loader, ref)
    assert calls == ["text"] * len(loader)
    _assert_same_stats(ours, ref)


def test_running_mean_is_exact_average_of_batch_means():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3, momentum=0.1)
    batches = [torch.randn(4, 3) + i for i in range(4)]
    update_bn(batches, bn)
    expected_mean = torch.stack([b.mean(0) for b in batches]).mean(0)
    expected_var = torch.stack([b.var(0, unbiased=True) for b in batches]).mean(0)
    torch.testing.assert_close(bn.running_mean, expected_mean)
    torch.testing.assert_close(bn.running_var, expected_var)
    assert int(bn.num_batches_tracked) == 4


def test_restores_each_module_mode_and_momentum():
    model = _model()
    model.eval()
    model[1].train()  # a mixed state: only the first BatchNorm is in training mode
    update_bn(_loader(), model)
    assert [m.training for m in model] == [False, True, False, False, False, False]
    assert model.training is False
    assert model[1].momentum == 0.1 and model[5].momentum == 0.3


def test_restores_momentum_when_forward_raises():
    model = _model()

    def forward(model, batch):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        update_bn(_loader(), model, forward=forward)
    assert model[5].momentum == 0.3 and model.training is True


def test_max_batches_uses_only_the_first_batches():
    loader = _loader(n=6)
    ours, ref = _model(), _model()
    assert update_bn(loader, ours, max_batches=2) == 2
    swa_utils.update_bn(loader[:2], ref)
    _assert_same_stats(ours, ref)


def test_device_moves_nested_tensors():
    loader = [{"image": x, "mask": torch.ones_like(x)} for x in _loader()]
    ours = _DictModel()
    update_bn(loader, ours, device="cpu")
    ref = _model()
    swa_utils.update_bn(_loader(), ref)
    _assert_same_stats(ours.inner, ref)


def test_model_without_batchnorm_does_not_read_the_loader():
    def loader():
        raise AssertionError("loader was read")
        yield  # pragma: no cover

    assert update_bn(loader(), nn.Linear(2, 2)) == 0


def test_bad_input_errors():
    with pytest.raises(ValueError, match="no batches"):
        update_bn([], _model())
    with pytest.raises(ValueError, match="max_batches"):
        update_bn(_loader(), _model(), max_batches=0)
    with pytest.raises(TypeError, match="forward="):
        update_bn(["not a tensor"], _model())


def test_namedtuple_batches_use_their_first_field():
    from collections import namedtuple

    Batch = namedtuple("Batch", ["x", "y"])
    loader = [Batch(x, torch.zeros(len(x))) for x in _loader()]
    ours, ref = _model(), _model()
    assert update_bn(loader, ours, device="cpu") == len(loader)
    swa_utils.update_bn(_loader(), ref)
    _assert_same_stats(ours, ref)


def test_running_var_is_exact_unbiased_average_of_batch_variances():
    # hand reference: BatchNorm1d keeps the unbiased batch variance; with momentum=None the running
    # value is the plain mean over batches
    loader = [torch.tensor([[0.0], [2.0]]), torch.tensor([[1.0], [1.0], [4.0]])]
    bn = nn.BatchNorm1d(1, momentum=0.1)
    update_bn(loader, bn)
    mean_1, mean_2 = 1.0, 2.0
    var_1 = ((0 - 1) ** 2 + (2 - 1) ** 2) / 1  # 2.0
    var_2 = ((1 - 2) ** 2 + (1 - 2) ** 2 + (4 - 2) ** 2) / 2  # 3.0
    assert bn.running_mean.item() == pytest.approx((mean_1 + mean_2) / 2)
    assert bn.running_var.item() == pytest.approx((var_1 + var_2) / 2)
    assert bn.momentum == 0.1 and bn.num_batches_tracked.item() == 2
