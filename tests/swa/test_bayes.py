"""bayesian_average and MultiSWAG: probability averaging, BatchNorm per sample, restoration."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember.swa import SWAG, MultiSWAG, bayesian_average, update_bn


def _bn_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _posterior(model: nn.Module, n: int = 4, seed: int = 0) -> SWAG:
    swag = SWAG(model, max_rank=3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        swag.collect(model)
    return swag


def _data(n: int = 3, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(10, 4, generator=g) for _ in range(n)]


def _probs(model, batches):
    model.eval()
    with torch.no_grad():
        return torch.cat([torch.softmax(model(x), 1) for x in batches])


def test_scale_zero_equals_swa_model_with_recomputed_batchnorm():
    model = _bn_net()
    swag = _posterior(model)
    test, train = _data(seed=1), _data(seed=2)
    got = bayesian_average(model, swag, test, n_samples=2, bn_loader=train, scale=0.0)
    reference = _bn_net(5)
    swag.load_into(reference, swag.mean_vector())
    update_bn(train, reference)
    torch.testing.assert_close(got, _probs(reference, test))


def test_average_of_probabilities_over_hand_drawn_samples():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    swag = _posterior(model)
    test = _data()
    got = bayesian_average(model, swag, test, n_samples=5,
                           generator=torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(11)
    reference = nn.Sequential(nn.Linear(4, 3))
    expected = torch.zeros(30, 3)
    for _ in range(5):
        swag.sample(generator=g, model=reference)
        expected += _probs(reference, test)  # probabilities (not logits) are averaged
    torch.testing.assert_close(got, expected / 5)
    torch.testing.assert_close(got.sum(1), torch.ones(30))


def test_model_state_and_mode_are_restored():
    model = _bn_net()
    swag = _posterior(model)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bayesian_average(model, swag, _data(), n_samples=3, bn_loader=_data(seed=2))
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_batchnorm_model_requires_bn_loader():
    model = _bn_net()
    swag = _posterior(model)
    with pytest.raises(ValueError, match="bn_loader"):
        bayesian_average(model, swag, _data(), n_samples=2)
    with pytest.raises(ValueError, match="n_samples"):
        bayesian_average(model, swag, _data(), n_samples=0, bn_loader=_data())


def test_multiswag_pools_all_members_equally():
    model = _bn_net()
    members = [_posterior(_bn_net(seed), seed=seed) for seed in (1, 2)]
    test, train = _data(seed=1), _data(seed=2)
    got = bayesian_average(model, MultiSWAG(members), test, n_samples=3, bn_loader=train,
                           scale=0.0)
    expected = []
    for m in members:
        ref = _bn_net()
        m.load_into(ref, m.mean_vector())
        update_bn(train, ref)
        expected.append(_probs(ref, test))
    torch.testing.assert_close(got, (expected[0] + expected[1]) / 2)


def test_multiswag_state_dict_and_member_checks():
    members = [_posterior(_bn_net(s), seed=s) for s in (1, 2)]
    multi = MultiSWAG(members)
    fresh = MultiSWAG([SWAG(_bn_net(), max_rank=3) for _ in range(2)])
    fresh.load_state_dict(multi.state_dict())
    for a, b in zip(multi, fresh, strict=True):
        assert torch.equal(a.mean, b.mean) and a.n_collected == b.n_collected
    with pytest.raises(ValueError, match="different model"):
        MultiSWAG([members[0], SWAG(nn.Linear(2, 2))])
    with pytest.raises(ValueError, match="at least one"):
        MultiSWAG([])
    with pytest.raises(ValueError, match="holds 1 members"):
        fresh.load_state_dict({"members": [members[0].state_dict()]})
