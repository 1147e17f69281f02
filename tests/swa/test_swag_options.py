"""SWAG options: diagonal-only posteriors and posteriors over a subset of the parameters."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from ember.swa import SWAG


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(6, 3))


def _perturb(model: nn.Module, g: torch.Generator) -> np.ndarray:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return np.concatenate([p.detach().double().numpy().ravel() for p in model.parameters()])


def test_diagonal_keeps_no_ring_and_matches_numpy_moments():
    assert SWAG(_net(), max_rank=0, diagonal=True).max_rank == 0
    model = _net()
    swag = SWAG(model, max_rank=7, diagonal=True, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    thetas = []
    for _ in range(5):
        thetas.append(_perturb(model, g))
        swag.collect(model)
    thetas = np.array(thetas)
    assert swag.max_rank == 0 and swag.rank == 0
    assert swag.deviations.numel() == 0
    assert swag.memory_bytes == 2 * swag.num_parameters * 8
    np.testing.assert_allclose(swag.mean.numpy(), thetas.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(swag.variance().numpy(), thetas.var(0), rtol=1e-10, atol=1e-12)
    assert swag.deviation_matrix().shape == (0, swag.num_parameters)


def test_diagonal_sample_equals_the_diagonal_formula_draw_for_draw():
    model = _net()
    swag = SWAG(model, diagonal=True, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        _perturb(model, g)
        swag.collect(model)
    theta = swag.sample(0.5, generator=torch.Generator().manual_seed(9))
    z = torch.randn(swag.num_parameters, generator=torch.Generator().manual_seed(9),
                    dtype=torch.float64)
    expected = swag.mean + 0.5**0.5 * swag.variance().sqrt() * z
    torch.testing.assert_close(theta, expected, rtol=1e-12, atol=1e-12)
    # one collected model is enough for a diagonal posterior (no low-rank term needed)
    one = SWAG(model, diagonal=True)
    one.collect(model)
    assert one.sample(generator=torch.Generator().manual_seed(0)).shape == (one.num_parameters,)


def test_diagonal_state_dict_round_trip_and_mismatch_error():
    model = _net()
    swag = SWAG(model, diagonal=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        _perturb(model, g)
        swag.collect(model)
    buf = io.BytesIO()
    torch.save(swag.state_dict(), buf)
    buf.seek(0)
    other = SWAG(_net(), diagonal=True)
    other.load_state_dict(torch.load(buf))
    assert other.n_collected == 4
    assert torch.equal(other.mean, swag.mean) and torch.equal(other.var, swag.var)
    full = SWAG(_net(), max_rank=0 + 3)
    with pytest.raises(ValueError, match="max_rank|diagonal"):
        full.load_state_dict(swag.state_dict())


def test_subset_by_names_collects_and_writes_only_those_parameters():
    model = _net()
    names = ["4.weight", "4.bias"]
    swag = SWAG(model, max_rank=3, params=names, dtype=torch.float64)
    assert swag.names == names and swag.num_parameters == 6 * 3 + 3
    g = torch.Generator().manual_seed(4)
    last = []
    for _ in range(4):
        _perturb(model, g)
        swag.collect(model)
        last.append(torch.cat([model[4].weight.detach().reshape(-1),
                               model[4].bias.detach()]).double())
    torch.testing.assert_close(swag.mean, torch.stack(last).mean(0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bn_before = model[1].running_mean.clone()
    theta = swag.sample(1.0, generator=torch.Generator().manual_seed(0), model=model)
    for n, p in model.named_parameters():
        if n in names:
            assert not torch.equal(p, before[n])
        else:
            assert torch.equal(p, before[n]), n
    assert torch.equal(model[1].running_mean, bn_before)
    w, b = swag.unflatten(theta).values()
    torch.testing.assert_close(model[4].weight.double(), w)
    torch.testing.assert_close(model[4].bias.double(), b)


def test_subset_by_predicate_and_on_a_wrapped_model():
    model = _net()
    swag = SWAG(model, params=lambda name, p: name.startswith("4."), diagonal=True)
    assert swag.names == ["4.weight", "4.bias"]

    swag.collect(torch.compile(model, backend="eager"))  # the compile wrapper's prefix is stripped
    assert swag.n_collected == 1
    sd = swag.state_dict()
    again = SWAG(_net(), params=["4.weight", "4.bias"], diagonal=True)
    again.load_state_dict(sd)
    assert torch.equal(again.mean, swag.mean)


def test_subset_bad_input_errors():
    model = _net()
    with pytest.raises(ValueError, match="not among"):
        SWAG(model, params=["4.weight", "nope.bias"])
    with pytest.raises(ValueError, match="selected no parameter"):
        SWAG(model, params=lambda n, p: False)
    with pytest.raises(ValueError, match="one string"):
        SWAG(model, params="4.weight")
    with pytest.raises(ValueError, match="more than once"):
        SWAG(model, params=["4.bias", "4.bias"])
    with pytest.raises(ValueError, match="max_rank"):
        SWAG(model, max_rank=0)
    swag = SWAG(model, params=["4.weight"])
    with pytest.raises(ValueError, match="missing parameters"):
        swag.collect(nn.Linear(4, 6))
    other = SWAG(model, params=["0.weight"])
    with pytest.raises(ValueError, match="different parameters"):
        other.load_state_dict(swag.state_dict())
