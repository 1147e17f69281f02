"""A sweep of calls at the edges of torch's argument rules: with an ember generator each call has
the outcome torch's own generator gives it (the exception class, or the dtype, shape, strides,
requires_grad, warnings and kind of values of the result)."""

import warnings

import pytest
import torch

import ember.csprng as csprng

F8 = torch.float8_e4m3fn


def _inference_tensor() -> torch.Tensor:
    with torch.inference_mode():
        return torch.empty(3)


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


def _negated_view() -> torch.Tensor:
    """Probabilities 0.25 stored negated: a view whose is_neg() is set."""
    return torch._neg_view(torch.full((4,), -0.25))


def _wants_grad() -> torch.Tensor:
    return torch.full((4,), 0.5, requires_grad=True)


CASES = {
    # in-place draws into an inference tensor outside inference_mode
    "inference normal_": lambda g: _inference_tensor().normal_(generator=g),
    "inference bernoulli_": lambda g: _inference_tensor().bernoulli_(0.5, generator=g),
    "inference nn.init.uniform_": lambda g: torch.nn.init.uniform_(_inference_tensor(),
                                                                   generator=g),
    "inference rand(out=)": lambda g: torch.rand(3, out=_inference_tensor(), generator=g),
    # out= of the wrong shape
    "normal(mean_t, 1.0, out=wrong)": lambda g: torch.normal(torch.zeros(3), 1.0,
                                                             out=torch.empty(5), generator=g),
    "normal(0.0, std_t, out=wrong)": lambda g: torch.normal(0.0, torch.ones(3),
                                                            out=torch.empty(5), generator=g),
    "normal(mean_t, std_t, out=wrong)": lambda g: torch.normal(
        torch.zeros(3), torch.ones(3), out=torch.empty(5), generator=g),
    "normal(0, 1, size, out=wrong)": lambda g: torch.normal(0.0, 1.0, (3,), out=torch.empty(5),
                                                            generator=g),
    "rand(out=wrong)": lambda g: torch.rand(3, out=torch.empty(5), generator=g),
    "randint(out=wrong)": lambda g: torch.randint(0, 5, (3,), out=torch.empty(5, dtype=torch.long),
                                                  generator=g),
    "bernoulli(out=wrong)": lambda g: torch.bernoulli(torch.rand(3), out=torch.empty(5),
                                                      generator=g),
    "multinomial(out=wrong)": lambda g: torch.multinomial(
        torch.ones(3), 2, out=torch.empty(5, dtype=torch.long), generator=g),
    # exception types
    "bool.geometric_": lambda g: torch.empty(3, dtype=torch.bool).geometric_(0.5, generator=g),
    "complex64.random_(0, None)": lambda g: torch.empty(3, dtype=torch.complex64).random_(
        0, None, generator=g),
    "float8.random_(0, None)": lambda g: torch.empty(3, dtype=F8).random_(0, None, generator=g),
    "multinomial(0 samples)": lambda g: torch.multinomial(torch.ones(3), 0, generator=g),
    "normal_(0, -1)": lambda g: torch.empty(3).normal_(0, -1, generator=g),
    "exponential_(0)": lambda g: torch.empty(3).exponential_(0, generator=g),
    "cauchy_(0, 0)": lambda g: torch.empty(3).cauchy_(0, 0, generator=g),
    "log_normal_(0, 0)": lambda g: torch.empty(3).log_normal_(0, 0, generator=g),
    # what torch accepts and what it refuses
    "uint64.random_(0, None)": lambda g: torch.empty(3, dtype=torch.uint64).random_(
        0, None, generator=g),
    "uint32.random_(0, None)": lambda g: torch.empty(3, dtype=torch.uint32).random_(
        0, None, generator=g),
    "uint64.random_(0, 10)": lambda g: torch.empty(3, dtype=torch.uint64).random_(
        0, 10, generator=g),
    "poisson(float8)": lambda g: torch.poisson(torch.ones(3, dtype=F8), g),
    "multinomial(float8)": lambda g: torch.multinomial(torch.ones(3, dtype=F8), 2, generator=g),
    "multinomial(int64)": lambda g: torch.multinomial(torch.ones(3, dtype=torch.long), 2,
                                                      generator=g),
    "multinomial(bool)": lambda g: torch.ones(3, dtype=torch.bool).multinomial(2, generator=g),
    "multinomial(complex64)": lambda g: torch.multinomial(torch.ones(3, dtype=torch.cfloat), 2,
                                                          generator=g),
    "multinomial(bfloat16)": lambda g: torch.multinomial(torch.ones(3, dtype=torch.bfloat16), 2,
                                                         generator=g),
    "poisson(int64)": lambda g: torch.poisson(torch.ones(3, dtype=torch.long), g),
    "poisson(bool)": lambda g: torch.poisson(torch.ones(3, dtype=torch.bool), generator=g),
    "poisson(complex64)": lambda g: torch.poisson(torch.ones(3, dtype=torch.cfloat), g),
    "poisson(half)": lambda g: torch.poisson(torch.ones(3, dtype=torch.half), g),
    "meta normal_(0, -1)": lambda g: _meta(3).normal_(0, -1, generator=g),
    "meta uniform_(2, 1)": lambda g: _meta(3).uniform_(2, 1, generator=g),
    "meta random_(5, 3)": lambda g: _meta(3).random_(5, 3, generator=g),
    "meta randint(5, 3)": lambda g: torch.randint(5, 3, (3,), device="meta", generator=g),
    # torch's meta kernels of multinomial and poisson check no dtype
    "meta multinomial(int64)": lambda g: torch.multinomial(_meta(3).long(), 2, generator=g),
    "meta multinomial(float8)": lambda g: torch.multinomial(_meta(3).to(F8), 2, generator=g),
    "meta multinomial(out=int32)": lambda g: torch.multinomial(
        _meta(3), 2, generator=g, out=_meta(2).int()),
    "meta multinomial(3 dims)": lambda g: torch.multinomial(_meta(2, 2, 3), 2, generator=g),
    "meta poisson(int64)": lambda g: torch.poisson(_meta(3).long(), g),
    "meta poisson(bool)": lambda g: torch.poisson(_meta(3).bool(), generator=g),
    "meta poisson(float8)": lambda g: torch.poisson(_meta(3).to(F8), g),
    # overflow: inf where torch gives inf, and no NumPy warning
    "half log_normal_(7, 7)": lambda g: torch.empty(1000, dtype=torch.half).log_normal_(
        7, 7, generator=g),
    "half cauchy_(0, 1e4)": lambda g: torch.empty(1000, dtype=torch.half).cauchy_(
        0, 1e4, generator=g),
    "bfloat16 exponential_(1e-40)": lambda g: torch.empty(1000, dtype=torch.bfloat16).exponential_(
        1e-40, generator=g),
    # inf - inf: NaN where torch gives NaN, and no NumPy "invalid value" warning
    "float32 normal_(1e307, 1e307)": lambda g: torch.empty(10).normal_(1e307, 1e307, generator=g),
    "half normal_(-1e307, 1e307), large": lambda g: torch.empty(3000, dtype=torch.half).normal_(
        -1e307, 1e307, generator=g),
    "bfloat16 log_normal_(1e307, 1e307)": lambda g: torch.empty(
        10, dtype=torch.bfloat16).log_normal_(1e307, 1e307, generator=g),
    "float64 normal_(inf, inf)": lambda g: torch.empty(10, dtype=torch.float64).normal_(
        float("inf"), float("inf"), generator=g),
    "float64 normal_(inf, inf), large": lambda g: torch.empty(
        3000, dtype=torch.float64).normal_(float("inf"), float("inf"), generator=g),
    # past the compute dtype's range: torch's fused multiply-add meets no inf - inf
    "half cauchy_(inf, 1e38)": lambda g: torch.empty(40, dtype=torch.half).cauchy_(
        float("inf"), 1e38, generator=g),
    "float64 cauchy_(-inf, 1e307)": lambda g: torch.empty(40, dtype=torch.float64).cauchy_(
        -float("inf"), 1e307, generator=g),
    "float32 cauchy_(1e307, 1e38)": lambda g: torch.empty(40).cauchy_(1e307, 1e38, generator=g),
    "bfloat16 normal_(-1e307, 1e38), large": lambda g: torch.empty(
        40, dtype=torch.bfloat16).normal_(-1e307, 1e38, generator=g),
    "half log_normal_(-inf, 1e307)": lambda g: torch.empty(10, dtype=torch.half).log_normal_(
        -float("inf"), 1e307, generator=g),
    "float32 log_normal_(-1e307, 1)": lambda g: torch.empty(40).log_normal_(-1e307, 1.0,
                                                                             generator=g),
    "float32 geometric_(1e-320)": lambda g: torch.empty(40).geometric_(1e-320, generator=g),
    "int64 geometric_(1e-320)": lambda g: torch.empty(40, dtype=torch.long).geometric_(
        1e-320, generator=g),
    "multinomial(overflowing float64)": lambda g: torch.multinomial(
        torch.tensor([1e308, 1e308, 1.0], dtype=torch.float64), 2, generator=g),
    "multinomial(overflowing float64, replacement)": lambda g: torch.multinomial(
        torch.tensor([1e308, 1e308, 1.0], dtype=torch.float64), 2, True, generator=g),
    # probability tensors
    "bernoulli(negated view)": lambda g: torch.bernoulli(_negated_view(), generator=g),
    "bernoulli_(negated view p)": lambda g: torch.empty(4).bernoulli_(_negated_view(),
                                                                      generator=g),
    "bernoulli_(p requiring grad)": lambda g: torch.empty(4).bernoulli_(_wants_grad(),
                                                                        generator=g),
    "bernoulli(p requiring grad)": lambda g: torch.bernoulli(_wants_grad(), generator=g),
    # strides of 0-size outputs
    "multinomial(0 rows)": lambda g: torch.multinomial(torch.ones(0, 3), 2, generator=g),
    "bernoulli(0-size transposed)": lambda g: torch.bernoulli(torch.rand(0, 3).t(), generator=g),
    "normal(0-size transposed mean)": lambda g: torch.normal(torch.zeros(0, 3).t(), 1.0,
                                                             generator=g),
    "rand_like(0-size transposed)": lambda g: torch.rand_like(torch.rand(0, 3).t(), generator=g),
    "poisson(0-size transposed)": lambda g: torch.poisson(torch.rand(0, 3).t(), g),
    "randperm(0)": lambda g: torch.randperm(0, generator=g),
    # tensors with no elements: torch checks some dtypes only where it draws values
    "0-size int64 normal_": lambda g: torch.zeros(0, 3, dtype=torch.long).normal_(generator=g),
    "randn(0, 4, dtype=int64)": lambda g: torch.randn(0, 4, dtype=torch.int64, generator=g),
    "0-size int64 exponential_": lambda g: torch.zeros(0, dtype=torch.long).exponential_(
        generator=g),
    "0-size complex64 bernoulli_": lambda g: torch.zeros(0, dtype=torch.complex64).bernoulli_(
        generator=g),
    "0-size float8 cauchy_": lambda g: torch.zeros(0).to(F8).cauchy_(generator=g).float(),
    "0-size int64 uniform_": lambda g: torch.zeros(0, dtype=torch.long).uniform_(generator=g),
    "0-size int64 cauchy_": lambda g: torch.zeros(0, dtype=torch.long).cauchy_(generator=g),
    "0-size int64 normal_(0, -1)": lambda g: torch.zeros(0, dtype=torch.long).normal_(
        0, -1, generator=g),
    "randperm(0, dtype=bool)": lambda g: torch.randperm(0, dtype=torch.bool, generator=g),
    # argument rules of torch's parser
    "geometric_(True)": lambda g: torch.zeros(4).geometric_(True, generator=g),
    "exponential_(False)": lambda g: torch.zeros(4).exponential_(False, generator=g),
    "bernoulli_('0.5')": lambda g: torch.zeros(4).bernoulli_("0.5", generator=g),
    "random_(None, 5)": lambda g: torch.zeros(4).random_(None, 5, generator=g),
    "random_(from=None, to=5)": lambda g: torch.zeros(4).random_(
        **{"from": None, "to": 5}, generator=g),
    "random_(to=5)": lambda g: torch.zeros(4).random_(to=5, generator=g),
    "randint(5, (3,), low=1)": lambda g: torch.randint(5, (3,), low=1, generator=g),
    "randint(1, high=5, size=(3,))": lambda g: torch.randint(1, high=5, size=(3,), generator=g),
    "normal(0., 1., 3)": lambda g: torch.normal(0., 1., 3, generator=g),
    "normal(0., 1., size=3)": lambda g: torch.normal(0., 1., size=3, generator=g),
    "normal(0., 1., [3])": lambda g: torch.normal(0., 1., [3], generator=g),
    "multinomial(w, 2, 1)": lambda g: torch.multinomial(torch.ones(5), 2, 1, generator=g),
    "multinomial(w, 2, True)": lambda g: torch.multinomial(torch.ones(5), 2, True, generator=g),
}


def _outcome(call, generator):
    """The exception class, or what the result looks like; and the warning classes raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            r = call(generator)
        except Exception as e:  # noqa: BLE001 - the class is what is compared
            result = type(e)
        else:
            values = None
            if r.is_floating_point() and not r.is_meta:
                values = ("inf" if bool(r.isinf().any()) else "finite",
                          "nan" if bool(r.isnan().any()) else "no nan")
            result = (r.dtype, tuple(r.shape), r.stride(), r.requires_grad, r.device.type, values)
    return result, sorted({w.category.__name__ for w in caught})


@pytest.mark.parametrize("name", sorted(CASES))
def test_outcome_matches_torchs_generator(name):
    call = CASES[name]
    mine, mine_warnings = _outcome(call, csprng.create_generator(5))
    theirs, their_warnings = _outcome(call, torch.Generator().manual_seed(5))
    if isinstance(theirs, type):
        assert isinstance(mine, type), f"torch raises {theirs.__name__}, ember returned {mine}"
        assert issubclass(mine, theirs), (mine, theirs)
    else:
        assert mine == theirs
    assert mine_warnings == their_warnings
