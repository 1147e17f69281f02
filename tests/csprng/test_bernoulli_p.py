"""bernoulli with a tensor p: every p dtype, stride and broadcast gives the float64 layout values."""

import numpy as np
import pytest
import torch

import ember.csprng as csprng


# (bool and integer p raise NotImplementedError, as in torch: test_torch_semantics.py)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_p_of_any_dtype_draws_like_its_float64_values(dtype):
    base = torch.linspace(0, 1, 2 * 3000, dtype=torch.float64).to(dtype)
    p = base[::2].reshape(30, 100)  # strided, not contiguous
    got = torch.bernoulli(p, generator=csprng.create_generator(5))
    want = torch.bernoulli(p.double().contiguous(), generator=csprng.create_generator(5))
    assert torch.equal(got, want.to(got.dtype))
    assert 0 < int(got.sum()) < p.numel()


def test_broadcast_p_equals_the_scalar_draw():
    p32 = torch.tensor([0.3], dtype=torch.float32)
    out = torch.empty(40, 50)
    got = out.bernoulli_(p32, generator=csprng.create_generator(9)).clone()
    want = torch.empty(40, 50).bernoulli_(float(p32), generator=csprng.create_generator(9))
    assert torch.equal(got, want)
    assert 0.2 < float(got.mean()) < 0.4


def test_p_that_does_not_broadcast_is_refused():
    with pytest.raises(ValueError, match="does not broadcast"):
        torch.empty(4, 5).bernoulli_(torch.full((3,), 0.5), generator=csprng.create_generator(1))


def test_p_out_of_range_is_refused():
    p = torch.tensor([0.5, np.nextafter(1.0, 2.0)], dtype=torch.float64)
    with pytest.raises(ValueError, match="probabilities"):
        torch.bernoulli(p, generator=csprng.create_generator(1))
