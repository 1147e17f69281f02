"""Tracers that record a program (make_fx, torch.export, torch.jit.trace) cannot see an ember draw,
which writes through NumPy: such a trace is refused with a clear error instead of recording an
empty tensor as the noise. Modes that only run the program (FakeTensorMode, FlopCounterMode) keep
working."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import ember.csprng as csprng


def _noise(g):
    return lambda x: x + torch.randn(4, generator=g) + torch.empty(4).normal_(generator=g)


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_make_fx_records_torch_draws_and_refuses_ember_draws(mode):
    gm = make_fx(_noise(torch.Generator().manual_seed(0)), tracing_mode=mode)(torch.zeros(4))
    assert any("randn" in str(n.target) for n in gm.graph.nodes)  # torch's draw is in the graph
    g = csprng.create_generator(0)
    state = g.get_state().clone()
    with pytest.raises(RuntimeError, match="make_fx.*Draw outside the traced function"):
        make_fx(_noise(g), tracing_mode=mode)(torch.zeros(4))
    assert torch.equal(g.get_state(), state)  # refused before anything was drawn


@pytest.mark.parametrize("draw", [
    lambda x, g: torch.rand_like(x, generator=g),
    lambda x, g: x.clone().bernoulli_(0.5, generator=g),
    lambda x, g: torch.randint(0, 5, (4,), generator=g),
], ids=["rand_like", "bernoulli_", "randint"])
def test_make_fx_refuses_other_draws(draw):
    g = csprng.create_generator(0)
    with pytest.raises(RuntimeError, match="make_fx"):
        make_fx(lambda x: draw(x, g))(torch.zeros(4))


class _Noise(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        self.g = g

    def forward(self, x):
        return x + torch.randn(x.shape, generator=self.g)


def test_torch_export_refuses_ember_draws():
    torch.export.export(_Noise(torch.Generator().manual_seed(0)), (torch.zeros(4),))
    with pytest.raises(RuntimeError, match="torch.export.*pass the values in"):
        torch.export.export(_Noise(csprng.create_generator(0)), (torch.zeros(4),))


def test_jit_trace_refuses_ember_draws_with_a_clear_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's own warnings about the torch module
        torch.jit.trace(_Noise(torch.Generator().manual_seed(0)), torch.zeros(3),
                        check_trace=False)
        with pytest.raises(RuntimeError, match="torch.jit.trace"):
            torch.jit.trace(_Noise(csprng.create_generator(0)), torch.zeros(3), check_trace=False)


def test_fake_tensor_mode_without_a_tracer_still_propagates_shapes():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        out = _noise(csprng.create_generator(0))(torch.zeros(4))
    assert isinstance(out, FakeTensor) and out.shape == (4,)


def test_flop_counter_mode_still_draws():
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False):
        out = torch.randn(4, generator=csprng.create_generator(0))
    assert torch.equal(out, torch.randn(4, generator=csprng.create_generator(0)))


def test_functionalization_refuses_ember_draws():
    # AOTAutograd's functionalization (aot_function, FunctionalTensorMode) records a program too
    from functorch.compile import aot_function
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    g = csprng.create_generator(0)
    state = g.get_state().clone()
    with FunctionalTensorMode(), pytest.raises(RuntimeError, match="functionaliz"):
        torch.rand(3, generator=g)
    with pytest.raises(RuntimeError, match="Draw outside the traced function"):
        aot_function(lambda x: x + torch.rand(3, generator=g),
                     fw_compiler=lambda gm, _: gm)(torch.ones(3))
    assert torch.equal(g.get_state(), state)
