"""SWAG: moments, deviation ring, the sampling formula and its covariance, persistence, errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from ember.swa import SWAG


def _tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(2, 1)  # 3 parameters


def _trajectory(model: nn.Module, n: int, spread: float = 3.0, seed: int = 0) -> list[np.ndarray]:
    """Set ``model`` to ``n`` random weight vectors in turn, yielding each (float64 copies)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * spread + 1.0)
        flat = [p.detach().numpy().ravel().astype(np.float64) for p in model.parameters()]
        yield np.concatenate(flat)


def _collected(n: int = 6, max_rank: int = 4, dtype=torch.float64, spread: float = 3.0):
    model = _tiny()
    swag = SWAG(model, max_rank=max_rank, dtype=dtype)
    thetas = []
    for theta in _trajectory(model, n, spread):
        swag.collect(model)
        thetas.append(theta)
    return model, swag, np.array(thetas)


def _reference(thetas: np.ndarray, max_rank: int):
    """Mean, variance and the last K deviations from the running mean, computed with numpy."""
    running = np.cumsum(thetas, axis=0) / np.arange(1, len(thetas) + 1)[:, None]
    deviations = (thetas - running)[-max_rank:]
    return thetas.mean(0), thetas.var(0), deviations


def test_moments_equal_numpy_mean_and_var():
    _, swag, thetas = _collected(n=7, max_rank=4)
    mean, var, deviations = _reference(thetas, 4)
    np.testing.assert_allclose(swag.mean.numpy(), mean, rtol=1e-12)
    np.testing.assert_allclose(swag.variance().numpy(), var, rtol=1e-9)
    np.testing.assert_allclose(swag.deviation_matrix().numpy(), deviations, rtol=1e-9, atol=1e-12)
    assert swag.n_collected == 7 and swag.rank == 4


def test_float32_moments_close_to_numpy():
    _, swag, thetas = _collected(n=5, max_rank=3, dtype=torch.float32)
    mean, var, _ = _reference(thetas, 3)
    np.testing.assert_allclose(swag.mean.numpy(), mean, rtol=1e-6)
    np.testing.assert_allclose(swag.variance().numpy(), var, rtol=1e-4)


def test_sample_follows_the_published_formula_draw_for_draw():
    _, swag, thetas = _collected(n=6, max_rank=4)
    mean, var, deviations = _reference(thetas, 4)
    scale = 0.5
    got = swag.sample(scale, generator=torch.Generator().manual_seed(7)).numpy()
    g = torch.Generator().manual_seed(7)
    z1 = torch.randn(3, generator=g, dtype=torch.float64).numpy()
    z2 = torch.randn(4, generator=g, dtype=torch.float64).numpy()
    expected = mean + np.sqrt(scale) * (np.sqrt(var) * z1 + deviations.T @ z2 / np.sqrt(4 - 1))
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def _covariance_check(samples: np.ndarray, mean: np.ndarray, cov: np.ndarray) -> None:
    n = len(samples)
    emp_mean = samples.mean(0)
    emp_cov = np.cov(samples, rowvar=False)
    se_mean = np.sqrt(np.diag(cov) / n)
    assert np.all(np.abs(emp_mean - mean) < 5 * se_mean), (emp_mean, mean)
    # standard error of a Gaussian sample covariance entry: sqrt((S_ij^2 + S_ii S_jj) / n)
    d = np.diag(cov)
    se_cov = np.sqrt((cov**2 + np.outer(d, d)) / n)
    assert np.all(np.abs(emp_cov - cov) < 5 * se_cov), (emp_cov, cov)


def test_sample_covariance_matches_diag_plus_low_rank():
    _, swag, thetas = _collected(n=6, max_rank=4)
    mean, var, deviations = _reference(thetas, 4)
    scale = 0.5
    cov = scale * (np.diag(var) + deviations.T @ deviations / (4 - 1))
    g = torch.Generator().manual_seed(0)
    samples = np.stack([swag.sample(scale, generator=g).numpy() for _ in range(20_000)])
    _covariance_check(samples, mean, cov)
    # the sqrt(var) (not var) note: with var ~ 9 a var-scaled draw would be 9x too wide
    assert np.all(var > 4)


def test_diag_only_covariance_is_scaled_variance():
    _, swag, thetas = _collected(n=2, max_rank=4)
    mean, var, _ = _reference(thetas, 4)
    g = torch.Generator().manual_seed(1)
    draws = [swag.sample(1.0, diag_only=True, generator=g).numpy() for _ in range(20_000)]
    samples = np.stack(draws)
    _covariance_check(samples, mean, np.diag(var))


def test_scale_zero_gives_the_swa_mean():
    _, swag, thetas = _collected(n=5, max_rank=3)
    assert torch.equal(swag.sample(0.0), swag.mean)
    assert torch.equal(swag.sample(0.0, diag_only=True), swag.mean)
    np.testing.assert_allclose(swag.mean_vector().numpy(), thetas.mean(0), rtol=1e-12)


def test_generator_makes_sampling_reproducible_and_subclasses_work():
    class MyGenerator(torch.Generator):
        pass

    _, swag, _ = _collected()
    a = swag.sample(generator=torch.Generator().manual_seed(3))
    b = swag.sample(generator=torch.Generator().manual_seed(3))
    c = swag.sample(generator=torch.Generator().manual_seed(4))
    sub = MyGenerator()
    sub.manual_seed(3)
    d = swag.sample(generator=sub)
    assert torch.equal(a, b) and torch.equal(a, d) and not torch.equal(a, c)


def test_sample_loads_into_model():
    model, swag, _ = _collected()
    theta = swag.sample(generator=torch.Generator().manual_seed(0), model=model)
    assert torch.equal(model.weight.detach().reshape(-1), theta[:2].float())
    assert torch.equal(model.bias.detach(), theta[2:].float())
    other = _tiny(3)
    swag.load_into(other, swag.mean_vector())
    assert torch.equal(other.bias.detach(), swag.mean[2:].float())
    assert set(swag.unflatten(theta)) == {"weight", "bias"}


def test_collect_accepts_compiled_model():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    swag = SWAG(model, max_rank=2)
    swag.collect(torch.compile(model))
    swag.collect(model)
    assert swag.n_collected == 2


def test_state_dict_round_trip():
    model, swag, _ = _collected(n=6, max_rank=4)
    buffer = io.BytesIO()
    torch.save(swag.state_dict(), buffer)
    buffer.seek(0)
    restored = SWAG(_tiny(9), max_rank=4, dtype=torch.float64)
    restored.load_state_dict(torch.load(buffer))
    assert restored.n_collected == 6
    for s in (swag, restored):
        s.collect(model)  # both continue identically, ring position included
    a = swag.sample(generator=torch.Generator().manual_seed(5))
    b = restored.sample(generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    assert torch.equal(swag.deviation_matrix(), restored.deviation_matrix())


def test_memory_matches_the_stated_formula():
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 3))
    swag = SWAG(model, max_rank=5)
    p = sum(t.numel() for t in model.parameters())
    held = sum(t.numel() * t.element_size() for t in (swag.mean, swag.sq_mean, swag.deviations))
    assert swag.memory_bytes == (2 + 5) * p * 4 == held


def test_bad_input_errors_name_the_problem():
    model = _tiny()
    swag = SWAG(model, max_rank=3)
    with pytest.raises(RuntimeError, match="before collect"):
        swag.sample()
    with pytest.raises(ValueError, match="max_rank"):
        SWAG(model, max_rank=0)
    with pytest.raises(ValueError, match="floating-point"):
        SWAG(model, dtype=torch.int64)
    with pytest.raises(ValueError, match="does not match"):
        swag.collect(nn.Linear(3, 1))
    with pytest.raises(ValueError, match="'weight' has shape"):
        swag.collect(nn.Linear(1, 2))
    swag.collect(model)
    with pytest.raises(ValueError, match="at least 2 collected"):
        swag.sample()
    swag.sample(diag_only=True)  # one model is enough for the diagonal part
    with pytest.raises(ValueError, match="scale"):
        swag.sample(-1.0, diag_only=True)
    with pytest.raises(ValueError, match="flat vector of 3"):
        swag.load_into(model, torch.zeros(4))
    with pytest.raises(ValueError, match="different parameters"):
        SWAG(nn.Linear(3, 1), max_rank=3).load_state_dict(swag.state_dict())
    with pytest.raises(ValueError, match="max_rank"):
        SWAG(model, max_rank=2).load_state_dict(swag.state_dict())


def test_statistics_live_on_the_chosen_device_and_dtype():
    model = _tiny()  # P = 3
    swag = SWAG(model, max_rank=4, device="cpu", dtype=torch.float64)
    for t in (swag.mean, swag.sq_mean, swag.deviations):
        assert t.device == torch.device("cpu") and t.dtype == torch.float64
    assert swag.memory_bytes == (2 + 4) * 3 * 8  # hand count: 144 bytes
    held = sum(t.numel() * t.element_size() for t in (swag.mean, swag.sq_mean, swag.deviations))
    assert held == 144
    swag.collect(model)
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    torch.testing.assert_close(swag.mean, expected)
