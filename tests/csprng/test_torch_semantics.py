"""Swapping ``generator=g`` into torch code changes the values and nothing else.

Where torch defines the behaviour, each test runs the same call with torch's own generator.
"""

import math
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

import ember.csprng as csprng


def eg(seed: int = 5):
    return csprng.create_generator(seed)


def tg(seed: int = 5):
    return torch.Generator().manual_seed(seed)


def _outcome(call, gen):
    """("ok", result) or (exception type, None) for ``call(gen)``."""
    try:
        return "ok", call(gen)
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e), None


def assert_same_outcome(call):
    """``call`` succeeds for both generators or raises an exception of torch's type for both."""
    mine, theirs = _outcome(call, eg()), _outcome(call, tg())
    if theirs[0] == "ok":
        assert mine[0] == "ok", f"torch succeeds, ember raised {mine[0]}"
    else:
        assert mine[0] != "ok", f"torch raises {theirs[0].__name__}, ember returned {mine[1]!r}"
        assert issubclass(mine[0], theirs[0]), (mine[0], theirs[0])
    return mine[1], theirs[1]


# ---------------------------------------------------------------- 1. nn.init.sparse_
def test_sparse_init_takes_its_zero_pattern_from_the_generator():
    def draw(seed):
        torch.manual_seed(seed)  # torch's global generator differs between the two calls
        return torch.nn.init.sparse_(torch.empty(16, 12), 0.5, generator=eg(3))

    a, b = draw(1), draw(2)
    assert torch.equal(a == 0, b == 0)
    assert torch.equal(a, b)
    # torch's semantics: ceil(sparsity * rows) zeros in every column
    assert ((a == 0).sum(0) == 8).all()


def test_sparse_init_refuses_what_torch_refuses():
    assert_same_outcome(lambda g: torch.nn.init.sparse_(torch.empty(4), 0.5, generator=g))


# ---------------------------------------------------------------- 2. uniform_ below a
@pytest.mark.parametrize("dtype,a,b", [
    (torch.float32, 1.0, 1.00000001), (torch.float16, 0.0, 1e-8),
    (torch.bfloat16, 255.5, 256.4), (torch.float16, 1.0, 1.0001),
    (torch.float32, -1e-45, 1e-45), (torch.float64, 1.0, 1.0 + 2**-52),
])
def test_uniform_stays_in_a_b_after_rounding_to_the_dtype(dtype, a, b):
    mine = torch.empty(4096, dtype=dtype).uniform_(a, b, generator=eg())
    theirs = torch.empty(4096, dtype=dtype).uniform_(a, b, generator=tg())
    lo = torch.tensor(a, dtype=dtype)
    assert bool((mine >= lo).all()), float(mine.min())
    if bool((theirs == lo).all()):  # a and b round to one value of the dtype: torch returns a
        assert bool((mine == lo).all())
    small = torch.empty(8, dtype=dtype).uniform_(a, b, generator=eg())
    assert bool((small >= lo).all())


# ---------------------------------------------------------------- 3. normal gradients
@pytest.mark.parametrize("which", ["both", "mean", "std"])
def test_normal_with_tensor_parameters_passes_torchs_gradients(which):
    grads = []
    for gen in (eg(), tg()):
        m = torch.full((5,), 0.5, requires_grad=True)
        s = torch.full((5,), 2.0, requires_grad=True)
        mean = m if which != "std" else 0.5
        std = s if which != "mean" else 2.0
        out = torch.normal(mean, std, generator=gen)
        assert out.requires_grad
        (out * torch.arange(5.0)).sum().backward()
        grads.append((m.grad, s.grad))
    for mine, theirs in zip(*grads, strict=True):
        assert (mine is None) == (theirs is None)
        if theirs is not None:
            assert torch.equal(mine, theirs)


# ---------------------------------------------------------------- 4. inference_mode
def test_in_place_draws_work_in_inference_mode():
    with torch.inference_mode():
        x = torch.empty(10)
        x.normal_(generator=eg())
        x.uniform_(generator=eg())
        y = torch.empty(3, dtype=torch.int64).random_(generator=eg())
        order = [int(b) for b in torch.utils.data.DataLoader(list(range(6)), shuffle=True,
                                                              generator=eg())]
    assert sorted(order) == list(range(6))
    assert y.shape == (3,)
    v = torch.zeros(4)  # a normal tensor written inside inference mode: its version moves
    before = v._version
    with torch.inference_mode():
        v.normal_(generator=eg())
    assert v._version > before


# ---------------------------------------------------------------- 5. torch.jit.script
def test_importing_ember_does_not_break_torch_jit_script():
    @torch.jit.script
    def noisy(x: torch.Tensor) -> torch.Tensor:
        y = x + torch.rand(3) + torch.randn(3) + torch.rand_like(x)
        y = y + torch.randint(0, 3, [3]).float() + torch.randperm(3).float()
        y = y + torch.normal(0.0, 1.0, [3]) + torch.bernoulli(torch.full([3], 0.5))
        y = y + torch.multinomial(torch.ones(3), 3).float() + torch.poisson(torch.ones(3))
        return y

    assert noisy(torch.zeros(3)).shape == (3,)


# ---------------------------------------------------------------- 6. exponential_ > 0
def test_exponential_is_never_zero_even_for_the_largest_word():
    from ember.csprng.distributions import NativeSampler

    class AllOnes:  # every keystream word is 0xff..: the word that gave log(1) = 0
        def draw(self, nblocks):
            return self

        def fill(self, buf):
            buf[:] = b"\xff" * len(buf)

    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        out = torch.empty(4, dtype=dtype)
        NativeSampler(AllOnes()).exponential_(out, 1.0)
        assert bool((out > 0).all()), (dtype, out)


# ---------------------------------------------------------------- 7. poisson, large rates
def test_poisson_at_large_rates_is_fast_and_has_the_right_moments():
    import time

    for rate in (1e9, 1e12, 1e15):  # the CDF inversion took minutes for 1e5 values at 1e9
        t0 = time.perf_counter()
        x = torch.poisson(torch.full((20000,), rate, dtype=torch.float64), generator=eg(9))
        assert time.perf_counter() - t0 < 2.0
        z = (x - rate) / math.sqrt(rate)
        assert abs(float(z.mean())) < 0.05
        assert abs(float(z.var()) - 1.0) < 0.06
        assert bool((x == x.floor()).all())


@pytest.mark.parametrize("rate", [9.99, 10.0, 37.5, 1e4, 1e7])
def test_poisson_matches_the_distribution_around_the_method_switch(rate):
    from scipy import stats

    n = 40000
    x = torch.poisson(torch.full((n,), rate, dtype=torch.float64), generator=eg(11)).numpy()
    lo, hi = int(stats.poisson.ppf(1e-4, rate)), int(stats.poisson.ppf(1 - 1e-4, rate))
    edges = sorted(set(int(e) for e in torch.linspace(lo, hi + 1, 14).tolist()))
    import numpy as np

    observed = np.histogram(x, bins=[-np.inf] + edges[1:-1] + [np.inf])[0]
    cdf = stats.poisson.cdf(np.array(edges[1:-1]) - 1, rate)
    expected = n * np.diff(np.concatenate([[0.0], cdf, [1.0]]))
    assert stats.chisquare(observed, expected).pvalue > 1e-4


# ---------------------------------------------------------------- 8. non-leaf requires_grad
@pytest.mark.parametrize("contiguous", [True, False])
def test_in_place_draw_into_a_non_leaf_gives_torchs_zero_gradient(contiguous):
    grads = []
    for gen in (eg(), tg()):
        a = torch.ones(4, 6, requires_grad=True)
        b = a * 2
        target = b if contiguous else b.t()
        target.normal_(generator=gen)
        b.sum().backward()
        grads.append(a.grad)
    assert torch.equal(grads[0], grads[1])


# ---------------------------------------------------------------- 9. torch.func
@pytest.mark.parametrize("transform", ["grad", "jacrev", "vjp", "jvp"])
def test_torch_func_transforms_around_a_draw(transform):
    def f(x):
        return (x * torch.rand(3, generator=eg()) + torch.empty(3).normal_(generator=eg())).sum()

    def f_vec(x):
        return x * torch.rand(3, generator=eg())

    x = torch.ones(3)
    want = torch.rand(3, generator=eg())
    if transform == "grad":
        got = torch.func.grad(f)(x)
    elif transform == "jacrev":
        got = torch.func.jacrev(f_vec)(x).diagonal()
    elif transform == "vjp":
        _, fn = torch.func.vjp(f_vec, x)
        (got,) = fn(torch.ones(3))
    else:
        _, got = torch.func.jvp(f_vec, (x,), (torch.ones(3),))
    assert torch.equal(got, want)


@pytest.mark.parametrize("draw", [
    lambda: torch.multinomial(torch.ones(8), 8, generator=eg()).float(),
    lambda: torch.poisson(torch.full((8,), 3.0), generator=eg()),
    lambda: torch.bernoulli(torch.full((8,), 0.5), generator=eg()),
    lambda: torch.normal(torch.zeros(8), torch.ones(8), generator=eg()),
    lambda: torch.randperm(8, generator=eg()).float(),
], ids=["multinomial", "poisson", "bernoulli", "normal", "randperm"])
def test_torch_func_grad_sees_draws_from_tensors_as_constants(draw):
    want = draw()
    got = torch.func.grad(lambda x: (x * draw()).sum())(torch.ones(8))
    assert torch.equal(got, want)


# ---------------------------------------------------------------- 10, 11. integer dtypes
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.float32])
def test_randint_and_randperm_fill_out_of_any_dtype_torch_accepts(dtype):
    for call in (lambda g: torch.randint(0, 10, (7,), out=torch.empty(7, dtype=dtype), generator=g),
                 lambda g: torch.randperm(7, out=torch.empty(7, dtype=dtype), generator=g)):
        mine, theirs = assert_same_outcome(call)
        if theirs is not None:
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
    assert_same_outcome(lambda g: torch.randint(0, 10, (7,), out=torch.empty(7, dtype=dtype),
                                                dtype=torch.int64, generator=g))


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_randint_unsigned_dtypes(dtype):
    top = min(torch.iinfo(dtype).max, 2**63 - 2)  # torch's parser takes int64 bounds
    x = torch.randint(0, 10, (500,), dtype=dtype, generator=eg())
    assert x.dtype == dtype and set(x.tolist()) == set(range(10))
    y = torch.randint(top - 5, top + 1, (500,), dtype=dtype, generator=eg())
    assert set(y.tolist()) == set(range(top - 5, top + 1))
    for call in (lambda g: torch.randint(0, top + 2, (3,), dtype=dtype, generator=g),
                 lambda g: torch.empty(3, dtype=dtype).random_(generator=g),
                 lambda g: torch.empty(3, dtype=dtype).bernoulli_(0.5, generator=g),
                 lambda g: torch.empty(3, dtype=dtype).random_(4, generator=g)):
        assert_same_outcome(call)


def test_randint_uint64_wide_range_and_bounds_past_int64():
    top = 2**63 - 1
    x = torch.randint(0, top, (2000,), dtype=torch.uint64, generator=eg())
    assert len(set(x.tolist())) == 2000
    assert max(x.tolist()) > 2**62
    # torch's parser refuses bounds outside int64 (ValueError), for uint64 too
    for low, high in ((0, 2**64 - 1), (2**63, 2**64), (0, 2**63)):
        assert_same_outcome(lambda g, low=low, high=high: torch.randint(
            low, high, (3,), dtype=torch.uint64, generator=g))


# ---------------------------------------------------------------- 12. saved states
def test_saved_state_names_its_cipher_stably(monkeypatch):
    from ember.csprng import ciphers

    g = csprng.create_generator(4, cipher="chacha20")
    state = g.get_state()
    want = torch.rand(8, generator=g)
    fake = type("Fake", (), {"name": "aaa-fake", "keystream": None})()
    monkeypatch.setitem(ciphers._CIPHERS, "aaa-fake", fake)
    h = csprng.create_generator(0)
    h.set_state(state)
    assert h.cipher == "chacha20"
    assert torch.equal(torch.rand(8, generator=h), want)


def test_states_saved_by_version_1_still_load():
    g = csprng.create_generator(4, cipher="chacha20")
    want = torch.rand(8, generator=csprng.create_generator(4, cipher="chacha20"))
    v1 = bytearray(72)  # version 1: the cipher as its index in ("aes128", "chacha20")
    v1[0:4], v1[4], v1[5], v1[6], v1[7] = b"EMBR", 1, 1, 4, 1
    v1[8:24] = g._stream.key
    v1[56:72] = (4).to_bytes(16, "little")
    h = csprng.create_generator(0)
    h.set_state(torch.frombuffer(v1, dtype=torch.uint8))
    assert h.cipher == "chacha20" and h.initial_seed() == 4
    assert torch.equal(torch.rand(8, generator=h), want)


# ---------------------------------------------------------------- 13. datapipes
def test_datapipe_shuffle_in_a_dataloader_is_refused():
    dp = pytest.importorskip("torch.utils.data.datapipes.iter")
    pipe = dp.IterableWrapper(list(range(10))).shuffle()
    loader = torch.utils.data.DataLoader(pipe, batch_size=None, generator=eg())
    with pytest.raises(TypeError, match="Mersenne"):
        list(loader)
    # without a datapipe the loader works as before
    assert len(list(torch.utils.data.DataLoader(list(range(4)), shuffle=True, generator=eg()))) == 4


# ---------------------------------------------------------------- Low: argument rules
@pytest.mark.parametrize("call", [
    lambda g: torch.randint(0, 10, generator=g),
    lambda g: torch.empty(5).random_(0.5, 3.5, generator=g),
    lambda g: torch.empty(5).random_(1.0, 3, generator=g),
    lambda g: torch.multinomial(torch.ones(3), 2.0, generator=g),
    lambda g: torch.rand((2, 3), names=("a", "b"), generator=g),
    lambda g: torch.randn((2, 3), names=("a", "b"), generator=g),
    lambda g: torch.empty(3, dtype=torch.complex64).bernoulli_(0.5, generator=g),
    lambda g: torch.empty(3, dtype=torch.complex64).exponential_(generator=g),
    lambda g: torch.empty(3, dtype=torch.complex64).geometric_(0.5, generator=g),
    lambda g: torch.empty(3, dtype=torch.complex64).cauchy_(generator=g),
], ids=["randint-no-size", "random_-floats", "random_-float-from", "multinomial-float",
        "rand-names", "randn-names", "complex-bernoulli_", "complex-exponential_",
        "complex-geometric_", "complex-cauchy_"])
def test_argument_rules_follow_torch(call):
    assert_same_outcome(call)


@pytest.mark.parametrize("call", [
    lambda g: torch.randint(0, 10, size=(3,), generator=g),
    lambda g: torch.empty(5).random_(torch.tensor(1), torch.tensor(4), generator=g),
    lambda g: torch.empty(5).random_(to=5, generator=g),
    lambda g: torch.multinomial(torch.ones(3), torch.tensor(2), generator=g),
])
def test_calls_torch_accepts_still_work(call):
    mine, theirs = assert_same_outcome(call)
    assert mine.shape == theirs.shape and mine.dtype == theirs.dtype


@pytest.mark.parametrize("index", [1.5, "7", None])
def test_fold_in_refuses_what_manual_seed_refuses(index):
    with pytest.raises(TypeError):
        eg().fold_in(index)
    assert eg().fold_in(7).counter == 0


def test_normal_on_a_conjugate_view_like_torch():
    for gen in (eg(), tg()):
        x = torch.zeros(64, dtype=torch.complex64).conj()
        x.normal_(3.0, 2.0, generator=gen)
        assert x.is_conj()
        assert abs(float(x.real.mean()) - 3.0) < 0.6 and abs(float(x.imag.mean()) - 3.0) < 0.6


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_another_thread_holds_a_generator_lock_does_not_deadlock(tmp_path):
    code = textwrap.dedent("""
        import os, threading, time
        import torch, ember.csprng as csprng
        g = csprng.create_generator(1)
        holding, release = threading.Event(), threading.Event()
        def hold():
            with g._stream._lock, g._lock:
                holding.set()
                release.wait()
        t = threading.Thread(target=hold)
        t.start()
        holding.wait()
        pid = os.fork()
        if pid == 0:
            torch.rand(4, generator=g)
            g.spawn(1)
            os._exit(0)
        release.set()
        t.join()
        for _ in range(200):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("child exit", os.waitstatus_to_exitcode(status))
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            print("child deadlocked")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, env=env, timeout=120)
    assert res.stdout.strip() == "child exit 0", res.stdout + res.stderr


def test_generator_still_usable_from_several_threads():
    g = eg()
    outs = []
    threads = [threading.Thread(target=lambda: outs.append(torch.rand(100, generator=g)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({tuple(o.tolist()) for o in outs}) == 4


# ---------------------------------------------------------------- early-bound sparse_
def test_sparse_init_bound_before_ember_was_imported_draws_from_ember():
    code = textwrap.dedent("""
        import warnings
        import torch
        from torch.nn.init import sparse_ as early_sparse_
        early_sparse = torch.nn.init.sparse
        import ember.csprng as csprng
        warnings.simplefilter("ignore")
        module = torch.nn.init.sparse_(torch.empty(8, 4), 0.5, generator=csprng.create_generator(0))
        print("module call zeros", int((module == 0).sum()))
        for fn in (early_sparse_, early_sparse):
            state = torch.default_generator.get_state().clone()
            w = fn(torch.empty(8, 4), 0.5, generator=csprng.create_generator(0))
            print("same as the module call", torch.equal(w, module))
            print("mt untouched", torch.equal(state, torch.default_generator.get_state()))
        torch.manual_seed(1)  # torch's own sparse_ takes its zero pattern from the global generator
        a = early_sparse_(torch.empty(8, 4), 0.5, generator=torch.Generator().manual_seed(0))
        from ember.csprng import torch_adapter
        torch_adapter.uninstall()
        torch.manual_seed(1)
        b = torch.nn.init.sparse_(torch.empty(8, 4), 0.5, generator=torch.Generator().manual_seed(0))
        print("torch generator as torch", torch.equal(a, b))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.stdout.split("\n")[:-1] == [
        "module call zeros 16", "same as the module call True", "mt untouched True",
        "same as the module call True", "mt untouched True", "torch generator as torch True"], \
        res.stdout + res.stderr


def test_sparse_init_bound_before_ember_was_imported_draws_from_ember_when_compiled():
    # torch.compile inlines the early-bound function: its zero pattern must still come from the
    # ember generator (the same as an eager call's), never from torch's global Mersenne Twister
    code = textwrap.dedent("""
        import torch
        from torch.nn.init import sparse_ as early_sparse_
        import ember.csprng as csprng
        def init(w, g):
            return early_sparse_(w, 0.5, generator=g)
        compiled = torch.compile(init, backend="eager")
        eager = torch.nn.init.sparse_(torch.empty(8, 4), 0.5, generator=csprng.create_generator(3))
        state = torch.default_generator.get_state().clone()
        for _ in range(2):
            w = compiled(torch.empty(8, 4), csprng.create_generator(3))
            print("same as eager", torch.equal(w, eager))
        print("mt untouched", torch.equal(state, torch.default_generator.get_state()))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.stdout.split("\n")[:-1] == [
        "same as eager True", "same as eager True", "mt untouched True"], res.stdout + res.stderr


# ---------------------------------------------------------------- uniform_ bounds
@pytest.mark.parametrize("dtype,a,b", [
    (torch.float16, -1e38, 1e38), (torch.float16, 1e300, 1e301), (torch.bfloat16, 1e300, 1e301),
    (torch.float32, 1e300, 1e301), (torch.float16, -65504, 65504), (torch.float32, -3e38, 3e38),
    (torch.bfloat16, -3e38, 3e38), (torch.float16, 65504, 65520), (torch.float16, 0, 70000),
    (torch.float64, -1.7e308, 1.7e308), (torch.float16, 0, 65504), (torch.float16, -65504, 0),
    (torch.float32, 0, 3.4e38),
])
def test_uniform_bounds_outside_the_dtype_raise_like_torch(dtype, a, b):
    mine, theirs = assert_same_outcome(
        lambda g: torch.empty(1000, dtype=dtype).uniform_(a, b, generator=g))
    if theirs is not None:
        assert bool(mine.isfinite().all())
        assert float(mine.min()) >= a and float(mine.max()) <= b


# ---------------------------------------------------------------- normal's tensor overloads
@pytest.mark.parametrize("call", [
    lambda g: torch.normal(torch.zeros(3, dtype=torch.int64), torch.ones(3), generator=g),
    lambda g: torch.normal(torch.zeros(3), torch.ones(3), generator=g,
                           out=torch.empty(3, dtype=torch.int64)),
    lambda g: torch.normal(torch.zeros(3), 1.0, generator=g, out=torch.empty(3, dtype=torch.int32)),
    lambda g: torch.normal(torch.zeros(3, requires_grad=True), torch.ones(3), generator=g,
                           out=torch.empty(3)),
    lambda g: torch.normal(0.0, torch.ones(3, requires_grad=True), generator=g, out=torch.empty(3)),
    lambda g: torch.normal(torch.zeros(3), torch.ones(3, dtype=torch.int64), generator=g),
    lambda g: torch.normal(torch.zeros(3, dtype=torch.float16), torch.ones(3), generator=g),
    lambda g: torch.normal(torch.zeros(3), torch.ones(3, dtype=torch.float64), generator=g),
], ids=["int-mean", "int-out", "int-out-float-std", "out-mean-grad", "out-std-grad", "int-std",
        "f16-f32", "f32-f64"])
def test_normal_tensor_overloads_dtypes_and_out_like_torch(call):
    mine, theirs = assert_same_outcome(call)
    if theirs is not None:
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape


# ---------------------------------------------------------------- draws from inputs requiring grad
@pytest.mark.parametrize("draw", [
    lambda x, g: torch.bernoulli(x, generator=g),
    lambda x, g: x.bernoulli(generator=g),
    lambda x, g: torch.poisson(x, generator=g),
], ids=["bernoulli", "Tensor.bernoulli", "poisson"])
def test_draws_from_an_input_requiring_grad_give_torchs_zero_gradient(draw):
    for gen in (eg(), tg()):
        x = torch.full((3,), 0.5, requires_grad=True)
        y = draw(x, gen)
        assert y.requires_grad, type(gen)
        (grad,) = torch.autograd.grad((y * 2).sum(), x)
        assert torch.equal(grad, torch.zeros(3)), type(gen)
        with torch.no_grad():
            assert not draw(x, gen).requires_grad


def test_bernoulli_with_float_p_from_an_input_requiring_grad_like_torch():
    for gen in (eg(), tg()):
        x = torch.full((3,), 0.5, requires_grad=True)
        y = torch.bernoulli(x, 0.3, generator=gen)
        assert y.requires_grad
        with pytest.raises(RuntimeError, match="not implemented"):
            y.sum().backward()


@pytest.mark.parametrize("call", [
    lambda g: torch.bernoulli(torch.ones(5), torch.full((5,), 0.2), generator=g),
    lambda g: torch.bernoulli(torch.ones(5, dtype=torch.int64), generator=g),
    lambda g: torch.bernoulli(torch.ones(5, dtype=torch.bool), generator=g),
    lambda g: torch.empty(5).bernoulli_(torch.ones(5, dtype=torch.bool), generator=g),
    lambda g: torch.empty(5).bernoulli_(torch.ones(5, dtype=torch.int64), generator=g),
    lambda g: torch.poisson(torch.ones(3, dtype=torch.int64), generator=g),
    lambda g: torch.poisson(torch.ones(3, dtype=torch.complex64), generator=g),
], ids=["tensor-p", "int-p", "bool-p", "bool-p_", "int-p_", "poisson-int", "poisson-complex"])
def test_bernoulli_and_poisson_argument_types_like_torch(call):
    assert_same_outcome(call)


# ---------------------------------------------------------------- exception classes
@pytest.mark.parametrize("call", [
    lambda g: torch.empty(5, dtype=torch.complex64).log_normal_(generator=g),
    lambda g: torch.empty(5).geometric_(1.0, generator=g),
    lambda g: torch.empty(5).geometric_(0.0, generator=g),
    lambda g: torch.empty(5, dtype=torch.int64).exponential_(generator=g),
    lambda g: torch.empty(5, dtype=torch.int64).cauchy_(generator=g),
    lambda g: torch.empty(5, dtype=torch.int64).log_normal_(generator=g),
    lambda g: torch.randperm(5, dtype=torch.bool, generator=g),
    lambda g: torch.randperm(5, dtype=torch.uint16, generator=g),
    lambda g: torch.randperm(5, dtype=torch.uint32, generator=g),
    lambda g: torch.randperm(5, dtype=torch.uint64, generator=g),
    lambda g: torch.randperm(5, dtype=torch.complex64, generator=g),
    lambda g: torch.rand(3, dtype=torch.float8_e4m3fn, generator=g),
    lambda g: torch.randn(3, dtype=torch.float8_e5m2, generator=g),
    lambda g: torch.empty(3, dtype=torch.float8_e4m3fn).uniform_(generator=g),
    lambda g: torch.multinomial(torch.ones(3, dtype=torch.int64), 1, generator=g),
    lambda g: torch.multinomial(torch.ones(4), 2, generator=g, out=torch.empty(2, dtype=torch.int32)),
    lambda g: torch.rand_like(torch.ones(3), pin_memory=True, generator=g),
    lambda g: torch.rand(3, layout=torch.sparse_coo, generator=g),
    lambda g: torch.randperm(5, layout=torch.sparse_coo, generator=g),
    lambda g: torch.ones(3).to_sparse().uniform_(generator=g),
    lambda g: torch.rand_like(torch.ones(3).to_sparse(), generator=g),
], ids=["log_normal_-complex", "geometric_-1", "geometric_-0", "exponential_-int", "cauchy_-int",
        "log_normal_-int", "randperm-bool", "randperm-uint16", "randperm-uint32", "randperm-uint64",
        "randperm-complex", "rand-float8", "randn-float8", "uniform_-float8", "multinomial-int",
        "multinomial-out-int32", "rand_like-pin_memory", "rand-sparse", "randperm-sparse",
        "uniform_-sparse", "rand_like-sparse"])
def test_refusals_raise_torchs_exception_class(call):
    assert_same_outcome(call)


@pytest.mark.parametrize("call", [
    lambda g: torch.multinomial(torch.tensor([1.0, 0.0, 0.0]), 2, generator=g),
    lambda g: torch.randperm(300, dtype=torch.bfloat16, generator=g),
], ids=["multinomial-few-nonzero", "randperm-bfloat16"])
def test_calls_torch_accepts_succeed_with_its_shape_and_dtype(call):
    mine, theirs = assert_same_outcome(call)
    assert mine.shape == theirs.shape and mine.dtype == theirs.dtype


def test_multinomial_without_replacement_takes_the_non_zero_categories_first():
    for _ in range(5):
        got = torch.multinomial(torch.tensor([0.0, 1.0, 0.0, 2.0]), 3, generator=eg())
        assert sorted(got[:2].tolist()) == [1, 3] and got[2] in (0, 2)


# ---------------------------------------------------------------- wide float ranges
@pytest.mark.parametrize("dtype,low,high", [
    (torch.float32, 0, 2**30), (torch.float64, 0, 2**60), (torch.float16, 0, 65505),
    (torch.float16, -65504, 0), (torch.float16, 0, 65506), (torch.float16, -65505, 0),
    (torch.bfloat16, -(2**40), 2**40), (torch.float64, -(2**63), 2**63 - 1),
])
def test_random_float_ranges_past_the_exact_integers_like_torch(dtype, low, high):
    for call in (lambda g: torch.empty(4000, dtype=dtype).random_(low, high, generator=g),
                 lambda g: torch.randint(low, high, (4000,), dtype=dtype, generator=g)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mine, theirs = assert_same_outcome(call)
        if theirs is not None:
            assert any("out of bounds" in str(w.message) for w in caught)
            assert mine.dtype == theirs.dtype
            assert float(mine.min()) >= low and float(mine.max()) <= high
            assert float(mine.max() - mine.min()) > (high - low) / 2  # spread over the range


# ---------------------------------------------------------------- meta and fake tensors
_ABSTRACT_CALLS = {
    "rand": lambda g: torch.rand(3, generator=g),
    "randn": lambda g: torch.randn(2, 3, generator=g),
    "randint": lambda g: torch.randint(0, 5, (3,), generator=g),
    "randperm": lambda g: torch.randperm(4, generator=g),
    "normal-size": lambda g: torch.normal(0.0, 1.0, (3,), generator=g),
    "normal_": lambda g: torch.empty(3).normal_(generator=g),
    "uniform_-f16": lambda g: torch.empty(3, dtype=torch.float16).uniform_(-2, 2, generator=g),
    "normal-tensors": lambda g: torch.normal(torch.zeros(3), torch.ones(3), generator=g),
    "bernoulli": lambda g: torch.bernoulli(torch.full((3,), 0.5), generator=g),
    "poisson": lambda g: torch.poisson(torch.ones(3), generator=g),
    "multinomial": lambda g: torch.multinomial(torch.ones(2, 4), 2, generator=g),
    "rand_like": lambda g: torch.rand_like(torch.empty(2, 2), generator=g),
    "kaiming": lambda g: torch.nn.init.kaiming_uniform_(torch.empty(3, 3), generator=g),
}


def _meta(r):
    return (tuple(r.shape), r.dtype, r.device.type, type(r).__name__)


@pytest.mark.parametrize("name", sorted(_ABSTRACT_CALLS))
def test_draws_under_the_meta_device_context_like_torch(name):
    call = _ABSTRACT_CALLS[name]
    got = []
    for gen in (eg(), tg()):
        with torch.device("meta"):
            mine = _outcome(call, gen)
        got.append(mine[0] if mine[0] != "ok" else _meta(mine[1]))
    assert got[0] == got[1]
    g = eg()
    with torch.device("meta"):
        status, res = _outcome(call, g)
    if status == "ok" and res.is_meta:
        assert g.counter == 0  # nothing drawn for a meta tensor


def test_default_device_meta_like_torch():
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        got = [torch.rand(3, generator=gen).device.type for gen in (eg(), tg())]
        plain = torch.randperm(3).device.type  # importing ember keeps torch's own calls on meta
    finally:  # None, not "cpu": a cpu default would leave a device mode on for later tests
        torch.set_default_device(None if before.type == "cpu" else before)
    assert got == ["meta", "meta"] and plain == "meta"


def test_compile_under_a_device_context_still_traces():
    from ember.csprng import ops

    def f(x, state):
        noise, state = ops.sample(state, "normal_", x.shape, 0.0, 1.0)
        return x + noise, state

    state = ops.state_of(eg())
    torch._dynamo.reset()
    with torch.device("cpu"):
        out, _ = torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(3), state)
    assert out.shape == (3,)


def test_explicit_meta_device_draws_nothing():
    g = eg()
    out = torch.rand(1 << 24, device="meta", generator=g)
    assert out.is_meta and out.shape == (1 << 24,) and g.counter == 0
    x = torch.empty(1 << 24, device="meta").normal_(generator=g)
    assert x.is_meta and g.counter == 0


@pytest.mark.parametrize("name", sorted(_ABSTRACT_CALLS))
def test_draws_under_fake_tensor_mode_like_torch(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    call = _ABSTRACT_CALLS[name]
    got = []
    for gen in (eg(), tg()):
        with FakeTensorMode():
            mine = _outcome(call, gen)
        got.append(mine[0] if mine[0] != "ok" else _meta(mine[1]))
    assert got[0] == got[1]


# ---------------------------------------------------------------- low-severity argument rules
def _grad_out(leaf: bool) -> torch.Tensor:
    w = torch.ones(4, requires_grad=True)
    return w if leaf else w * 2


@pytest.mark.parametrize("call", [
    lambda g: torch.rand(generator=g),
    lambda g: torch.randn(generator=g),
    lambda g: torch.empty(3).uniform_("2", 3, generator=g),
    lambda g: torch.empty(3).normal_("2", 3, generator=g),
    lambda g: torch.empty(3, dtype=torch.int64).random_(0, 2**63, generator=g),
    lambda g: torch.empty(3, dtype=torch.int64).random_(2**63, generator=g),
    lambda g: torch.randint(0, 2**63, (3,), generator=g),
    lambda g: torch.randint(0, 2**63, (3,), dtype=torch.uint64, generator=g),
    lambda g: torch.rand(4, out=_grad_out(False), generator=g),
    lambda g: torch.randn(4, out=_grad_out(False), generator=g),
    lambda g: torch.rand(4, out=_grad_out(True), generator=g),
], ids=["rand-no-size", "randn-no-size", "uniform_-str", "normal_-str", "random_-2**63",
        "random_-to-2**63", "randint-2**63", "randint-uint64-2**63", "rand-out-nonleaf-grad",
        "randn-out-nonleaf-grad", "rand-out-leaf-grad"])
def test_low_severity_argument_rules_follow_torch(call):
    assert_same_outcome(call)


@pytest.mark.parametrize("n", [1.5, "2", True, None])
def test_spawn_refuses_what_fold_in_refuses(n):
    with pytest.raises(TypeError):
        eg().spawn(n)
    assert len(eg().spawn(2)) == 2
