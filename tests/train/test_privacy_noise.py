"""secure_noise / fuse_secure_noise: Opacus's secure-mode noise with one normal_foreach_, exactly
the values of Opacus's own per-call procedure on the same ember generator."""

import pytest
import torch

import ember.csprng as csprng
from ember.train.privacy import fuse_secure_noise, secure_noise

opacus = pytest.importorskip("opacus")
from opacus.optimizers.optimizer import DPOptimizer, _generate_noise  # noqa: E402

SHAPES = [(16, 3, 3, 3), (16,), (10, 64), (10,), (1,), (300, 7)]


def test_secure_noise_equals_opacus_generate_noise_per_parameter():
    refs = [torch.zeros(s) for s in SHAPES]
    g1, g2 = csprng.create_generator(11), csprng.create_generator(11)
    want = [_generate_noise(1.3, r, generator=g1, secure_mode=True) for r in refs]
    got = secure_noise(1.3, refs, g2)
    assert g1.counter == g2.counter
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_zero_std_draws_nothing_as_in_opacus():
    g = csprng.create_generator(1)
    out = secure_noise(0.0, [torch.zeros(3, dtype=torch.float64)], g)
    assert g.counter == 0 and out[0].dtype == torch.float64 and not out[0].any()


def _optimizer(seed: int):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    opt = DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=0.7, max_grad_norm=2.0,
                      expected_batch_size=8, secure_mode=True, generator=csprng.create_generator(seed))
    for i, p in enumerate(params):
        p.summed_grad = torch.full(p.shape, float(i))
    return opt, params


def test_fused_add_noise_gives_opacus_gradients():
    plain, p1 = _optimizer(5)
    fused, p2 = _optimizer(5)
    assert fuse_secure_noise(fused)
    plain.add_noise()
    fused.add_noise()
    for a, b in zip(p1, p2, strict=True):
        assert torch.equal(a.grad, b.grad)
    assert plain.generator.counter == fused.generator.counter


def test_fusing_refuses_non_secure_or_non_ember_optimizers():
    opt, _ = _optimizer(1)
    opt.secure_mode = False
    assert not fuse_secure_noise(opt)
    opt, _ = _optimizer(1)
    opt.generator = torch.Generator()
    assert not fuse_secure_noise(opt)
    assert not fuse_secure_noise(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))


def test_secure_noise_foreach_rejects_bad_input():
    from ember.csprng.foreach import secure_noise_foreach_

    g = csprng.create_generator(1)
    with pytest.raises(TypeError, match="float32"):
        secure_noise_foreach_([torch.zeros(3, dtype=torch.float64)], 1.0, generator=g)
    with pytest.raises(ValueError, match="std"):
        secure_noise_foreach_([torch.zeros(3)], 0.0, generator=g)
    assert g.counter == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_secure_noise_equals_opacus_generate_noise_on_the_gpu():
    refs = [torch.zeros(s, device="cuda") for s in SHAPES + [(512, 256, 3, 3)]]
    g1, g2 = csprng.create_generator(11), csprng.create_generator(11)
    want = [_generate_noise(0.9, r, generator=g1, secure_mode=True) for r in refs]
    got = secure_noise(0.9, refs, g2)
    assert g1.counter == g2.counter
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
