"""A draw leaves every tensor it touches as torch's own draws leave them: resizable.

``Tensor.numpy()`` marks a tensor's storage as never resizable again; ember once used it on
outputs and inputs, so ``x.resize_(n)`` or ``torch.randn(n, out=x)`` with a new size raised after
an ember draw (torch: fine). Each case runs with torch's generator first: whatever torch leaves
resizable, ember must too.
"""

import pytest
import torch

import ember.csprng as csprng


def _cases():
    f32 = lambda *s: torch.zeros(*s)  # noqa: E731
    return {
        "rand": lambda g, keep: torch.rand(10, generator=g),
        "rand large": lambda g, keep: torch.rand(300_000, generator=g),
        "randn": lambda g, keep: torch.randn(7, generator=g),
        "randn 1000": lambda g, keep: torch.randn(1000, generator=g),
        "randn large": lambda g, keep: torch.randn(300_001, generator=g),
        "randn float64": lambda g, keep: torch.randn(999, generator=g, dtype=torch.float64),
        "randn out": lambda g, keep: torch.randn(9, generator=g, out=keep(f32(9))),
        "rand out": lambda g, keep: torch.rand(3000, generator=g, out=keep(f32(3000))),
        "randint": lambda g, keep: torch.randint(0, 7, (20,), generator=g),
        "randint large": lambda g, keep: torch.randint(0, 7, (300_000,), generator=g),
        "randint out": lambda g, keep: torch.randint(0, 7, (20,), generator=g,
                                                     out=keep(torch.zeros(20, dtype=torch.int64))),
        "randperm": lambda g, keep: torch.randperm(50, generator=g),
        "randperm large": lambda g, keep: torch.randperm(200_000, generator=g),
        "normal scalar": lambda g, keep: torch.normal(0.0, 2.0, (30,), generator=g),
        "normal tensors": lambda g, keep: torch.normal(keep(f32(30)), keep(torch.ones(30)),
                                                       generator=g),
        "uniform_": lambda g, keep: keep(f32(40)).uniform_(-1, 1, generator=g),
        "normal_": lambda g, keep: keep(f32(40)).normal_(generator=g),
        "normal_ 5000": lambda g, keep: keep(f32(5000)).normal_(generator=g),
        "log_normal_": lambda g, keep: keep(f32(40)).log_normal_(generator=g),
        "exponential_": lambda g, keep: keep(f32(40)).exponential_(generator=g),
        "cauchy_": lambda g, keep: keep(f32(40)).cauchy_(generator=g),
        "geometric_": lambda g, keep: keep(f32(40)).geometric_(0.3, generator=g),
        "random_": lambda g, keep: keep(torch.zeros(40, dtype=torch.int64)).random_(generator=g),
        "random_ range": lambda g, keep: keep(torch.zeros(40, dtype=torch.int32)).random_(
            3, 9, generator=g),
        "bernoulli_ p": lambda g, keep: keep(f32(40)).bernoulli_(0.3, generator=g),
        "bernoulli tensor": lambda g, keep: torch.bernoulli(keep(torch.full((40,), 0.5)),
                                                            generator=g),
        "bernoulli float64": lambda g, keep: torch.bernoulli(
            keep(torch.full((40,), 0.5, dtype=torch.float64)), generator=g),
        "multinomial": lambda g, keep: torch.multinomial(keep(torch.ones(3, 8)), 4, generator=g),
        "multinomial float64": lambda g, keep: torch.multinomial(
            keep(torch.ones(8, dtype=torch.float64)), 4, generator=g),
        "poisson": lambda g, keep: torch.poisson(keep(torch.full((40,), 3.0)), generator=g),
        "poisson float64": lambda g, keep: torch.poisson(
            keep(torch.full((40,), 30.0, dtype=torch.float64)), generator=g),
        "poisson large rate": lambda g, keep: torch.poisson(
            keep(torch.full((40,), 1e6, dtype=torch.float64)), generator=g),
        "rand_like": lambda g, keep: torch.rand_like(keep(f32(12)), generator=g),
        "randn_like": lambda g, keep: torch.randn_like(keep(f32(12)), generator=g),
        "dropout-like mask": lambda g, keep: torch.empty(64).bernoulli_(0.9, generator=g),
        "nn.init.normal_": lambda g, keep: torch.nn.init.normal_(keep(f32(5, 5)), generator=g),
        "nn.init.sparse_": lambda g, keep: torch.nn.init.sparse_(keep(f32(6, 4)), 0.5,
                                                                 generator=g),
    }


CASES = _cases()


def _resizable_after(call, g):
    touched = []

    def keep(t):
        touched.append(t)
        return t

    out = call(g, keep)
    result = []
    for t in [out, *touched]:
        try:
            t.resize_(t.numel() + 100)
            result.append(True)
        except RuntimeError:
            result.append(False)
    return result


@pytest.mark.parametrize("name", list(CASES))
def test_tensors_stay_resizable_as_torch_leaves_them(name):
    want = _resizable_after(CASES[name], torch.Generator().manual_seed(0))
    got = _resizable_after(CASES[name], csprng.create_generator(0))
    assert got == want


def test_out_tensor_takes_a_new_size_on_the_next_draw():
    g = csprng.create_generator(1)
    buf = torch.empty(10)
    torch.randn(10, out=buf, generator=g)
    torch.randn(100, out=buf, generator=g)  # torch resizes out=: raised before the fix
    assert buf.shape == (100,)


def test_states_and_keys_given_to_ember_stay_resizable():
    g = csprng.create_generator(2)
    state = g.get_state()
    g.set_state(state)
    key = torch.arange(16, dtype=torch.uint8)
    csprng.create_generator(key=key)
    x, y = torch.arange(32, dtype=torch.uint8), torch.empty(32, dtype=torch.uint8)
    csprng.encrypt(x, y, key)
    csprng.decrypt(y, x, key)
    for t in (state, key, x, y):
        t.resize_(t.numel() + 8)


@pytest.mark.parametrize("make", [
    lambda: torch.rand(4, 3).t(),
    lambda: torch.rand(3, 8, dtype=torch.float64)[:, ::2],
    lambda: torch.rand(12, dtype=torch.float64)[::2],
], ids=["transposed", "float64 columns", "float64 strided"])
def test_multinomial_takes_non_contiguous_probabilities_as_torch_does(make):
    p = make()
    want = torch.multinomial(p, 2, generator=torch.Generator().manual_seed(0))
    got = torch.multinomial(p, 2, generator=csprng.create_generator(5))
    same = torch.multinomial(p.contiguous(), 2, generator=csprng.create_generator(5))
    assert got.shape == want.shape and torch.equal(got, same)
