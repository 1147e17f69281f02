"""Functional custom ops: equal to the generator path, pure, and usable under fullgraph compile."""

import torch

import ember.csprng as csprng
from ember.csprng import ops


def test_functional_draws_equal_the_generator_and_advance_the_state():
    g = csprng.create_generator(5)
    state = ops.state_of(g)
    a, state = ops.sample(state, "uniform_", (3, 4), 0.0, 1.0)
    b, state = ops.sample(state, "random_range_", (5,), 0, 10, dtype=torch.int64)
    assert torch.equal(a, torch.rand(3, 4, generator=g))
    assert torch.equal(b, torch.randint(0, 10, (5,), generator=g))
    assert torch.equal(state, ops.state_of(g))


def test_same_state_gives_same_values():
    state = ops.state_of(csprng.create_generator(1))
    (x, s1), (y, s2) = ops.sample(state, "normal_", (8,)), ops.sample(state, "normal_", (8,))
    assert torch.equal(x, y) and torch.equal(s1, s2)


def test_opcheck_passes():
    state = ops.state_of(csprng.create_generator(2))
    torch.library.opcheck(torch.ops.ember.sample.default,
                          (state, "normal_", [4], torch.float32, [0.0, 1.0], []))


def test_fullgraph_compile_matches_eager():
    def f(x, state):
        noise, state = ops.sample(state, "normal_", x.shape, 0.0, 1.0)
        return x + noise, state

    state = ops.state_of(csprng.create_generator(3))
    x = torch.zeros(6)
    want = f(x, state)
    got = torch.compile(f, fullgraph=True, backend="inductor")(x, state)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_load_into_continues_the_generator():
    g = csprng.create_generator(9)
    _, state = ops.sample(ops.state_of(g), "uniform_", (100,))
    ops.load_into(g, state)
    h = csprng.create_generator(9)
    torch.rand(100, generator=h)
    assert torch.equal(torch.rand(5, generator=g), torch.rand(5, generator=h))
