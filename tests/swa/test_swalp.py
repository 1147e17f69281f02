"""SWALP: block-floating-point quantizer, low-precision training hooks and optimizer wrapper."""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import ember.csprng as csprng
from ember.swa import SWA, update_bn
from ember.swa.quantize import BlockQuantizer, block_quantize
from ember.swa.swalp import LowPrecisionOptimizer, quantize_activations_


def _numpy_bfp_nearest(x: np.ndarray, wl: int) -> np.ndarray:
    """Independent reference of the BFP formula (whole tensor one block), numpy round-half-even."""
    m = np.max(np.abs(x))
    if m == 0:
        return np.zeros_like(x)
    e = math.floor(math.log2(m))
    step = 2.0 ** (e - (wl - 2))
    q = np.clip(np.round(x / step), -(2 ** (wl - 1)), 2 ** (wl - 1) - 1)
    return q * step


def _on_grid(x: torch.Tensor, wl: int) -> bool:
    """Every value is an integer mantissa in [-2^(wl-1), 2^(wl-1) - 1] times one power-of-two step.

    The step is read off the quantized max |x|: 2^(floor(log2 max) - (wl - 2)), or half that when
    the max is the negative end -2^(wl-1) * step (one binade higher than the original max).
    """
    m = x.abs().max().item()
    if m == 0:
        return True
    step = 2.0 ** (math.floor(math.log2(m)) - (wl - 2))
    for s in (step, step / 2):
        k = x.double() / s
        if bool((k == k.round()).all() and k.min() >= -(2 ** (wl - 1)) and k.max() <= 2 ** (wl - 1) - 1):
            return True
    return False


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_representable_values_are_exact(rounding):
    wl = 5  # mantissas -16..15; with max |x| = 12 (e = 3) the step is 2^(3-3) = 1
    x = torch.tensor([12.0, -16.0 + 4, 0.0, 3.0, -7.0, 1.0])
    g = torch.Generator().manual_seed(0)
    assert torch.equal(block_quantize(x, wl, rounding=rounding, generator=g), x)


def test_nearest_matches_numpy_reference():
    g = torch.Generator().manual_seed(1)
    for wl in (2, 3, 4, 8, 12):
        for scale in (1e-3, 1.0, 37.0):
            x = torch.randn(200, generator=g, dtype=torch.float64) * scale
            ours = block_quantize(x, wl, rounding="nearest").numpy()
            np.testing.assert_array_equal(ours, _numpy_bfp_nearest(x.numpy(), wl))


def test_extreme_magnitudes_float32():
    for scale in (1e-38, 3e-39, 1e38):  # near float32's smallest normal, subnormal, near its max
        x = torch.randn(64, generator=torch.Generator().manual_seed(4)) * scale
        x32 = x.to(torch.float32)
        ours = block_quantize(x32, 8, rounding="nearest")
        assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
        ref = _numpy_bfp_nearest(x32.double().numpy(), 8)
        np.testing.assert_array_equal(ours.double().numpy(), ref)


def test_per_row_and_fixed_blocks_match_reference_per_block():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 9, generator=g, dtype=torch.float64)
    x[2] *= 100.0
    rows = block_quantize(x, 6, dim=0, rounding="nearest").numpy()
    for i in range(5):
        np.testing.assert_array_equal(rows[i], _numpy_bfp_nearest(x[i].numpy(), 6))
    cols = block_quantize(x, 6, dim=1, rounding="nearest").numpy()
    for j in range(9):
        np.testing.assert_array_equal(cols[:, j], _numpy_bfp_nearest(x[:, j].numpy(), 6))
    flat = x.reshape(-1)
    blocks = block_quantize(x, 4, block_size=7, rounding="nearest").reshape(-1).numpy()
    for s in range(0, flat.numel(), 7):  # the last block is shorter (45 = 6*7 + 3)
        np.testing.assert_array_equal(blocks[s:s + 7], _numpy_bfp_nearest(flat[s:s + 7].numpy(), 4))


def test_stochastic_rounding_is_unbiased():
    # Each value lies between two grid points a step apart; its rounding is Bernoulli, so the mean
    # of n draws has std <= step / (2 sqrt(n)). Allow 5 sigma per value (false alarm ~ 6e-7 each).
    wl, n = 4, 20000
    x = torch.tensor([6.0, 0.3, -0.7, 2.45, -3.9, 5.01, 1.5])  # max 6: e = 2, step 2^(2-2) = 1
    g = torch.Generator().manual_seed(3)
    draws = block_quantize(x.expand(n, -1).contiguous(), wl, generator=g)
    assert set(draws.unique().tolist()) <= set(range(-8, 8))
    assert (draws - x).abs().max() < 1.0  # only the two neighbours are ever chosen
    bound = 5 * 0.5 / math.sqrt(n)
    assert (draws.mean(0) - x).abs().max() < bound


def test_saturation_and_zero_blocks():
    # Nearest rounding of the max can round up past the top mantissa: 7.9 at wl=4 (step 1) -> 8,
    # which saturates to 7; negatives reach -8.
    x = torch.tensor([7.9, -7.9, 0.2])
    assert torch.equal(block_quantize(x, 4, rounding="nearest"), torch.tensor([7.0, -8.0, 0.0]))
    z = torch.zeros(3, 4)
    z[1] = torch.tensor([1.0, -2.0, 3.5, 0.25])
    out = block_quantize(z, 3, dim=0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out[0], torch.zeros(4)) and torch.equal(out[2], torch.zeros(4))
    assert torch.equal(block_quantize(torch.zeros(5), 8), torch.zeros(5))


def test_generator_reproducibility_torch_and_csprng():
    x = torch.randn(1000)
    a = block_quantize(x, 4, generator=torch.Generator().manual_seed(7))
    b = block_quantize(x, 4, generator=torch.Generator().manual_seed(7))
    c = block_quantize(x, 4, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    e1 = block_quantize(x, 4, generator=csprng.create_generator(11))
    e2 = block_quantize(x, 4, generator=csprng.create_generator(11))
    e3 = block_quantize(x, 4, generator=csprng.create_generator(12))
    assert torch.equal(e1, e2) and not torch.equal(e1, e3)
    assert _on_grid(e1, 4)


@pytest.mark.parametrize("wl", [1, 0, -3, 2.5, True])
def test_word_length_below_two_is_an_error(wl):
    with pytest.raises(ValueError, match="word length"):
        block_quantize(torch.ones(3), wl)
    with pytest.raises(ValueError, match="word length"):
        BlockQuantizer(wl=wl)


def test_other_bad_input_errors():
    with pytest.raises(ValueError, match="non-finite"):
        block_quantize(torch.tensor([1.0, float("nan")]), 8)
    with pytest.raises(ValueError, match="rounding"):
        block_quantize(torch.ones(2), 8, rounding="up")
    with pytest.raises(ValueError, match="at most one"):
        block_quantize(torch.ones(2, 2), 8, dim=0, block_size=2)
    with pytest.raises(TypeError, match="floating-point"):
        block_quantize(torch.ones(2, dtype=torch.int64), 8)


def test_optimizer_keeps_weights_and_momentum_on_grid():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    q = BlockQuantizer(wl=8)
    opt = LowPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                weight=q, grad=q, momentum=q,
                                generator=torch.Generator().manual_seed(0))
    opt.quantize_weights_()
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    for _ in range(5):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for p in model.parameters():
        assert _on_grid(p.detach(), 8)
        buf = opt.state[p]["momentum_buffer"]
        assert _on_grid(buf, 8)
    # The state dict round-trips through a fresh wrapper (momentum buffers included).
    model2 = nn.Linear(6, 3)
    opt2 = LowPrecisionOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9), weight=q)
    opt2.load_state_dict(opt.state_dict())
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(opt.state[p]["momentum_buffer"], opt2.state[p2]["momentum_buffer"])


def test_activation_and_error_quantization_hooks():
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    seen = {}
    model[1].register_forward_hook(lambda m, i, o: seen.__setitem__("act", i[0].detach()))
    h = quantize_activations_(model, BlockQuantizer(wl=3), BlockQuantizer(wl=3),
                              generator=torch.Generator().manual_seed(0))
    x = torch.randn(8, 4, requires_grad=True)
    out = model(x)
    assert _on_grid(seen["act"], 3) and _on_grid(out.detach(), 3)
    out.sum().backward()
    # Error quantization: a bias-free Linear fed the identity has weight.grad = (d loss/d out)^T,
    # so the gradient that reached it is visible exactly; nearest rounding makes it deterministic.
    lin = nn.Linear(4, 5, bias=False)
    quantize_activations_(lin, None, BlockQuantizer(wl=3, rounding="nearest"))
    c = torch.randn(4, 5)
    (lin(torch.eye(4)) * c).sum().backward()
    assert torch.equal(lin.weight.grad.T, block_quantize(c, 3, rounding="nearest"))
    assert not torch.equal(lin.weight.grad.T, c)
    h.remove()
    y = model(torch.randn(8, 4))
    assert not _on_grid(y.detach(), 3)  # full precision again


def _digits_like(n: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 10, generator=g) * 2
    y = torch.randint(0, 4, (n,), generator=g)
    return centers[y] + 0.5 * torch.randn(n, 10, generator=g), y


def test_short_swalp_training_run_learns_and_averages():
    torch.manual_seed(0)
    x, y = _digits_like()
    model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    gen = csprng.create_generator(5)
    q = BlockQuantizer(wl=8)
    quantize_activations_(model, q, q, generator=gen)
    opt = LowPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                weight=q, grad=q, momentum=q, generator=gen)
    opt.quantize_weights_()
    swa = None
    for epoch in range(12):
        for i in range(0, len(x), 32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32]).backward()
            opt.step()
        if epoch >= 6:
            swa = SWA(model) if swa is None else swa
            swa.update(model)
    update_bn([(x[i:i + 32],) for i in range(0, len(x), 32)], swa.module)
    swa.module.eval()
    with torch.no_grad():
        acc = (swa.module(x).argmax(1) == y).float().mean().item()
    assert acc > 0.9
    assert any(not _on_grid(p.detach(), 8) for p in swa.module.parameters())  # average is full precision


def test_lowprecision_optimizer_under_fit():
    from ember.train import TrainConfig, fit

    torch.manual_seed(0)
    x, y = _digits_like(128)
    loader = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 128, 32)]
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    q = BlockQuantizer(wl=8)
    opt = LowPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                weight=q, grad=q, momentum=q, generator=torch.Generator().manual_seed(0))
    opt.quantize_weights_()
    result = fit(model, opt, loader, TrainConfig(epochs=3, swa_start=1, swa_lr=0.02, seed=0))
    for p in model.parameters():
        assert _on_grid(p.detach(), 8)
    assert result is not None
    with torch.no_grad():
        assert (model(x).argmax(1) == y).float().mean().item() > 0.5


def test_bench_experiment_quick_structure():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "swa_family_swalp.py"
    spec = importlib.util.spec_from_file_location("swa_family_swalp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert "8-bit SWALP" in mod.PROTOCOL
    rows = mod.experiment(quick=True, seeds=[0])
    assert {(r["method"], r["test_set"]) for r in rows} == {
        (m, t) for m in mod.METHODS for t in ("clean", "pixel noise", "rotation")}
    for r in rows:
        assert r["experiment"] == "swalp" and r["n_seeds"] == 1
        for k in ("accuracy", "nll", "ece", "wall_s"):
            assert math.isfinite(r[f"{k}_mean"]) and math.isfinite(r[f"{k}_std"])
        assert 0.0 <= r["accuracy_mean"] <= 1.0 and r["nll_mean"] >= 0.0


def test_adam_second_moment_not_flushed_to_zero():
    # BFP flushes small entries of a block to zero; for Adam's exp_avg_sq that would divide by eps.
    # By default only first-moment accumulators (momentum_buffer, exp_avg) are quantized.
    torch.manual_seed(0)
    x, y = _digits_like(128)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    q = BlockQuantizer(wl=8, dim=0)
    opt = LowPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), weight=q, grad=q,
                                momentum=q, generator=torch.Generator().manual_seed(0))
    opt.quantize_weights_()
    first = None
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        first = loss.item() if first is None else first
        loss.backward()
        opt.step()
    assert loss.item() < first
    w = model[0].weight
    assert _on_grid_rows(opt.state[w]["exp_avg"], 8)
    assert (opt.state[w]["exp_avg_sq"] > 0).float().mean() > 0.9


def _on_grid_rows(x: torch.Tensor, wl: int) -> bool:
    return all(_on_grid(row, wl) for row in x)


def test_quantized_model_under_torch_compile():
    # Dynamo failed on torch.rand(symbolic shape, generator=...) inside the hooks.
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    quantize_activations_(model, BlockQuantizer(wl=4, dim=0), BlockQuantizer(wl=4, dim=0),
                          generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="eager", dynamic=True)
    for n in (8, 9):
        x = torch.randn(n, 4)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*Dynamo does not know how to trace")
            out = compiled(x)
            out.sum().backward()
        assert all(_on_grid(row, 4) for row in out.detach())
        assert model[0].weight.grad is not None and torch.isfinite(model[0].weight.grad).all()


def test_shared_exponent_is_clamped_to_eight_bits():
    # SWALP's reference clamps the shared exponent to [-128, 127] (8 exponent bits)
    tiny = torch.tensor([2.0 ** -140, -(2.0 ** -141)], dtype=torch.float64)
    assert torch.equal(block_quantize(tiny, 8, rounding="nearest"), torch.zeros(2, dtype=torch.float64))
    # exponent -140 clamped to -128: the step is 2^(-128 - 6) and 2^-134 is representable
    assert block_quantize(torch.tensor([2.0 ** -134], dtype=torch.float64), 8,
                          rounding="nearest").item() == 2.0 ** -134
    huge = torch.tensor([2.0 ** 130], dtype=torch.float64)
    assert block_quantize(huge, 8, rounding="nearest").item() == 127 * 2.0 ** (127 - 6)
    # ebit=None: no bound (the block's own exponent)
    assert torch.equal(block_quantize(tiny, 8, rounding="nearest", ebit=None), tiny)
    assert torch.equal(BlockQuantizer(wl=8, rounding="nearest")(tiny), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="ebit"):
        block_quantize(tiny, 8, ebit=1)


def test_quantization_after_activations_and_at_layer_inputs():
    # the reference quantizes after each activation and at conv inputs (and outputs): a layer
    # never sees a full-precision input, even after a tanh (off any grid) or as the first conv
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 6), nn.Tanh(),
                          nn.Linear(6, 3))
    seen = {}
    quantize_activations_(model, BlockQuantizer(wl=4, rounding="nearest"), None)
    model[0].register_forward_pre_hook(lambda m, i: seen.__setitem__("conv_in", i[0].detach()))
    model[3].register_forward_hook(lambda m, i, o: seen.__setitem__("tanh_out", o.detach()))
    model[4].register_forward_pre_hook(lambda m, i: seen.__setitem__("lin_in", i[0].detach()))
    out = model(torch.randn(5, 1, 4, 4, generator=torch.Generator().manual_seed(0)))
    for name in ("conv_in", "tanh_out", "lin_in"):
        assert _on_grid(seen[name], 4), name
    assert _on_grid(out.detach(), 4)


def test_averaged_model_is_evaluated_in_full_precision():
    # the hooks used to be deep-copied into SWA(model).module, so the average was
    # evaluated with quantized activations (SWALP's reference evaluates it in full precision)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    plain = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    plain.load_state_dict(model.state_dict())
    handle = quantize_activations_(model, BlockQuantizer(wl=3, rounding="nearest"), None)
    x = torch.randn(8, 4)
    for avg in (SWA(model), ema_of(model)):
        with torch.no_grad():
            torch.testing.assert_close(avg.module(x), plain(x))
    assert not torch.allclose(model(x), plain(x))  # the live model keeps its hooks
    handle.remove()
    torch.testing.assert_close(model(x), plain(x))


def ema_of(model):
    from ember.swa import EMA

    return EMA(model)
