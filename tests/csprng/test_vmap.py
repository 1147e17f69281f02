"""torch.vmap's randomness modes with ember generators, side by side with torch.Generator."""

import pytest
import torch

import ember.csprng as csprng

B = 4


def _draws(g):
    return {
        "randn": lambda x: x + torch.randn(3, generator=g),
        "rand": lambda x: x + torch.rand(3, generator=g),
        "randint": lambda x: x + torch.randint(0, 2**30, (3,), generator=g),
        "randperm": lambda x: x + torch.randperm(3, generator=g),
        "normal": lambda x: x + torch.normal(0.0, 1.0, (3,), generator=g),
    }


@pytest.mark.parametrize("name", sorted(_draws(None)))
def test_different_gives_independent_rows_and_same_shares_them(name):
    for g in (torch.Generator().manual_seed(1), csprng.create_generator(1)):
        x = torch.zeros(B, 3, dtype=torch.int64 if name in ("randint", "randperm") else torch.float32)
        diff = torch.vmap(_draws(g)[name], randomness="different")(x)
        same = torch.vmap(_draws(g)[name], randomness="same")(x)
        assert diff.shape == same.shape == (B, 3)
        assert all(torch.equal(same[0], same[i]) for i in range(B)), (type(g), name)
        if name != "randperm":  # 3! = 6 permutations: rows of a few may repeat
            assert len({tuple(r.tolist()) for r in diff}) == B, (type(g), name)


def test_different_rows_are_the_generators_next_draws():
    g = csprng.create_generator(5)
    rows = torch.vmap(lambda x: x + torch.randn(3, generator=g), randomness="different")(
        torch.zeros(B, 3))
    ref = csprng.create_generator(5)
    assert torch.equal(rows, torch.stack([torch.randn(3, generator=ref) for _ in range(B)]))


@pytest.mark.parametrize("name", sorted(_draws(None)))
def test_error_mode_raises_like_torch(name):
    for g in (torch.Generator().manual_seed(1), csprng.create_generator(1)):
        with pytest.raises(RuntimeError, match="randomness error mode"):
            torch.vmap(_draws(g)[name], randomness="error")(torch.zeros(B, 3))


def test_in_place_different_on_an_unbatched_tensor_raises_like_torch():
    for g in (torch.Generator().manual_seed(1), csprng.create_generator(1)):
        with pytest.raises(RuntimeError, match="different inplace randomness"):
            torch.vmap(lambda x, g=g: x + torch.empty(3).normal_(generator=g),
                       randomness="different")(torch.zeros(B, 3))


def test_batched_tensor_arguments_raise_a_clear_error():
    g = csprng.create_generator(1)
    with pytest.raises(RuntimeError, match="batched tensor argument inside torch.vmap"):
        torch.vmap(lambda p: torch.bernoulli(p, generator=g), randomness="different")(
            torch.full((B, 3), 0.5))


def test_outside_vmap_nothing_changes():
    a, b = csprng.create_generator(2), csprng.create_generator(2)
    assert torch.equal(torch.randn(5, generator=a), torch.randn(5, generator=b))


# ---------------------------------------------------------------- modes of outer vmaps
def _gens():
    return (torch.Generator().manual_seed(1), csprng.create_generator(1))


@pytest.mark.parametrize("inner", ["grad", "jvp"])
def test_randomness_of_a_vmap_around_another_transform(inner):
    for g in _gens():
        def f(x, g=g):
            return (x * torch.rand(3, generator=g)).sum()

        if inner == "grad":
            fn = torch.func.grad(f)
        else:
            def fn(x, g=g):
                return torch.func.jvp(lambda y: y * torch.rand(3, generator=g), (x,), (x,))[0]
        diff = torch.vmap(fn, randomness="different")(torch.ones(B, 3))
        same = torch.vmap(fn, randomness="same")(torch.ones(B, 3))
        assert len({tuple(r.tolist()) for r in diff}) == B, type(g)
        assert all(torch.equal(same[0], same[i]) for i in range(B)), type(g)
        with pytest.raises(RuntimeError, match="randomness error mode"):
            torch.vmap(fn, randomness="error")(torch.ones(B, 3))


@pytest.mark.parametrize("transform", ["jacfwd", "hessian"])
def test_jacfwd_and_hessian_around_a_draw_raise_like_torch(transform):
    for g in _gens():
        def f(x, g=g):
            return (x * x * torch.rand(3, generator=g)).sum()

        with pytest.raises(RuntimeError, match="randomness error mode"):
            if transform == "jacfwd":
                torch.func.jacfwd(lambda x, g=g: x * torch.rand(3, generator=g))(torch.ones(3))
            else:
                torch.func.hessian(f)(torch.ones(3))
        same = torch.func.jacfwd(lambda x, g=g: x * torch.rand(3, generator=g),
                                 randomness="same")(torch.ones(3))
        assert same.shape == (3, 3)


def test_nested_vmaps_different_at_both_levels():
    for g in _gens():
        inner = torch.vmap(lambda x, g=g: x + torch.rand(3, generator=g), randomness="different")
        out = torch.vmap(inner, randomness="different")(torch.zeros(2, B, 3))
        assert out.shape == (2, B, 3)
        assert len({tuple(r.tolist()) for r in out.reshape(-1, 3)}) == 2 * B, type(g)
        outer_same = torch.vmap(inner, randomness="same")(torch.zeros(2, B, 3))
        assert torch.equal(outer_same[0], outer_same[1]), type(g)
        assert len({tuple(r.tolist()) for r in outer_same[0]}) == B, type(g)
        inner_same = torch.vmap(lambda x, g=g: x + torch.rand(3, generator=g), randomness="same")
        outer_diff = torch.vmap(inner_same, randomness="different")(torch.zeros(2, B, 3))
        assert not torch.equal(outer_diff[0, 0], outer_diff[1, 0]), type(g)
        assert all(torch.equal(outer_diff[0, 0], outer_diff[0, i]) for i in range(B)), type(g)


def test_a_compiled_function_around_vmap_keeps_its_randomness_rules():
    # torch.compile runs the draw eagerly at a graph break, still inside the vmap: the same rules
    # as the eager call (rows differ for "different", the draw refused for "error")
    g = csprng.create_generator(5)

    def different(x):
        return torch.vmap(lambda y: y + torch.rand(3, generator=g), randomness="different")(x)

    rows = torch.compile(different, backend="eager")(torch.zeros(B, 3))
    assert len({tuple(r.tolist()) for r in rows}) == B

    def refused(x):
        return torch.vmap(lambda y: y + torch.rand(3, generator=g))(x)

    with pytest.raises(RuntimeError, match="randomness"):
        refused(torch.zeros(B, 3))
    with pytest.raises(RuntimeError, match="randomness"):
        torch.compile(refused, backend="eager")(torch.zeros(B, 3))
