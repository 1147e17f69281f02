"""fit on a BatchNorm + dropout model: it finishes, resumes with resume="auto", logs the rate used."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ember.train import TrainConfig, fit, weights_digest


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 8), nn.BatchNorm1d(8),
                         nn.Dropout(0.2), nn.Linear(8, 3))


def _loader(n_batches: int = 4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n_batches)]


def test_weights_digest_of_a_batchnorm_model():
    a, b = _model(), _model()
    assert weights_digest(a) == weights_digest(b)
    b[1].num_batches_tracked += 1  # the 0-dim integer buffer is part of the digest
    assert weights_digest(a) != weights_digest(b)


def test_fit_of_a_batchnorm_model_finishes_and_resumes_auto(tmp_path):
    cfg = dict(epochs=2, swa_start=1, swa_lr=0.01, swag_rank=2, progress=False,
               checkpoint_dir=tmp_path / "ckpt")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    result = fit(model, opt, _loader(), TrainConfig(**cfg), bn_loader=_loader(2))
    assert result.steps == 8
    assert int(result.model[1].num_batches_tracked) == 8
    # a finished run resumed with resume="auto" loads its last checkpoint and trains nothing more
    model2 = _model()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05)
    again = fit(model2, opt2, _loader(), TrainConfig(**cfg, resume="auto"), bn_loader=_loader(2))
    assert again.steps == 8
    assert weights_digest(again.model) == weights_digest(result.model)


def test_epoch_records_log_the_rate_the_epoch_trained_with():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    seen: list[float] = []
    result = fit(model, opt, _loader(2), TrainConfig(epochs=3, swag_rank=None, progress=False),
                 scheduler=sched, on_step=lambda step, rec: seen.append(rec["lr"]))
    assert [r["lr"] for r in result.history] == [0.1, 0.05, 0.025]
    assert seen[::2] == [0.1, 0.05, 0.025]  # the step records agree


def test_swa_model_with_stale_batchnorm_statistics_warns():


    cfg = TrainConfig(epochs=2, swa_start=1, swa_lr=0.01, swag_rank=None, progress=False)
    model = _model()
    with pytest.warns(UserWarning, match="stale"):
        fit(model, torch.optim.SGD(model.parameters(), lr=0.05), _loader(2), cfg)
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        result = fit(model, torch.optim.SGD(model.parameters(), lr=0.05), _loader(2), cfg,
                     bn_loader=_loader(2))
    assert int(result.swa.module[1].num_batches_tracked) == 2  # recomputed on the 2 bn batches


def _ema_run(tmp_path, kill_at=None, resume=None, precision="fp32"):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cfg = TrainConfig(epochs=3, ema_decay=0.9, swa_start=2, swa_lr=0.01, swag_rank=2,
                      progress=False, checkpoint_dir=tmp_path / "ckpt",
                      resume=resume, precision=precision)

    def on_step(step, record):
        if step == kill_at:
            raise RuntimeError("killed")

    return fit(model, opt, _loader(), cfg, bn_loader=_loader(2), on_step=on_step)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_fit_keeps_an_ema_and_resumes_it_bit_identically(tmp_path, precision):
    whole = _ema_run(tmp_path / "a", precision=precision)
    assert whole.ema is not None and whole.ema.n_updates == whole.steps == 12
    assert weights_digest(whole.ema.module) != weights_digest(whole.model)
    with pytest.raises(RuntimeError, match="killed"):
        # killed mid epoch 2: the run resumes from the end of epoch 1
        _ema_run(tmp_path / "b", kill_at=7, precision=precision)
    # fresh model, optimizer, EMA, SWA and SWAG objects
    resumed = _ema_run(tmp_path / "b", resume="auto", precision=precision)
    assert resumed.ema.n_updates == 12
    for a, b in ((whole.model, resumed.model), (whole.ema.module, resumed.ema.module),
                 (whole.swa.module, resumed.swa.module)):
        assert weights_digest(a) == weights_digest(b)
    assert torch.equal(whole.swag.var, resumed.swag.var)
    assert torch.equal(whole.swag.deviations, resumed.swag.deviations)


def test_fit_ema_with_decay_zero_follows_the_model():
    model = _model()
    cfg = TrainConfig(epochs=1, ema_decay=0.0, swag_rank=None, progress=False)
    result = fit(model, torch.optim.SGD(model.parameters(), lr=0.05), _loader(2), cfg)
    assert weights_digest(result.ema.module) == weights_digest(result.model)


def _fast_run(tmp_path, kill_at=None, resume=None, precision="fp32"):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    names = [n for n, _ in model.named_parameters()][-2:]  # the last layer
    cfg = TrainConfig(epochs=3, ema_decay=0.9, swa_start=1, swa_lr=0.01, swa_lr_max=0.05,
                      swa_schedule="cyclic", swa_cycle=4, swa_every_steps=1, swag_rank=20,
                      swag_diagonal=True,
                      swag_params=tuple(names), bn_batches=1, progress=False,
                      checkpoint_dir=tmp_path / "ckpt", resume=resume, precision=precision)

    def on_step(step, record):
        if step == kill_at:
            raise RuntimeError("killed")

    return fit(model, opt, _loader(), cfg, bn_loader=_loader(2), eval_loader=_loader(2),
               on_step=on_step)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_fast_swa_with_eval_and_swag_options_resumes_bit_identically(tmp_path, precision):
    whole = _fast_run(tmp_path / "a", precision=precision)
    assert whole.swa.n_updates == 2 * 4  # 2 cycles of 4 steps, every step of each
    assert "eval_swa_nll" in whole.history[-1] and "eval_ema_nll" in whole.history[-1]
    with pytest.raises(RuntimeError, match="killed"):
        _fast_run(tmp_path / "b", kill_at=7, precision=precision)
    resumed = _fast_run(tmp_path / "b", resume="auto", precision=precision)
    for a, b in ((whole.model, resumed.model), (whole.ema.module, resumed.ema.module),
                 (whole.swa.module, resumed.swa.module)):
        assert weights_digest(a) == weights_digest(b)
    assert torch.equal(whole.swag.mean, resumed.swag.mean)
    assert torch.equal(whole.swag.var, resumed.swag.var)
    assert whole.history == resumed.history
