"""The host routing of the Triton fallback (``cuda_backend.triton_fill_``), run under Triton's
interpreter: default arguments skip the CPU sampler's validation call, other arguments get exactly
the CPU sampler's checks and errors."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ember.csprng as csprng
from ember.csprng import cuda_backend
from ember.csprng.distributions import NativeSampler

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@pytest.fixture
def validations(monkeypatch):
    """The sampler calls made on zero-element tensors (the validation calls), by method."""
    seen: list[str] = []
    for method in ("uniform_", "normal_", "exponential_", "random_range_"):
        real = getattr(NativeSampler, method)

        def record(self, t, *params, _real=real, _m=method):
            if t.numel() == 0:
                seen.append(_m)
            return _real(self, t, *params)

        monkeypatch.setattr(NativeSampler, method, record)
    return seen


@pytest.mark.parametrize("method,params", [("uniform_", ()), ("uniform_", (0.0, 1.0)),
                                           ("normal_", ()), ("normal_", (0.0, 1.0)),
                                           ("exponential_", ()), ("exponential_", (1.0,))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_default_arguments_skip_the_validation_call(validations, method, params, dtype):
    g, h = csprng.create_generator(3), csprng.create_generator(3)
    out = torch.empty(37, dtype=dtype)
    assert cuda_backend.triton_fill_(g.sampler(), out, method, params, interpret=True)
    assert validations == []
    want = getattr(torch.empty(37, dtype=dtype), method)(*params, generator=h)
    assert g.get_state().equal(h.get_state())
    if method == "uniform_":
        assert torch.equal(out, want)
    else:  # log/sin/cos: NumPy's float32 error under the interpreter (docs/csprng-stream.md)
        torch.testing.assert_close(out, want)


def test_other_arguments_are_validated_with_the_cpu_samplers_errors(validations):
    g = csprng.create_generator(4)
    assert cuda_backend.triton_fill_(g.sampler(), torch.empty(5), "uniform_", (-1.0, 2.0), interpret=True)
    assert validations == ["uniform_"]
    for bad in [("normal_", (0.0, -1.0)), ("uniform_", (2.0, 1.0)), ("exponential_", (-1.0,))]:
        method, params = bad
        with pytest.raises((ValueError, RuntimeError)) as ours:
            cuda_backend.triton_fill_(g.sampler(), torch.empty(5), method, params, interpret=True)
        with pytest.raises((ValueError, RuntimeError)) as cpu:
            getattr(torch.empty(5), method)(*params, generator=csprng.create_generator(4))
        assert str(ours.value) == str(cpu.value)
    assert g.counter == 2  # only the valid fill of 5 float32 values drew (one block each way)


def test_a_default_call_on_an_integer_tensor_is_still_refused(validations):
    """Skipping the check is for float dtypes only: ``uniform_`` of an int64 tensor gets the
    CPU sampler's error, not garbage."""
    g = csprng.create_generator(5)
    with pytest.raises((TypeError, RuntimeError, ValueError)):
        cuda_backend.triton_fill_(g.sampler(), torch.empty(5, dtype=torch.int64), "uniform_", (),
                                  interpret=True)
    assert validations == ["uniform_"] and g.counter == 0


@pytest.mark.parametrize("method,params", [
    ("uniform_", (torch.tensor([0.0, 0.0]), 1.0)), ("normal_", (0.0, torch.tensor([1.0, 2.0]))),
    ("exponential_", (torch.tensor([1.0, 1.0]),)),
], ids=["uniform_", "normal_", "exponential_"])
def test_tensor_arguments_get_the_cpu_error(method, params):
    """``triton_fill_`` fails like ``getattr(sampler, method)(tensor, *params)``: a tensor
    argument is never taken for the default (comparing it raised torch's "ambiguous" error)."""
    g = csprng.create_generator(6)
    with pytest.raises(Exception) as ours:
        cuda_backend.triton_fill_(g.sampler(), torch.empty(5), method, params, interpret=True)
    with pytest.raises(Exception) as cpu:
        getattr(csprng.create_generator(6).sampler(), method)(torch.empty(5), *params)
    assert type(ours.value) is type(cpu.value) and str(ours.value) == str(cpu.value)
    assert g.counter == 0
