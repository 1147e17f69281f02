"""CUDA-graph capture refusal on every route that can put an ember draw into a CUDA tensor.

A captured draw would be replayed with the same stream position, i.e. the same numbers, on every
replay of the graph. The NVRTC/Triton fills refuse it in ``cuda_backend.cuda_fill``; these tests
cover the routes that draw on the CPU and copy to the device instead (tracked fills, a declining
backend, multinomial, poisson, the tensor overloads of normal and bernoulli, normal_foreach_ over
mixed devices) and the factory routes, on a machine without a GPU: the tensors are CPU tensors that
say they are on CUDA, and the stream is "capturing" by monkeypatch. A refused draw consumes no
stream and writes nothing.
"""

from __future__ import annotations

import re

import pytest
import torch
from fake_cuda import cuda

import ember.csprng as csprng
from ember.csprng import cuda_backend, ops, torch_adapter
from ember.csprng.foreach import secure_noise_foreach_


def _tracked() -> torch.Tensor:
    # not a leaf and requiring grad: the draw is copied in (autograd sees the write) and skips
    # the device backend
    return cuda(torch.zeros(6, requires_grad=True) * 1)


ROUTES = {
    "uniform_ tracked": lambda g: _tracked().uniform_(generator=g),
    "normal_ tracked": lambda g: _tracked().normal_(0.0, 2.0, generator=g),
    "random_ tracked": lambda g: _tracked().random_(0, 10, generator=g),
    "bernoulli_ tracked": lambda g: _tracked().bernoulli_(0.3, generator=g),
    "uniform_": lambda g: cuda(torch.empty(6)).uniform_(generator=g),
    "cauchy_ non-contiguous": lambda g: cuda(torch.empty(6, 4))[:, ::2].cauchy_(generator=g),
    "complex normal_": lambda g: cuda(torch.empty(6, dtype=torch.complex64)).normal_(generator=g),
    "rand out=": lambda g: torch.rand(5, generator=g, out=cuda(torch.empty(5))),
    "rand_like": lambda g: torch.rand_like(cuda(torch.empty(5)), generator=g),
    "randn_like": lambda g: torch.randn_like(cuda(torch.empty(5)), generator=g),
    "randint_like": lambda g: torch.randint_like(cuda(torch.empty(5)), 0, 9, generator=g),
    "randperm out=": lambda g: torch.randperm(7, generator=g, out=cuda(torch.empty(7, dtype=torch.int64))),
    "multinomial": lambda g: torch.multinomial(cuda(torch.ones(2, 5)), 3, generator=g),
    "Tensor.multinomial": lambda g: cuda(torch.ones(5)).multinomial(5, generator=g),
    "multinomial out=": lambda g: torch.multinomial(torch.ones(5), 2, True, generator=g,
                                                    out=cuda(torch.empty(2, dtype=torch.int64))),
    "poisson": lambda g: torch.poisson(cuda(torch.full((4,), 3.0)), generator=g),
    "poisson positional": lambda g: torch.poisson(cuda(torch.full((4,), 3.0)), g),
    "normal(Tensor, float)": lambda g: torch.normal(cuda(torch.zeros(4)), 1.0, generator=g),
    "normal(float, Tensor)": lambda g: torch.normal(0.0, cuda(torch.ones(4)), generator=g),
    "normal out=": lambda g: torch.normal(torch.zeros(4), 1.0, generator=g, out=cuda(torch.empty(4))),
    "bernoulli": lambda g: torch.bernoulli(cuda(torch.full((4,), 0.5)), generator=g),
    "bernoulli p, cpu out=": lambda g: torch.bernoulli(cuda(torch.full((4,), 0.5)), generator=g,
                                                       out=torch.empty(4)),
    "bernoulli_ cuda p": lambda g: torch.empty(4).bernoulli_(cuda(torch.full((4,), 0.5)), generator=g),
    "normal_foreach_ mixed": lambda g: csprng.normal_foreach_(
        [torch.empty(3), cuda(torch.empty(3))], 1.0, generator=g),
    "secure_noise_foreach_ mixed": lambda g: secure_noise_foreach_(
        [torch.empty(3), cuda(torch.empty(3))], 1.0, generator=g),
    # host work on CUDA tensors outside the generator API: the functional op reads its state on
    # the host; AES reads a CUDA key on the host and uploads a new key's table from it (and with
    # CTR a replay would reuse the keystream); AES-GCM reads its tensors on the host (a replay
    # would reuse the nonce)
    "ops.sample": lambda g: ops.sample(cuda(ops.state_of(g)), "uniform_", (3,)),
    "encrypt cuda key": lambda g: csprng.encrypt(cuda(torch.zeros(16, dtype=torch.uint8)),
                                                 cuda(torch.empty(16, dtype=torch.uint8)), _KEY),
    "decrypt cuda key": lambda g: csprng.decrypt(cuda(torch.zeros(16, dtype=torch.uint8)),
                                                 cuda(torch.empty(16, dtype=torch.uint8)), _KEY),
    "encrypt cuda input": lambda g: csprng.encrypt(cuda(torch.zeros(16, dtype=torch.uint8)),
                                                   cuda(torch.empty(16, dtype=torch.uint8)),
                                                   torch.arange(16, dtype=torch.uint8), mode="ctr"),
    "encrypt_gcm": lambda g: csprng.encrypt_gcm(cuda(torch.zeros(16, dtype=torch.uint8)), bytes(16)),
    "decrypt_gcm": lambda g: csprng.decrypt_gcm(cuda(torch.zeros(16, dtype=torch.uint8)), bytes(16),
                                                bytes(12), bytes(16), dtype=torch.uint8, shape=(16,)),
}

_KEY = cuda(torch.arange(16, dtype=torch.uint8))

# what each refusal names: the function or Tensor method the user called (the sampler method
# for draws that reach the generator through torch's own functions)
OPS = {
    "uniform_ tracked": "Tensor.uniform_ (torch.rand)", "normal_ tracked": "Tensor.normal_ (torch.randn)",
    "random_ tracked": "Tensor.random_ (torch.randint)", "bernoulli_ tracked": "Tensor.bernoulli_",
    "uniform_": "Tensor.uniform_ (torch.rand)", "cauchy_ non-contiguous": "Tensor.cauchy_",
    "complex normal_": "Tensor.normal_ (torch.randn)", "rand out=": "torch.rand",
    "rand_like": "Tensor.uniform_ (torch.rand)", "randn_like": "Tensor.normal_ (torch.randn)",
    "randint_like": "Tensor.random_ (torch.randint)", "randperm out=": "torch.randperm",
    "multinomial": "torch.multinomial", "Tensor.multinomial": "torch.multinomial",
    "multinomial out=": "torch.multinomial", "poisson": "torch.poisson",
    "poisson positional": "torch.poisson", "normal(Tensor, float)": "torch.normal",
    "normal(float, Tensor)": "torch.normal", "normal out=": "torch.normal",
    "bernoulli": "torch.bernoulli", "bernoulli p, cpu out=": "torch.bernoulli",
    "bernoulli_ cuda p": "Tensor.bernoulli_", "normal_foreach_ mixed": "normal_foreach_",
    "secure_noise_foreach_ mixed": "secure_noise_foreach_", "ops.sample": "ember.csprng.ops.sample",
    "encrypt cuda key": "ember.csprng.encrypt",
    "encrypt cuda input": "ember.csprng.encrypt", "decrypt cuda key": "ember.csprng.decrypt",
    "encrypt_gcm": "ember.csprng.encrypt_gcm", "decrypt_gcm": "ember.csprng.decrypt_gcm",
}


@pytest.fixture
def capturing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_draw_during_capture_is_refused_and_consumes_nothing(capturing, route):
    g = csprng.create_generator(11)
    csprng_state = g.get_state()
    with pytest.raises(cuda_backend.CaptureError,
                       match=rf"^ember\.csprng: {re.escape(OPS[route])} cannot run while a CUDA graph "
                             r"is being captured \(every replay would repeat the same random numbers\)"):
        ROUTES[route](g)
    assert g.get_state().equal(csprng_state) and g.counter == 0


def test_a_declining_backend_leaves_the_refusal_to_the_copy_path(capturing, monkeypatch):
    """A device backend that declines a fill (returns False, having refused nothing): the CPU
    draw copied into the CUDA tensor is refused before anything is drawn."""
    seen = []
    monkeypatch.setitem(torch_adapter._DEVICE_BACKENDS, "cuda", lambda *a: seen.append(a[2]) or False)
    g = csprng.create_generator(12)
    out = cuda(torch.zeros(5))
    with pytest.raises(cuda_backend.CaptureError):
        out.exponential_(generator=g)
    assert seen == ["exponential_"] and g.counter == 0 and not out.any()


@pytest.mark.parametrize("call,dtype,op", [
    (lambda g, o: torch.rand(5, generator=g, out=o), torch.float32, "torch.rand"),
    (lambda g, o: torch.randn(5, generator=g, out=o), torch.float32, "torch.randn"),
    (lambda g, o: torch.randint(9, (5,), generator=g, out=o), torch.int64, "torch.randint"),
    (lambda g, o: torch.randperm(5, generator=g, out=o), torch.int64, "torch.randperm"),
    (lambda g, o: torch.normal(0.0, 1.0, (5,), generator=g, out=o), torch.float32, "torch.normal"),
], ids=["rand", "randn", "randint", "randperm", "normal(float, float, size)"])
def test_refused_factories_leave_out_as_it_was(capturing, call, dtype, op):
    """A factory with an ``out=`` of another shape refuses before resizing it (a resize during
    capture would also allocate from the graph's pool)."""
    g = csprng.create_generator(15)
    out = cuda(torch.zeros(2, dtype=dtype))
    with pytest.raises(cuda_backend.CaptureError, match=rf"^ember\.csprng: {re.escape(op)} cannot run"):
        call(g, out)
    assert out.shape == (2,) and not out.any() and g.counter == 0


def test_refused_out_tensors_are_left_as_they_were(capturing):
    g = csprng.create_generator(13)
    out = cuda(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(cuda_backend.CaptureError):
        torch.multinomial(torch.ones(5), 2, generator=g, out=out)
    assert out.shape == (3,) and not out.any()
    cpu_out = torch.zeros(2)
    with pytest.raises(cuda_backend.CaptureError):
        torch.bernoulli(cuda(torch.full((4,), 0.5)), generator=g, out=cpu_out)
    assert cpu_out.shape == (2,) and not cpu_out.any() and g.counter == 0


@pytest.mark.parametrize("route", ["uniform_ tracked", "normal out=", "multinomial out=",
                                   "bernoulli_ cuda p", "normal_foreach_ mixed"])
def test_the_same_routes_draw_when_nothing_is_captured(route, monkeypatch):
    """Outside a capture the routes above draw as usual (the refusal is not a blanket one); the
    device backend declines (``EMBER_CSPRNG_CUDA=cpu``), so the CPU draw is copied in."""
    monkeypatch.setenv("EMBER_CSPRNG_CUDA", "cpu")
    g = csprng.create_generator(14)
    ROUTES[route](g)
    assert g.counter > 0


def test_cpu_draws_never_ask_about_capture(monkeypatch):
    """CPU tensors are never refused, whatever the current CUDA stream does."""
    def boom():
        raise AssertionError("asked about capture for a CPU draw")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", boom)
    g = csprng.create_generator(15)
    leaf = torch.zeros(4, requires_grad=True)
    (leaf * 1).uniform_(generator=g)
    torch.empty(6, 4)[:, ::2].normal_(generator=g)
    torch.multinomial(torch.ones(5), 2, generator=g)
    torch.poisson(torch.full((3,), 2.0), generator=g)
    torch.normal(torch.zeros(3), 1.0, generator=g)
    torch.bernoulli(torch.full((3,), 0.5), generator=g)
    torch.empty(3).bernoulli_(torch.full((3,), 0.5), generator=g)
    csprng.normal_foreach_([torch.empty(3), torch.empty(3)[::2]], generator=g)
    assert g.counter > 0
