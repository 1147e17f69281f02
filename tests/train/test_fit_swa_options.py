"""fit's SWA options: collection every N steps, anneal/constant/cyclic (fast-SWA) rates, per-step
schedulers, SWAG options, and evaluation of every model kept after each epoch."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember.swa import cyclic_lr, update_bn
from ember.swa.fastswa import FastSWASchedule
from ember.train import TrainConfig, fit
from ember.train.errors import ConfigError
from ember.train.loop import evaluate

STEPS_PER_EPOCH = 5


def _data(n: int = 80, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return TensorDataset(x, y)


def _setup(bn: bool = True):
    torch.manual_seed(0)
    layers = [nn.Linear(6, 16)] + ([nn.BatchNorm1d(16)] if bn else []) + \
        [nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3)]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(_data(), batch_size=16)  # 5 batches, fixed order
    return model, opt, loader


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _fit(config: TrainConfig, *, bn: bool = True, **kw):
    model, opt, loader = _setup(bn)
    seen: dict[int, torch.Tensor] = {}
    lrs: dict[int, float] = {}

    def on_step(step, record):
        seen[step] = _flat(model)
        lrs[step] = record["lr"]

    result = fit(model, opt, loader, config, on_step=on_step, **kw)
    return result, seen, lrs


def _expect_mean(result, seen, steps):
    expected = torch.stack([seen[s] for s in steps]).mean(0)
    torch.testing.assert_close(_flat(result.swa.module), expected, rtol=1e-5, atol=1e-6)
    assert result.swa.n_updates == len(steps)
    assert result.swag.n_collected == len(steps)
    torch.testing.assert_close(result.swag.mean.to(expected), expected, rtol=1e-5, atol=1e-6)


def test_swa_every_steps_averages_the_weights_after_every_nth_step_of_the_phase():
    config = TrainConfig(epochs=3, swa_start=1, swa_lr=0.05, swa_every_steps=2, swag_rank=2,
                         progress=False)
    result, seen, _ = _fit(config, bn=False)
    # phase = global steps 6..15; every 2nd step of the phase: 7, 9, 11, 13, 15
    _expect_mean(result, seen, [7, 9, 11, 13, 15])


def test_per_epoch_collection_is_kept_by_default():
    config = TrainConfig(epochs=3, swa_start=1, swa_lr=0.05, swag_rank=2, progress=False)
    result, seen, _ = _fit(config, bn=False)
    _expect_mean(result, seen, [10, 15])


def test_cyclic_schedule_rates_and_fast_swa_collection_points():
    cycle, every = 5, 2
    config = TrainConfig(epochs=3, swa_start=1, swa_lr=0.01, swa_lr_max=0.1, swa_cycle=cycle,
                         swa_schedule="cyclic", swa_every_steps=every, swag_rank=2,
                         swa_collect_start=0.5, progress=False)
    result, seen, lrs = _fit(config, bn=False)
    for s in range(10):  # phase step s is global step 6 + s
        assert lrs[6 + s] == pytest.approx(cyclic_lr(s, lr_max=0.1, lr_min=0.01, cycle=cycle))
    # within each cycle of 5: positions >= 2 counted back from the end by 2 -> 2 and 4
    assert FastSWASchedule(cycle, every, start=0.5).positions == [2, 4]
    _expect_mean(result, seen, [6 + 2, 6 + 4, 6 + 7, 6 + 9])


def test_fast_swa_default_window_is_the_whole_cycle_and_cosine_cycles_reach_fit():
    # fit could not change fast-SWA's window (the late half only); the reference
    # collects across the whole cycle of a cosine-shaped cyclical rate
    config = TrainConfig(epochs=3, swa_start=1, swa_lr=0.01, swa_lr_max=0.1, swa_cycle=5,
                         swa_schedule="cyclic", swa_every_steps=2, swa_cycle_shape="cosine",
                         swag_rank=2, progress=False)
    result, seen, lrs = _fit(config, bn=False)
    for s in range(10):
        assert lrs[6 + s] == pytest.approx(cyclic_lr(s, lr_max=0.1, lr_min=0.01, cycle=5,
                                                     shape="cosine"))
    _expect_mean(result, seen, [6 + 0, 6 + 2, 6 + 4, 6 + 5, 6 + 7, 6 + 9])
    with pytest.raises(ConfigError, match="swa_collect_start"):
        TrainConfig(epochs=3, swa_collect_start=1.5).check()
    with pytest.raises(ConfigError, match="swa_cycle_shape"):
        TrainConfig(epochs=3, swa_cycle_shape="saw").check()


def test_cyclic_without_every_steps_collects_at_cycle_ends():
    config = TrainConfig(epochs=3, swa_start=1, swa_lr=0.01, swa_lr_max=0.1, swa_cycle=5,
                         swa_schedule="cyclic", swag_rank=2, progress=False)
    result, seen, _ = _fit(config, bn=False)
    _expect_mean(result, seen, [10, 15])


def test_constant_schedule_uses_swa_lr_from_the_first_phase_step():
    config = TrainConfig(epochs=3, swa_start=1, swa_lr=0.03, swa_schedule="constant",
                         swag_rank=None, progress=False)
    _, _, lrs = _fit(config, bn=False)
    assert all(lrs[s] == pytest.approx(0.1) for s in range(1, 6))
    assert all(lrs[s] == pytest.approx(0.03) for s in range(6, 16))


def test_linear_anneal_follows_torch_swalr():
    config = TrainConfig(epochs=4, swa_start=1, swa_lr=0.01, swa_anneal_epochs=2,
                         swa_anneal_strategy="linear", swag_rank=None, progress=False)
    result, _, _ = _fit(config, bn=False)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    ref = torch.optim.swa_utils.SWALR(opt, swa_lr=0.01, anneal_epochs=2, anneal_strategy="linear")
    expected = [0.1]
    for _ in range(3):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    assert [r["lr"] for r in result.history] == pytest.approx(expected)


def test_scheduler_interval_step_steps_the_user_scheduler_after_every_optimizer_step():
    model, opt, loader = _setup(bn=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = {}
    fit(model, opt, loader, TrainConfig(epochs=2, scheduler_interval="step", progress=False),
        scheduler=sched, on_step=lambda s, r: lrs.__setitem__(s, r["lr"]))
    assert [lrs[s] for s in range(1, 11)] == pytest.approx([0.1 * 0.5**k for k in range(10)])


def test_swag_options_reach_the_posterior():
    config = TrainConfig(epochs=2, swa_start=1, swa_lr=0.05, swa_every_steps=1, swag_rank=20,
                         swag_diagonal=True, swag_params=("4.weight", "4.bias"),
                         swag_device="cpu", progress=False)
    result, seen, _ = _fit(config)
    swag = result.swag
    assert swag.diagonal and swag.max_rank == 0 and swag.deviations.numel() == 0
    assert swag.names == ["4.weight", "4.bias"] and swag.num_parameters == 16 * 3 + 3
    assert swag.device == torch.device("cpu")
    last = torch.stack([seen[s][-51:] for s in range(6, 11)]).mean(0)
    torch.testing.assert_close(swag.mean, last, rtol=1e-5, atol=1e-6)


def test_eval_after_each_epoch_covers_raw_ema_and_swa_with_recomputed_batchnorm(tmp_path):
    eval_loader = DataLoader(_data(48, seed=1), batch_size=16)
    bn_loader = DataLoader(_data(64, seed=2), batch_size=16)
    config = TrainConfig(epochs=3, swa_start=1, swa_lr=0.05, swa_every_steps=2, swag_rank=2,
                         ema_decay=0.8, bn_batches=2, progress=False,
                         metrics_path=tmp_path / "m.jsonl")
    result, _, _ = _fit(config, eval_loader=eval_loader, bn_loader=bn_loader)
    first, last = result.history[0], result.history[-1]
    assert "eval_accuracy" in first and "eval_ema_accuracy" in first
    assert "eval_swa_accuracy" not in first  # nothing averaged yet in epoch 0
    for key in ("eval_accuracy", "eval_nll", "eval_ema_accuracy", "eval_ema_nll",
                "eval_swa_accuracy", "eval_swa_nll"):
        assert key in last
    # fit ends by recomputing the SWA model's statistics on the same 2 batches: the last epoch's
    # SWA metrics are those of the returned SWA model
    assert evaluate(result.swa.module, eval_loader) == {
        "accuracy": last["eval_swa_accuracy"], "nll": last["eval_swa_nll"]}
    assert evaluate(result.ema.module, eval_loader)["nll"] == pytest.approx(last["eval_ema_nll"])
    # bounded: statistics of 2 batches of bn_loader, not of all 4
    check = result.swa.module
    update_bn(bn_loader, check, max_batches=4)
    assert evaluate(check, eval_loader)["nll"] != last["eval_swa_nll"]
    epochs = [json.loads(line) for line in (tmp_path / "m.jsonl").open()]
    logged = [e for e in epochs if e["event"] == "epoch"]
    assert logged[-1]["eval_swa_nll"] == last["eval_swa_nll"]


def test_swa_eval_without_bn_loader_says_why_it_is_skipped():
    eval_loader = DataLoader(_data(32, seed=1), batch_size=16)
    config = TrainConfig(epochs=2, swa_start=1, swa_lr=0.05, swag_rank=None, progress=False)
    with pytest.warns(UserWarning, match="stale"):
        result, _, _ = _fit(config, eval_loader=eval_loader)
    assert "bn_loader" in result.history[-1]["eval_swa_skipped"]
    assert "eval_swa_accuracy" not in result.history[-1]


@pytest.mark.parametrize("kw, match", [
    (dict(swa_every_steps=2), "swa_start is None"),
    (dict(swa_start=0, swa_lr=0.1, swa_every_steps=0), "swa_every_steps"),
    (dict(swa_start=0, swa_lr=0.1, swa_schedule="cosine"), "unknown swa_schedule"),
    (dict(swa_start=0, swa_lr=0.1, swa_anneal_strategy="exp"), "swa_anneal_strategy"),
    (dict(swa_start=0, swa_lr=0.1, swa_schedule="cyclic", swa_lr_max=0.2), "swa_cycle"),
    (dict(swa_start=0, swa_lr=0.1, swa_schedule="cyclic", swa_cycle=4), "swa_lr_max"),
    (dict(swa_start=0, swa_lr=0.1, swa_schedule="cyclic", swa_cycle=4, swa_lr_max=0.05),
     "swa_lr_max >= swa_lr"),
    (dict(swa_start=0, swa_lr=0.1, swa_schedule="cyclic", swa_cycle=4, swa_lr_max=0.2,
          swa_every_steps=5), "longer than"),
    (dict(swa_start=0, swa_lr=0.1, swa_cycle=4), "for swa_schedule='cyclic'"),
    (dict(scheduler_interval="batch"), "scheduler_interval"),
    (dict(swa_start=0, swa_lr=0.1, swag_rank=None, swag_diagonal=True), "no SWAG"),
    (dict(swa_start=0, swa_lr=0.1, swag_rank=2, swag_params="4.weight"),
     "sequence of parameter names"),
    (dict(bn_batches=0), "bn_batches"),
])
def test_bad_combinations_are_config_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(epochs=2, **kw).check()


def test_unknown_swag_param_name_is_a_clear_error():
    model, opt, loader = _setup()
    config = TrainConfig(epochs=1, swa_start=0, swa_lr=0.05, swag_params=("9.weight",),
                         swag_rank=2, progress=False)
    with pytest.raises(ConfigError, match="9.weight"):
        fit(model, opt, loader, config)


def test_swag_is_opt_in():
    # SWA used to turn on a rank-20 SWAG (22 copies of the weights) by default
    assert TrainConfig(epochs=2, swa_start=1, swa_lr=0.05).swag_rank is None
    result, _, _ = _fit(TrainConfig(epochs=2, swa_start=1, swa_lr=0.05, progress=False))
    assert result.swa is not None and result.swag is None
