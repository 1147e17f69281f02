"""ember.csprng.views: NumPy views of tensors' memory that leave the tensors resizable, compared
with what ``Tensor.numpy()`` gives."""

import gc

import numpy as np
import pytest
import torch

from ember.csprng.views import array_view, flat_view, tensor_bytes

DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
def test_flat_view_reads_and_writes_the_tensors_elements(dtype):
    t = (torch.arange(24) % 3).to(dtype).reshape(4, 6)
    v = flat_view(t)
    assert v.dtype == t.clone().numpy().dtype
    assert np.array_equal(v, t.clone().numpy().reshape(-1))
    v[5] = 1
    assert t.view(-1)[5].item() == 1
    t.resize_(48)  # still resizable (t.numpy() would have made it not)
    assert t.numel() == 48


@pytest.mark.parametrize("make", [
    lambda x: x.t(), lambda x: x[:, 1::2], lambda x: x[1:, 2:], lambda x: x.expand(3, 4, 6)[1],
    lambda x: x[:, :0],
], ids=["transposed", "step", "offset", "expanded", "empty"])
def test_array_view_has_the_tensors_shape_and_strides(make):
    base = torch.arange(24.0).reshape(4, 6)
    t = make(base)
    want = t.clone().numpy()
    got = array_view(t)
    assert got.shape == want.shape and np.array_equal(got, want)
    if t.numel():
        got[0, 0] = -7.0
        assert t[0, 0].item() == -7.0


def test_a_view_keeps_its_tensor_alive():
    v = flat_view(torch.full((1000,), 3.0))
    gc.collect()
    for _ in range(50):
        torch.full((1000,), 9.0)  # reuse of freed memory would show here
    assert (v == 3.0).all()


def test_bad_tensors_are_refused():
    with pytest.raises(ValueError, match="contiguous"):
        flat_view(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="bfloat16"):
        flat_view(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="conjugate"):
        array_view(torch.zeros(4, dtype=torch.complex64).conj())
    assert flat_view(torch.zeros(0)).shape == (0,)


def test_tensor_bytes_is_the_element_bytes_in_order():
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3).t()
    assert tensor_bytes(t) == t.contiguous().numpy().tobytes()
    assert tensor_bytes(torch.zeros(0)) == b""
    t.resize_(20)
