"""torch.compile of code that draws from an ember generator runs and matches eager."""

import logging

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


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("draw", [
    lambda x, g: x.normal_(generator=g),
    lambda x, g: x.normal_(0, 0.5, generator=g),
    lambda x, g: torch.nn.init.normal_(x, generator=g),
], ids=["normal_", "normal_(0, .5)", "nn.init.normal_"])
def test_first_compiled_in_place_normal_matches_eager(backend, draw):
    torch._dynamo.reset()

    def add_noise(x, g):
        draw(x, g)
        return x * 2

    g_eager, g_comp = csprng.create_generator(11), csprng.create_generator(11)
    compiled = torch.compile(add_noise, backend=backend)
    for _ in range(2):  # the first call traces, the second runs the cached graph
        want, got = add_noise(torch.zeros(5), g_eager), compiled(torch.zeros(5), g_comp)
        assert torch.equal(want, got)
    assert g_eager.counter == g_comp.counter > 0


def test_compiled_draws_with_torchs_generator_stay_under_the_recompile_limit():
    # with ember installed, draws with torch's own generator in compiled code break the graph
    # inside ember's wrappers: every routed function has its own code object, so the frames
    # resumed after those breaks are not one code object recompiled for each function
    def draws(x, g):
        a = x.clone().normal_(generator=g)
        b = x.clone().uniform_(generator=g)
        c = x.clone().exponential_(generator=g)
        d = x.clone().bernoulli_(0.5, generator=g)
        e = torch.poisson(x.exp(), g)
        f = torch.nn.init.sparse_(x.clone().view(2, -1), 0.5, generator=g).view(-1)
        h = x.clone().cauchy_(generator=g)
        i = x.clone().log_normal_(generator=g)
        j = x.clone().geometric_(0.3, generator=g)
        k = x.clone().random_(0, 4, generator=g)
        m = torch.multinomial(x.exp(), 2, generator=g)
        return a + b + c + d + e + f + h + i + j + k + m.sum()

    messages: list[str] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Record()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(draws, backend="eager")
        g = torch.Generator().manual_seed(0)
        for n in (4, 6, 8, 4):
            assert compiled(torch.zeros(n), g).shape == (n,)
    finally:
        logger.removeHandler(handler)
        torch._dynamo.reset()
    assert not [m for m in messages if "recompile_limit" in m], messages
