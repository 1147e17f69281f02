"""torch's own random API reaches ember when given an ember generator, and only then."""

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset, random_split

import ember.csprng as csprng
from ember.csprng import torch_adapter
from ember.csprng.distributions import NativeSampler
from ember.csprng.stream import BlockStream, key_from_seed

SEED = 1234


def g():
    return csprng.create_generator(SEED)


def ref(method, shape, dtype=torch.float32, *params):
    """What the native sampler writes for the first draw of create_generator(SEED)."""
    t = torch.empty(shape, dtype=dtype)
    getattr(NativeSampler(BlockStream(key_from_seed(SEED))), method)(t, *params)
    return t


def test_factories_produce_the_native_stream():
    assert torch.equal(torch.rand(3, 5, generator=g()), ref("uniform_", (3, 5)))
    assert torch.equal(torch.rand((3, 5), generator=g()), ref("uniform_", (3, 5)))
    assert torch.equal(torch.rand(size=(4,), generator=g(), dtype=torch.float64),
                       ref("uniform_", (4,), torch.float64, 0.0, 1.0))
    assert torch.equal(torch.randn(7, generator=g()), ref("normal_", (7,)))
    assert torch.equal(torch.randint(10, (6,), generator=g()), ref("random_range_", (6,), torch.int64, 0, 10))
    assert torch.equal(torch.randint(-3, 10, (6,), generator=g(), dtype=torch.int32),
                       ref("random_range_", (6,), torch.int32, -3, 10))
    assert torch.equal(torch.randint(low=2, high=5, size=(6,), generator=g()),
                       ref("random_range_", (6,), torch.int64, 2, 5))
    assert torch.equal(torch.randperm(9, generator=g()), ref("randperm_", (9,), torch.int64))


def test_like_variants():
    x = torch.zeros(2, 3, dtype=torch.float64)
    assert torch.equal(torch.rand_like(x, generator=g()), ref("uniform_", (2, 3), torch.float64, 0.0, 1.0))
    assert torch.equal(torch.randn_like(x, generator=g()), ref("normal_", (2, 3), torch.float64, 0.0, 1.0))
    assert torch.equal(torch.randint_like(x, 4, generator=g()),
                       ref("random_range_", (2, 3), torch.float64, 0, 4))
    assert torch.equal(torch.randint_like(x, 1, 4, generator=g()),
                       ref("random_range_", (2, 3), torch.float64, 1, 4))


@pytest.mark.parametrize("method,args,params", [
    ("uniform_", (-2.0, 3.0), (-2.0, 3.0)),
    ("normal_", (1.0, 2.0), (1.0, 2.0)),
    ("log_normal_", (0.0, 0.5), (0.0, 0.5)),
    ("exponential_", (2.0,), (2.0,)),
    ("cauchy_", (0.0, 1.0), (0.0, 1.0)),
    ("geometric_", (0.3,), (0.3,)),
    ("bernoulli_", (0.25,), (0.25,)),
])
def test_in_place_methods_produce_the_native_stream(method, args, params):
    out = getattr(torch.empty(50), method)(*args, generator=g())
    assert torch.equal(out, ref(method, (50,), torch.float32, *params))


def test_random_forms():
    assert torch.equal(torch.empty(9, dtype=torch.int64).random_(generator=g()),
                       ref("random_", (9,), torch.int64))
    assert torch.equal(torch.empty(9, dtype=torch.int64).random_(7, generator=g()),
                       ref("random_range_", (9,), torch.int64, 0, 7))
    assert torch.equal(torch.empty(9, dtype=torch.int16).random_(-5, 7, generator=g()),
                       ref("random_range_", (9,), torch.int16, -5, 7))
    x = torch.empty(9, dtype=torch.uint8).random_(100, None, generator=g())
    assert torch.equal(x, ref("random_range_", (9,), torch.uint8, 100, 256))


def test_normal_overloads():
    z = ref("normal_", (5,))
    mean, std = torch.arange(5.0), torch.full((5,), 3.0)
    shifted = ref("normal_", (5,), torch.float32, 0.5, 2.0)
    assert torch.equal(torch.normal(0.5, 2.0, (5,), generator=g()), shifted)
    assert torch.equal(torch.normal(0.5, 2.0, size=(5,), generator=g()), shifted)
    assert torch.equal(torch.normal(mean, std, generator=g()), z * std + mean)
    assert torch.equal(torch.normal(mean, 3.0, generator=g()), z * 3.0 + mean)
    assert torch.equal(torch.normal(0.5, std, generator=g()), z * std + 0.5)
    with pytest.raises(RuntimeError, match="std >= 0"):
        torch.normal(mean, -std, generator=g())


def test_dp_style_noise_call_works_unchanged():
    grad = torch.ones(1000)
    noise = torch.normal(0, 1.5, grad.shape, generator=g())
    assert noise.shape == grad.shape and 1.3 < float(noise.std()) < 1.7


def test_bernoulli_multinomial_poisson():
    p = torch.full((40,), 0.3)
    assert torch.equal(torch.bernoulli(p, generator=g()), ref("bernoulli_", (40,), torch.float32, p))
    assert torch.equal(torch.bernoulli(p, 0.7, generator=g()), ref("bernoulli_", (40,), torch.float32, 0.7))
    assert torch.equal(p.bernoulli(generator=g()), ref("bernoulli_", (40,), torch.float32, p))
    w = torch.tensor([[0.2, 0.0, 0.8], [1.0, 1.0, 1.0]])
    sampler = NativeSampler(BlockStream(key_from_seed(SEED)))
    assert torch.equal(torch.multinomial(w, 2, generator=g()), sampler.multinomial(w, 2, False))
    sampler = NativeSampler(BlockStream(key_from_seed(SEED)))
    assert torch.equal(w.multinomial(5, True, generator=g()), sampler.multinomial(w, 5, True))
    rates = torch.tensor([0.0, 1.0, 30.0, 1e4])
    sampler = NativeSampler(BlockStream(key_from_seed(SEED)))
    assert torch.equal(torch.poisson(rates, g()), sampler.poisson(rates))
    counts = torch.poisson(rates, generator=g())
    assert counts[0] == 0 and abs(float(counts[3]) - 1e4) < 600


def test_out_dtype_requires_grad_and_layouts():
    out = torch.empty(0)
    res = torch.rand(2, 3, generator=g(), out=out)
    assert res is out and torch.equal(out, ref("uniform_", (2, 3)))
    leaf = torch.randn(4, generator=g(), requires_grad=True)
    assert leaf.requires_grad and leaf.is_leaf
    with pytest.raises(RuntimeError, match="leaf Variable"):
        leaf.normal_(generator=g())
    t = torch.empty(4, 6).t()  # non-contiguous: filled in logical row-major order
    t.uniform_(generator=g())
    assert torch.equal(t, ref("uniform_", (6, 4)))
    cl = torch.empty(1, 2, 3, 4).to(memory_format=torch.channels_last).normal_(generator=g())
    assert torch.equal(cl, ref("normal_", (1, 2, 3, 4)))
    c = torch.randn(3, dtype=torch.complex64, generator=g())
    parts = ref("normal_", (3, 2), torch.float32, 0.0, 2**-0.5)
    assert torch.equal(torch.view_as_real(c), parts)


def test_nn_init_functions_draw_from_ember():
    for init in (lambda w, gen: torch.nn.init.uniform_(w, generator=gen),
                 lambda w, gen: torch.nn.init.normal_(w, generator=gen),
                 lambda w, gen: torch.nn.init.xavier_uniform_(w, generator=gen),
                 lambda w, gen: torch.nn.init.kaiming_normal_(w, generator=gen),
                 lambda w, gen: torch.nn.init.trunc_normal_(w, generator=gen),
                 lambda w, gen: torch.nn.init.orthogonal_(w, generator=gen)):
        a, b = g(), g()
        wa = init(torch.nn.Parameter(torch.empty(8, 5)), a)
        wb = init(torch.nn.Parameter(torch.empty(8, 5)), b)
        assert torch.equal(wa, wb) and a.counter > 0
        assert not torch.equal(wa, init(torch.nn.Parameter(torch.empty(8, 5)),
                                        csprng.create_generator(SEED + 1)))


def test_random_sampler_dataloader_and_random_split():
    perm = ref("randperm_", (10,), torch.int64).tolist()
    assert list(RandomSampler(range(10), generator=g())) == perm
    ds = TensorDataset(torch.arange(10))
    loader = DataLoader(ds, batch_size=10, shuffle=True, generator=g())
    (batch,) = next(iter(loader))
    gen = g()
    torch.empty((), dtype=torch.int64).random_(generator=gen)  # the loader's base seed draw
    assert batch.tolist() == torch.randperm(10, generator=gen).tolist()
    left, right = random_split(range(10), [0.3, 0.7], generator=g())
    assert list(left) + list(right) == perm


def test_plain_generators_and_no_generator_are_untouched():
    orig_rand = torch_adapter._ORIGINALS[(torch, "rand")]
    a = torch.rand(5, generator=torch.Generator().manual_seed(3))
    b = orig_rand(5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    torch.manual_seed(0)
    x = torch.randn(3)
    torch.manual_seed(0)
    assert torch.equal(x, torch_adapter._ORIGINALS[(torch, "randn")](3))


def test_functions_ember_does_not_implement_raise_instead_of_using_the_inherited_state():
    with pytest.raises(NotImplementedError, match="torch.binomial"):
        torch.binomial(torch.ones(3), torch.full((3,), 0.5), generator=g())


def test_uninstall_restores_torch_and_install_is_idempotent():
    wrapped = torch.rand
    torch_adapter.uninstall()
    try:
        assert torch.rand is not wrapped
        assert "uniform_" not in torch.Tensor.__dict__
    finally:
        torch_adapter.install()
    torch_adapter.install()
    assert torch_adapter.installed() and torch.rand is not torch_adapter._ORIGINALS[(torch, "rand")]
