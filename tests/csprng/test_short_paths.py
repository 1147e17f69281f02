"""The short paths of the commonest calls (``torch.rand(n, generator=g)``, ``torch.randn(...)``,
Opacus's ``torch.normal(mean=0, std=s, size=..., device=..., generator=g)``) give the general
path's values and a tensor with every property torch's own call gives, in every context."""

import contextlib

import pytest
import torch

import ember.csprng as csprng
from ember.csprng import torch_adapter

CALLS = {
    "rand": (lambda g: torch.rand(4, 5, generator=g),
             lambda g: torch.rand((4, 5), generator=g, dtype=torch.get_default_dtype())),
    "randn": (lambda g: torch.randn(20, generator=g),
              lambda g: torch.randn((20,), generator=g, dtype=torch.get_default_dtype())),
    "normal keywords": (
        lambda g: torch.normal(mean=0, std=0.5, size=(4, 5), device=torch.device("cpu"),
                               generator=g),
        lambda g: torch.normal(0.0, 0.5, (4, 5), generator=g, dtype=torch.get_default_dtype())),
    "normal positional": (lambda g: torch.normal(1, 2.5, [20], generator=g),
                          lambda g: torch.normal(1.0, 2.5, (20,), generator=g,
                                                 dtype=torch.get_default_dtype())),
    "normal size ()": (lambda g: torch.normal(0.0, 1.0, (), generator=g, device="cpu"),
                       lambda g: torch.normal(0.0, 1.0, (), generator=g,
                                              dtype=torch.get_default_dtype())),
}


def _short_path_taken(monkeypatch, name):
    """Make the short path record that it ran and returned a tensor."""
    taken = []
    for helper in ("_fresh_cpu", "_normal_fresh_cpu"):
        real = getattr(torch_adapter, helper)

        def spy(*a, real=real):
            t = real(*a)
            taken.append(t is not None)
            return t
        monkeypatch.setattr(torch_adapter, helper, spy)
    return taken


@pytest.mark.parametrize("name", list(CALLS))
def test_short_path_values_equal_the_general_path(name, monkeypatch):
    short, general = CALLS[name]
    taken = _short_path_taken(monkeypatch, name)
    a = short(csprng.create_generator(7))
    assert taken and taken[0]  # the short path ran and kept the call
    taken.clear()
    b = general(csprng.create_generator(7))
    assert not any(taken)  # the dtype= keyword sends this one the general way
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@contextlib.contextmanager
def _default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


CONTEXTS = {
    "plain": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "float64 default": lambda: _default_dtype(torch.float64),
    "meta device": lambda: torch.device("meta"),
}


def _properties(t: torch.Tensor) -> tuple:
    return (t.dtype, t.device.type, tuple(t.shape), t.requires_grad, t.is_inference(),
            t.is_contiguous(), type(t))


@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("name", list(CALLS))
def test_short_path_tensor_has_torchs_properties(name, context):
    short, _ = CALLS[name]
    with CONTEXTS[context]():
        ours = short(csprng.create_generator(1))
        theirs = short(torch.Generator().manual_seed(1))
    assert _properties(ours) == _properties(theirs)
    if ours.device.type == "cpu" and not ours.is_inference():
        ours.resize_(50)  # a normal, resizable tensor like torch's
        assert ours.numel() == 50


@pytest.mark.parametrize("call, error", [
    (lambda g: torch.normal(mean=0, std=-1.0, size=(3,), device="cpu", generator=g), RuntimeError),
    (lambda g: torch.normal(0, float("nan"), (3,), generator=g), RuntimeError),
    (lambda g: torch.normal(0, 1, (3, -1), generator=g), RuntimeError),
    (lambda g: torch.randn(3, -2, generator=g), RuntimeError),
    (lambda g: torch.rand(-1, generator=g), RuntimeError),
])
def test_short_path_refuses_what_torch_refuses(call, error):
    with pytest.raises(error):
        call(torch.Generator())
    with pytest.raises(error):
        call(csprng.create_generator(0))


def test_short_path_keeps_the_stream_position_of_the_general_path():
    g1, g2 = csprng.create_generator(3), csprng.create_generator(3)
    torch.normal(mean=0, std=1.0, size=(999,), device="cpu", generator=g1)
    torch.normal(0.0, 1.0, (999,), generator=g2, dtype=torch.float32)
    assert g1.counter == g2.counter
    assert torch.equal(torch.randn(5, generator=g1), torch.randn((5,), generator=g2))


@pytest.mark.parametrize("std", [float("nan"), -1.0])
def test_short_path_error_messages_are_the_general_paths(std):
    messages = []
    for kwargs in ({}, {"dtype": torch.float32}):  # dtype= takes the general path
        with pytest.raises(RuntimeError) as info:
            torch.normal(0.0, std, (3,), generator=csprng.create_generator(0), **kwargs)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
