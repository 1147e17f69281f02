"""EMA and SWA: hand-computed updates, buffers, user-provided copies, compiled-model names."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim import swa_utils

from ember.swa import EMA, SWA, ema_decay


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _perturb(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))
        model[1].running_mean.add_(float(step))
        model[1].num_batches_tracked.add_(7)


def _weights(model: nn.Module) -> np.ndarray:
    flat = [p.detach().numpy().ravel().astype(np.float64) for p in model.parameters()]
    return np.concatenate(flat)


def test_warmup_schedule_values():
    assert ema_decay(0, 0.999) == pytest.approx(1 / 10)
    assert ema_decay(1, 0.999) == pytest.approx(2 / 11)
    assert ema_decay(10_000, 0.999) == 0.999
    assert ema_decay(5, 0.3) == 0.3  # capped by decay
    assert ema_decay(0, 0.999, warmup=False) == 0.999


@pytest.mark.parametrize("warmup", [True, False])
@pytest.mark.parametrize("foreach", [True, False])
def test_ema_matches_hand_computed_average(warmup, foreach):
    model = _net()
    ema = EMA(model, decay=0.9, warmup=warmup, foreach=foreach)
    expected = _weights(model)
    for t in range(5):
        _perturb(model, t)
        d = min(0.9, (1 + t) / (10 + t)) if warmup else 0.9
        expected = d * expected + (1 - d) * _weights(model)
        ema.update(model)
    np.testing.assert_allclose(_weights(ema.module), expected, rtol=1e-5, atol=1e-6)
    assert ema.n_updates == 5


def test_ema_without_warmup_matches_torch_averaged_model():
    model = _net()
    ref = swa_utils.AveragedModel(
        model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.8), use_buffers=True
    )
    ref.update_parameters(model)  # torch copies on its first update; ember copies at construction
    ema = EMA(model, decay=0.8, warmup=False, use_buffers=True)
    for t in range(4):
        _perturb(model, t)
        ref.update_parameters(model)
        ema.update(model)
    for (k, a), b in zip(
        ema.module.state_dict().items(), ref.module.state_dict().values(), strict=True
    ):
        if k.endswith("num_batches_tracked"):
            # torch blends integer buffers too (and truncates); ember copies them
            assert int(a) == int(model[1].num_batches_tracked) == 28
            assert int(b) != int(a)
            continue
        torch.testing.assert_close(a, b, msg=k)


def test_ema_copies_integer_buffers_and_averages_float_buffers():
    model = _net()
    ema = EMA(model, decay=0.5, warmup=False)
    mean0 = model[1].running_mean.clone()
    _perturb(model, 3)
    ema.update(model)
    assert ema.module[1].num_batches_tracked.dtype == torch.long
    assert int(ema.module[1].num_batches_tracked) == int(model[1].num_batches_tracked) == 7
    torch.testing.assert_close(ema.module[1].running_mean, 0.5 * mean0 + 0.5 * (mean0 + 3.0))


def test_ema_use_buffers_false_copies_float_buffers():
    model = _net()
    ema = EMA(model, decay=0.5, warmup=False, use_buffers=False)
    _perturb(model, 3)
    ema.update(model)
    torch.testing.assert_close(ema.module[1].running_mean, model[1].running_mean)


def test_callable_decay_gets_the_update_index():
    model = _net()
    seen = []

    def decay(step):
        seen.append(step)
        return 0.0  # decay 0: the average becomes the current weights

    ema = EMA(model, decay=decay)
    for t in range(3):
        _perturb(model, t)
        ema.update(model)
    assert seen == [0, 1, 2]
    np.testing.assert_array_equal(_weights(ema.module), _weights(model))


def test_swa_is_equal_weight_mean_and_matches_torch():
    model = _net()
    swa = SWA(model)
    ref = swa_utils.AveragedModel(model)
    snapshots = []
    for t in range(4):
        _perturb(model, t)
        snapshots.append(_weights(model))
        swa.update(model)
        ref.update_parameters(model)
    mean = np.mean(snapshots, axis=0)
    np.testing.assert_allclose(_weights(swa.module), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_weights(swa.module), _weights(ref.module), rtol=1e-6, atol=1e-7)
    # buffers follow the model (BatchNorm statistics are recomputed with update_bn afterwards)
    torch.testing.assert_close(swa.module[1].running_mean, model[1].running_mean)


class _NoDeepcopy(nn.Sequential):
    def __deepcopy__(self, memo):
        raise RuntimeError("deepcopy is not allowed for this model")


def test_user_provided_target_is_used_without_deepcopy():
    torch.manual_seed(0)
    model = _NoDeepcopy(nn.Linear(3, 2))
    target = nn.Sequential(nn.Linear(3, 2))
    ema = EMA(model, decay=0.5, warmup=False, target=target)
    assert ema.module is target
    np.testing.assert_array_equal(_weights(target), _weights(model))  # initialised from the model
    before = _weights(model)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model)
    np.testing.assert_allclose(_weights(target), 0.5 * before + 0.5 * _weights(model), rtol=1e-6)
    with pytest.raises(RuntimeError, match="deepcopy"):
        EMA(model)


def test_compiled_model_names_match_plain_copy():
    model = _net()
    compiled = torch.compile(model)  # not called: only the _orig_mod. naming is exercised
    assert next(iter(dict(compiled.named_parameters()))).startswith("_orig_mod.")
    ema = EMA(compiled, decay=0.5, warmup=False)
    assert not hasattr(ema.module, "_orig_mod")  # the copy is of the original module
    before = _weights(model)
    _perturb(model, 0)
    ema.update(compiled)
    expected = 0.5 * before + 0.5 * _weights(model)
    np.testing.assert_allclose(_weights(ema.module), expected, rtol=1e-6)
    # and the other way round: a compiled target fed by the plain model
    target = torch.compile(_net(1))
    swa = SWA(model, target=target)
    swa.update(model)
    np.testing.assert_array_equal(_weights(target), _weights(model))


def test_mismatched_model_is_rejected_with_names():
    model = _net()
    ema = EMA(model)
    with pytest.raises(ValueError, match="does not match"):
        ema.update(nn.Sequential(nn.Linear(3, 4)))
    with pytest.raises(ValueError, match=r"'0.weight' has shape"):
        ema.update(nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    with pytest.raises(ValueError, match="does not match"):
        EMA(model, target=nn.Linear(3, 4))
    with pytest.raises(ValueError, match="decay"):
        EMA(model, decay=1.5)


def test_state_dict_round_trip():
    model = _net()
    ema = EMA(model, decay=0.7)
    for t in range(3):
        _perturb(model, t)
        ema.update(model)
    state = copy.deepcopy(ema.state_dict())
    other = EMA(_net(5), decay=0.7)
    other.load_state_dict(state)
    assert other.n_updates == 3
    np.testing.assert_array_equal(_weights(other.module), _weights(ema.module))
    _perturb(model, 9)
    ema.update(model)
    other.update(model)
    np.testing.assert_array_equal(_weights(other.module), _weights(ema.module))
    with pytest.raises(RuntimeError, match="n_averaged"):  # torch's missing-key error
        other.load_state_dict({k: v for k, v in state.items() if k != "n_averaged"})


def test_averaged_copy_is_callable():
    model = _net()
    ema = EMA(model)
    ema.module.eval()
    out = ema(torch.randn(2, 3))
    assert out.shape == (2, 2)
    # trainable like torch's AveragedModel copy (tests/swa/test_averaged_model_dropin.py)
    assert all(p.requires_grad for p in ema.module.parameters())


def test_ema_into_float64_target_casts_and_matches_hand_average():
    # hand reference: two updates with warm-up decays 1/10 and 2/11 on a 1-parameter model
    model = nn.Linear(1, 1, bias=False)
    target = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema = EMA(model, decay=0.99, target=target)
    assert ema.module is target and target.weight.dtype == torch.float64
    with torch.no_grad():
        model.weight.fill_(11.0)
    ema.update(model)  # 0.1 * 1 + 0.9 * 11 = 10.0
    assert target.weight.item() == pytest.approx(10.0)
    with torch.no_grad():
        model.weight.fill_(-1.0)
    ema.update(model)  # (2/11) * 10 + (9/11) * (-1) = 1.0
    assert target.weight.item() == pytest.approx(1.0)


def test_swa_hand_computed_mean_of_three_snapshots():
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(100.0)
    swa = SWA(model)  # the construction-time weights are not part of the average
    for v in (3.0, 6.0, 12.0):
        with torch.no_grad():
            model.weight.fill_(v)
        swa.update(model)
    assert swa.module.weight.item() == pytest.approx(7.0)  # (3 + 6 + 12) / 3
