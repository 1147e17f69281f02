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


# ---------------------------------------------------------------------- routing
def _record(method, **fields):
    fields.setdefault("op_name", f"Tensor.{method}")
    return spec.Distribution(method, (spec.Param("scale", 1.0),), spec.DtypeRule(), **fields)


def test_the_adapter_routes_every_entry_point_the_records_name_and_nothing_else():
    from ember.csprng import torch_adapter

    functions = {n for d in spec.DISTRIBUTIONS for n in d.torch_functions}
    methods = {n for d in spec.DISTRIBUTIONS
               for n in (*d.tensor_methods, *([d.tensor_method] if d.tensor_method else []))}
    assert set(torch_adapter._TORCH) == functions | set(torch_adapter._REFUSED)
    assert set(torch_adapter._TENSOR) == methods
    assert {"rand", "randn", "normal", "randint", "randperm", "multinomial", "poisson"} <= functions
    for name in methods:  # installed on torch.Tensor (ember.csprng is imported)
        assert getattr(torch.Tensor, name).__ember_original__ is not None


def test_a_record_routed_by_nothing_is_an_error_naming_it():
    from ember.csprng import torch_adapter

    record = _record("rayleigh_", torch_functions=("rayleigh",))
    with pytest.raises(spec.RecordMismatch, match=r"'rayleigh_'.*torch\.rayleigh"):
        torch_adapter._routes((*spec.DISTRIBUTIONS, record), torch_adapter._SERVES, ())
    # a non-filling record's Tensor method has no generic server either
    record = _record("sample", tensor_methods=("sample",), fills=False)
    with pytest.raises(spec.RecordMismatch, match=r"'sample'.*Tensor\.sample"):
        torch_adapter._routes((*spec.DISTRIBUTIONS, record), torch_adapter._SERVES, ())


def test_an_entry_point_no_record_names_is_an_error_naming_it():
    from ember.csprng import torch_adapter

    serves = {**torch_adapter._SERVES, "torch.rayleigh": torch_adapter._rand}
    with pytest.raises(spec.RecordMismatch, match=r"torch\.rayleigh.*no record"):
        torch_adapter._routes(spec.DISTRIBUTIONS, serves, ())
    with pytest.raises(spec.RecordMismatch, match=r"torch\.rand is both routed"):
        torch_adapter._routes(spec.DISTRIBUTIONS, torch_adapter._SERVES, ("rand",))


def test_an_in_place_fill_needs_no_adapter_function():
    from ember.csprng import torch_adapter

    record = _record("rayleigh_", tensor_method="rayleigh_")
    _, methods = torch_adapter._routes((*spec.DISTRIBUTIONS, record), torch_adapter._SERVES, ())
    assert methods["rayleigh_"].__qualname__ == "_scalar_method.<locals>.impl"


# ---------------------------------------------------------------------- CUDA tables
def test_the_cuda_tables_are_the_records_fills():
    from ember.csprng import cuda_backend, cuda_fast

    assert set(cuda_backend._FILLS) == {d.method for d in spec.DISTRIBUTIONS if d.triton}
    assert set(cuda_backend._FILLS) == set(cuda_backend.SUPPORTED_METHODS)
    assert set(cuda_fast._FILLS) == {d.method for d in spec.DISTRIBUTIONS if d.nvrtc}
    assert set(cuda_fast._FILLS) == cuda_fast.FAST_METHODS


def test_a_record_asking_for_a_triton_fill_the_backend_lacks_is_an_error_naming_it():
    from ember.csprng import cuda_backend

    record = _record("rayleigh_", tensor_method="rayleigh_", triton=True)
    with pytest.raises(spec.RecordMismatch, match=r"'rayleigh_'.*cuda_backend"):
        cuda_backend._fill_table((*spec.DISTRIBUTIONS, record))
    # and a fill no record asks for
    no_uniform = [d for d in spec.DISTRIBUTIONS if d.method != "uniform_"]
    with pytest.raises(spec.RecordMismatch, match=r"cuda_backend \(Triton\) implements uniform_"):
        cuda_backend._fill_table(no_uniform)


def test_a_record_asking_for_nvrtc_fills_or_kernels_that_are_missing_is_an_error_naming_it():
    from ember.csprng import cuda_fast

    record = _record("rayleigh_", tensor_method="rayleigh_", nvrtc=("exponential",))
    with pytest.raises(spec.RecordMismatch, match=r"'rayleigh_'.*cuda_fast"):
        cuda_fast._fill_table((*spec.DISTRIBUTIONS, record))
    record = _record("uniform_", nvrtc=("rayleigh",))
    others = [d for d in spec.DISTRIBUTIONS if d.method != "uniform_"]
    with pytest.raises(spec.RecordMismatch, match=r"'uniform_'.*ember_aes_rayleigh"):
        cuda_fast._fill_table((*others, record))
