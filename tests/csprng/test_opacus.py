"""Opacus's secure mode on ember: ``provide_torchcsprng()`` and DP-SGD drawing only from ember.

The block counts come from docs/csprng-stream.md: a float32 ``normal``/``randn`` of ``n`` values
takes ``P = ceil(n/2)`` pairs of 4-byte words, so ``ceil(8P/16)`` blocks; a float32 ``rand`` of
``n`` values one 4-byte word each, so ``ceil(4n/16)`` blocks; ``random_()`` on an int64 scalar one
8-byte word, so one block.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import ember.csprng as csprng
from ember.csprng import torchcsprng as shim

opacus = pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402
from opacus.optimizers.optimizer import _generate_noise  # noqa: E402

stats = pytest.importorskip("scipy.stats")


def _normal_blocks(n: int) -> int:
    return math.ceil(8 * math.ceil(n / 2) / 16)


def _rand_blocks(n: int) -> int:
    return math.ceil(4 * n / 16)


def _secure_noise_blocks(n: int) -> int:
    """Opacus's secure _generate_noise: one (1, 1) normal thrown away, then four of n values."""
    return _normal_blocks(1) + 4 * _normal_blocks(n)


@pytest.fixture
def provided():
    """``import torchcsprng`` resolves to ember for the test, and is removed afterwards."""
    before = sys.modules.get("torchcsprng")
    assert before is None or before is shim, "a real torchcsprng is imported in the test process"
    yield csprng.provide_torchcsprng()
    if before is None:
        sys.modules.pop("torchcsprng", None)


def _run(code: str, *, extra_path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=120)


# ---------------------------------------------------------------------- provide_torchcsprng
def test_provide_makes_import_torchcsprng_resolve_to_ember(provided):
    import torchcsprng

    assert torchcsprng is provided is shim
    assert csprng.provide_torchcsprng() is shim  # a second call is harmless
    g = torchcsprng.create_random_device_generator("/dev/urandom")
    assert csprng.is_generator(g) and g.kind == "random_device" and not g.reproducible
    assert torchcsprng.supports_cuda() == torch.cuda.is_available()
    assert torchcsprng.__version__.startswith("0.2")


def test_version_attributes_and_module_as_torchcsprng_has_them():
    # torchcsprng's own test_version reads both attributes; its package had a version module
    done = _run("""
        import ember.csprng, warnings
        ember.csprng.provide_torchcsprng()
        import torchcsprng
        from torchcsprng.version import __version__, git_version
        print(__version__ == torchcsprng.__version__, git_version == torchcsprng.git_version,
              bool(git_version))
    """)
    assert done.stdout.split() == ["True", "True", "True"], done.stderr


def test_version_submodule_is_reachable_as_an_attribute_too():
    # a package exposes an imported submodule as its attribute: every import form reaches it
    done = _run("""
        import ember.csprng
        ember.csprng.provide_torchcsprng()
        import torchcsprng.version as v
        from torchcsprng import version
        import torchcsprng
        print(v is version is torchcsprng.version, v.__version__ == torchcsprng.__version__,
              v.git_version == torchcsprng.git_version)
    """)
    assert done.stdout.split() == ["True", "True", "True"], done.stderr


def test_without_provide_torchcsprng_is_not_importable():
    r = _run("""
        import ember.csprng
        try:
            import torchcsprng
        except ImportError:
            print("absent")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "absent"


def test_a_real_torchcsprng_on_the_path_is_never_shadowed(tmp_path):
    fake = tmp_path / "torchcsprng"
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    r = _run("""
        import ember.csprng as c
        try:
            c.provide_torchcsprng()
        except c.torchcsprng.TorchcsprngConflict as e:
            print("refused:", e)
        import torchcsprng
        print("real" if getattr(torchcsprng, "REAL", False) else "shadowed")
    """, extra_path=str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("refused:") and str(fake) in lines[0]
    assert lines[-1] == "real"


def test_an_already_imported_torchcsprng_is_never_replaced():
    r = _run("""
        import sys, types
        other = types.ModuleType("torchcsprng")
        sys.modules["torchcsprng"] = other
        import ember.csprng as c
        try:
            c.provide_torchcsprng()
            print("replaced")
        except ImportError as e:
            print("refused", sys.modules["torchcsprng"] is other)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "refused True"


def test_random_device_tokens():
    for token in (None, "default", "/dev/urandom", "/dev/random", "rdrand"):
        assert shim.create_random_device_generator(token).kind == "random_device"
    with pytest.raises(ValueError, match="create_mt19937_generator"):
        shim.create_random_device_generator("mt19937")
    with pytest.raises(ValueError, match="create_mt19937_generator"):
        shim.create_random_device_generator("1234")
    with pytest.raises(ValueError, match="unknown random-device token"):
        shim.create_random_device_generator("/dev/zero")
    with pytest.raises(TypeError, match="token"):
        shim.create_random_device_generator(5)


def test_mt19937_and_encrypt_are_embers():
    a = torch.empty(64, dtype=torch.int64).random_(generator=shim.create_mt19937_generator(42))
    b = torch.empty(64, dtype=torch.int64).random_(generator=csprng.create_mt19937_generator(42))
    assert torch.equal(a, b)
    data = torch.arange(40, dtype=torch.uint8)
    key = torch.arange(16, dtype=torch.uint8)
    out1, out2 = torch.empty(48, dtype=torch.uint8), torch.empty(48, dtype=torch.uint8)
    shim.encrypt(data, out1, key, "aes128", "ctr")
    csprng.encrypt(data, out2, key, "aes128", "ctr")
    assert torch.equal(out1, out2)
    back = torch.empty(40, dtype=torch.uint8)
    shim.decrypt(out1, back, key, "aes128", "ctr")
    assert torch.equal(back, data)


# ---------------------------------------------------------------------- Opacus secure mode
def _secure_engine() -> PrivacyEngine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine(accountant="rdp", secure_mode=True)


def _moved_inherited_state(g) -> torch.Tensor | None:
    """The inherited torch.Generator state, if ember's generator still has one."""
    return torch.Generator.get_state(g).clone() if isinstance(g, torch.Generator) else None


@pytest.mark.parametrize("workers", [0, 2])
def test_secure_mode_trains_and_draws_only_from_ember(provided, workers):
    torch.manual_seed(0)
    n, batch, epochs = 96, 24, 2
    model = nn.Sequential(nn.Linear(10, 6), nn.Tanh(), nn.Linear(6, 3))
    data = torch.utils.data.TensorDataset(torch.randn(n, 10), torch.randint(0, 3, (n,)))
    loader = torch.utils.data.DataLoader(data, batch_size=batch, num_workers=workers)
    engine = _secure_engine()
    g = engine.secure_rng
    assert csprng.is_generator(g) and g.kind == "random_device"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.1,
        max_grad_norm=1.0)
    assert optimizer.generator is g and loader.batch_sampler.generator is g
    global_state = torch.get_rng_state()
    inherited = _moved_inherited_state(g)
    start = g.counter
    steps = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's backward-hook notice on inputs without grad
        for _ in range(epochs):
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                steps += 1
    assert steps == epochs * (n // batch)
    sizes = [p.numel() for p in model.parameters()]
    per_step = _rand_blocks(n) + sum(_secure_noise_blocks(s) for s in sizes)
    per_epoch = 1  # the DataLoader iterator's base seed, drawn with the loader's generator
    assert g.counter - start == steps * per_step + epochs * per_epoch
    assert torch.equal(torch.get_rng_state(), global_state), "torch's global generator moved"
    if inherited is not None:
        assert torch.equal(torch.Generator.get_state(g), inherited), "inherited MT state moved"
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    eps = engine.get_epsilon(1e-5)
    assert 0 < eps < float("inf")


def test_poisson_batches_are_embers_draws(provided):
    """With a seeded ember generator in the engine, the sampled batches are exactly
    ``torch.rand(n, generator=g) < q`` replayed from the same seed."""
    torch.manual_seed(0)
    n, batch = 50, 10
    data = torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float32)[:, None],
                                          torch.zeros(n, dtype=torch.int64))
    engine = _secure_engine()
    engine.secure_rng = csprng.create_generator(123)
    model = nn.Linear(1, 2)
    _, _, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=batch),
        noise_multiplier=1.0, max_grad_norm=1.0)
    got = [x[:, 0].long().tolist() for x, _ in loader]
    replay = csprng.create_generator(123)
    torch.empty((), dtype=torch.int64).random_(generator=replay)  # the iterator's base seed
    expected = [torch.nonzero(torch.rand(n, generator=replay) < batch / n).flatten().tolist()
                for _ in range(n // batch)]
    assert got == expected


def test_generate_noise_secure_mode_has_the_stated_std():
    g = csprng.create_generator(2024)
    std, n = 0.7, 200_000
    reference = torch.zeros(n)
    start = g.counter
    noise = _generate_noise(std, reference, generator=g, secure_mode=True)
    assert g.counter - start == _secure_noise_blocks(n)
    assert noise.shape == reference.shape and noise.dtype == torch.float32
    x = noise.double().numpy()
    assert stats.kstest(x, "norm", args=(0.0, std)).pvalue > 1e-3
    # sample variance: (n - 1) s^2 / std^2 is chi-square with n - 1 degrees of freedom
    chi2 = (n - 1) * x.var(ddof=1) / std**2
    p = stats.chi2.cdf(chi2, n - 1)
    assert 1e-3 < p < 1 - 1e-3
    assert abs(x.mean()) < 5 * std / math.sqrt(n)


def test_noise_added_in_a_dp_step_has_the_stated_std(provided):
    """Zero per-example gradients: the step moves the weights by the noise alone, scaled by
    lr / expected batch size, so the noise is recovered exactly and tested against its std."""
    torch.manual_seed(0)
    n, batch, sigma, clip = 64, 16, 1.3, 0.5
    model = nn.Linear(500, 200)
    data = torch.utils.data.TensorDataset(torch.randn(n, 500), torch.zeros(n, dtype=torch.int64))
    engine = _secure_engine()
    engine.secure_rng = csprng.create_generator(7)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=batch),
        noise_multiplier=sigma, max_grad_norm=clip)
    weight = model._module.weight
    before = weight.detach().clone()
    x, _ = next(iter(loader))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (model(x) * 0.0).sum().backward()
    optimizer.step()
    noise = (before - weight.detach()).double() * optimizer.expected_batch_size
    sample = noise.flatten().numpy()
    assert stats.kstest(sample, "norm", args=(0.0, sigma * clip)).pvalue > 1e-3
    chi2 = (sample.size - 1) * sample.var(ddof=1) / (sigma * clip) ** 2
    assert 1e-3 < stats.chi2.cdf(chi2, sample.size - 1) < 1 - 1e-3
