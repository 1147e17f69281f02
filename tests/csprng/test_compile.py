"""torch.compile of code that draws from an ember generator runs and matches eager."""

import pytest
import torch

import ember.csprng as csprng


def step(x, g):
    noise = torch.randn(x.shape, generator=g)
    mask = torch.empty_like(x).bernoulli_(0.5, generator=g)
    idx = torch.randint(0, x.numel(), (3,), generator=g)
    return (x + noise) * mask, idx


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_draws_match_eager(backend):
    torch._dynamo.reset()
    x = torch.arange(6.0)
    g_eager, g_comp = csprng.create_generator(7), csprng.create_generator(7)
    compiled = torch.compile(step, backend=backend)
    for _ in range(3):
        want, got = step(x, g_eager), compiled(x, g_comp)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert g_eager.counter == g_comp.counter > 0
