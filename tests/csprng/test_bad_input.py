"""Bad input raises the exception type torch raises for the same call, asserted side by side."""

import numpy as np
import pytest
import torch

import ember.csprng as csprng


def _outcome(call, g):
    try:
        call(g)
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e)
    return None


def _torch_and_ember(call):
    return _outcome(call, torch.Generator()), _outcome(call, csprng.create_generator(1))


@pytest.mark.parametrize("seed", [1.9, True, False, "7", torch.tensor(5), None, 1 + 0j,
                                  np.int64(5), -(2**63) - 1, 2**128])
def test_bad_seeds_raise_like_torch(seed):
    want = _outcome(lambda g: g.manual_seed(seed), torch.Generator())
    got = _outcome(lambda g: g.manual_seed(seed), csprng.create_generator(1))
    if type(seed) is int and seed == 2**128:  # torch's limit is 2**64; ember's seeds are 128 bits wide
        want = ValueError
    assert want is not None and got is not None
    assert issubclass(got, want), (seed, want, got)


@pytest.mark.parametrize("seed", [-1, -(2**63), 0, 2**64 - 1])
def test_int_seeds_of_any_sign_are_read_as_torch_reads_them(seed):
    t = torch.Generator().manual_seed(seed)
    g = csprng.create_generator(1).manual_seed(seed)
    assert g.initial_seed() == t.initial_seed()
    assert torch.equal(torch.rand(8, generator=g),
                       torch.rand(8, generator=csprng.create_generator(t.initial_seed())))
    assert csprng.create_generator(seed).initial_seed() == t.initial_seed()


def test_seeds_up_to_128_bits_are_accepted():
    assert csprng.create_generator(1).manual_seed(2**128 - 1).initial_seed() == 2**128 - 1


CALLS = {
    "randint float high": lambda g: torch.randint(0, 2.5, (3,), generator=g),
    "randint float low": lambda g: torch.randint(0.5, 3, (3,), generator=g),
    "randint empty range": lambda g: torch.randint(3, 1, (3,), generator=g),
    "random_ complex": lambda g: torch.empty(3, dtype=torch.complex64).random_(generator=g),
    "random_ complex to": lambda g: torch.empty(3, dtype=torch.complex64).random_(5, generator=g),
    "normal nan std tensor": lambda g: torch.normal(torch.zeros(3), torch.tensor([1.0, float("nan"), 1.0]),
                                                    generator=g),
    "normal nan std float": lambda g: torch.normal(torch.zeros(3), float("nan"), generator=g),
    "normal nan std size": lambda g: torch.normal(0.0, float("nan"), (3,), generator=g),
    "normal_ nan std": lambda g: torch.empty(3).normal_(0, float("nan"), generator=g),
    "normal_ negative std": lambda g: torch.empty(3).normal_(0, -1, generator=g),
    "uniform_ reversed": lambda g: torch.empty(3).uniform_(2, 1, generator=g),
    "bernoulli_ p > 1": lambda g: torch.empty(3).bernoulli_(1.5, generator=g),
    "exponential_ negative": lambda g: torch.empty(3).exponential_(-1, generator=g),
    "geometric_ p = 0": lambda g: torch.empty(3).geometric_(0, generator=g),
    "log_normal_ negative std": lambda g: torch.empty(3).log_normal_(0, -1, generator=g),
    "cauchy_ negative sigma": lambda g: torch.empty(3).cauchy_(0, -1, generator=g),
    "randperm negative": lambda g: torch.randperm(-1, generator=g),
    "randperm float": lambda g: torch.randperm(2.5, generator=g),
    "rand negative size": lambda g: torch.rand(-1, generator=g),
    "rand float size": lambda g: torch.rand(2.5, generator=g),
    "random_ int8 out of range": lambda g: torch.empty(3, dtype=torch.int8).random_(0, 300, generator=g),
    "multinomial zero sum": lambda g: torch.multinomial(torch.tensor([0.0, 0.0]), 1, generator=g),
    "multinomial negative": lambda g: torch.multinomial(torch.tensor([1.0, -1.0]), 1, generator=g),
    "multinomial too many": lambda g: torch.multinomial(torch.tensor([1.0, 1.0]), 3, generator=g),
    "bernoulli p tensor > 1": lambda g: torch.bernoulli(torch.tensor([1.5]), generator=g),
    "poisson negative": lambda g: torch.poisson(torch.tensor([-1.0]), generator=g),
    "uniform_ int64": lambda g: torch.empty(3, dtype=torch.int64).uniform_(generator=g),
    "normal_ int64": lambda g: torch.empty(3, dtype=torch.int64).normal_(generator=g),
    "randn int64": lambda g: torch.randn(3, dtype=torch.int64, generator=g),
    "rand int64": lambda g: torch.rand(3, dtype=torch.int64, generator=g),
    "randint beyond int64": lambda g: torch.randint(0, 2**70, (3,), generator=g),
    "random_ uint8 negative from": lambda g: torch.empty(3, dtype=torch.uint8).random_(-1, 5, generator=g),
    "set_state float tensor": lambda g: g.set_state(torch.zeros(3)),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_bad_calls_raise_what_torch_raises(name):
    want, got = _torch_and_ember(CALLS[name])
    assert want is not None, f"torch accepts {name}"
    assert got is not None and issubclass(got, want), (name, want, got)
