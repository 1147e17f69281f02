"""The routed paths keep working with a generator that is not a torch.Generator."""

import os
import sys

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
    random_split,
)

import ember.csprng as csprng

DATA = TensorDataset(torch.arange(40))


def _order(sampler):
    return list(iter(sampler))


@pytest.mark.parametrize("make", [
    lambda g: RandomSampler(DATA, generator=g),
    lambda g: RandomSampler(DATA, replacement=True, num_samples=50, generator=g),
    lambda g: SubsetRandomSampler(list(range(0, 40, 2)), generator=g),
    lambda g: WeightedRandomSampler(torch.linspace(0.1, 1.0, 40), 30, generator=g),
])
def test_samplers_draw_from_ember(make):
    a, b = make(csprng.create_generator(3)), make(csprng.create_generator(3))
    assert _order(a) == _order(b)
    g = csprng.create_generator(3)
    _order(make(g))
    assert g.counter > 0
    assert _order(make(csprng.create_random_device_generator())) != \
        _order(make(csprng.create_random_device_generator()))


def test_random_split_draws_from_ember():
    g1, g2 = csprng.create_generator(4), csprng.create_generator(4)
    a, b = random_split(range(30), [10, 20], generator=g1), random_split(range(30), [10, 20], generator=g2)
    assert list(a[0]) == list(b[0]) and g1.counter > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_shuffle_and_base_seed(workers):
    if workers and (sys.platform == "win32" or not hasattr(os, "fork")):
        pytest.skip("forked workers")
    kw = {"multiprocessing_context": "fork"} if workers else {}
    g = csprng.create_generator(5)
    loader = DataLoader(DATA, batch_size=8, shuffle=True, generator=g, num_workers=workers, **kw)
    first = torch.cat([b[0] for b in loader])
    assert sorted(first.tolist()) == list(range(40)) and g.counter > 0
    again = DataLoader(DATA, batch_size=8, shuffle=True, generator=csprng.create_generator(5),
                       num_workers=workers, **kw)
    assert torch.equal(first, torch.cat([b[0] for b in again]))


def test_nn_init_and_a_model_with_dropout_and_batchnorm():
    g = csprng.create_random_device_generator()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.1))
    for name in ("kaiming_uniform_", "xavier_normal_", "trunc_normal_", "orthogonal_", "uniform_"):
        before = model[0].weight.detach().clone()
        getattr(torch.nn.init, name)(model[0].weight, generator=g)
        assert not torch.equal(before, model[0].weight)
    out = model(torch.randn(16, 4, generator=g))
    assert out.shape == (16, 8) and torch.isfinite(out).all()
