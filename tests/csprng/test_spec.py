"""The records of ember.csprng.spec drive the tables built from them: the torchcsprng-compatible
sampler's refusals, ops' methods, the adapter's checks of multinomial and poisson."""

import pytest
import torch

from ember.csprng import compat, ops, spec


@pytest.mark.parametrize("record", [d for d in spec.DISTRIBUTIONS if not d.compat],
                         ids=lambda d: d.method)
def test_compat_refuses_every_record_torchcsprng_did_not_have(record):
    sampler = compat.MT19937Sampler(0)
    with pytest.raises(NotImplementedError, match=f"torchcsprng did not implement {record.method}"):
        getattr(sampler, record.method)(torch.empty(3))


def test_ops_samples_the_records_that_fill_and_no_other():
    assert set(ops._METHODS) == {d.method for d in spec.DISTRIBUTIONS if d.fills}
    assert {"multinomial", "poisson"} <= {d.method for d in spec.DISTRIBUTIONS if not d.fills}


@pytest.mark.parametrize(("method", "dtype", "error"), [
    ("multinomial", torch.int64, RuntimeError), ("multinomial", torch.complex64, RuntimeError),
    ("multinomial", torch.float8_e4m3fn, NotImplementedError),
    ("poisson", torch.int32, NotImplementedError), ("poisson", torch.bool, NotImplementedError),
    ("poisson", torch.complex128, NotImplementedError),
])
def test_records_of_multinomial_and_poisson_refuse_as_torch_does(method, dtype, error):
    # torch's own exception types for the dtype (the sweep compares the calls with torch's)
    with pytest.raises(error, match=f"{method}: not implemented for {dtype}"):
        spec.check(method, dtype, (2, False) if method == "multinomial" else ())
    for ok in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        spec.check(method, ok, (2, False) if method == "multinomial" else ())
