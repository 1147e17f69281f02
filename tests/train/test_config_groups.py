"""TrainConfig's groups: nested construction, each group's own check, and the flat keywords of
earlier versions (a DeprecationWarning, the same config)."""

from __future__ import annotations

import warnings

import pytest

from ember.train import (
    CheckpointConfig,
    ConfigError,
    EMAConfig,
    LogConfig,
    StepConfig,
    SWAConfig,
    SWAGConfig,
    TrainConfig,
)


def _flat(**kw) -> TrainConfig:
    with pytest.warns(DeprecationWarning, match="flat keywords are deprecated"):
        return TrainConfig(**kw)


def test_flat_keywords_build_the_same_config_as_the_groups():
    flat = _flat(epochs=5, precision="bf16", accumulate=2, swa_start=3, swa_lr=0.05,
                 swag_rank=4, ema_decay=0.99, ema_warmup=False, checkpoint_dir="ck",
                 checkpoint_every=7, metrics_path="m.jsonl", progress=False, bn_batches=3)
    nested = TrainConfig(5, step=StepConfig(precision="bf16", accumulate=2),
                         swa=SWAConfig(start=3, lr=0.05, bn_batches=3), swag=SWAGConfig(rank=4),
                         ema=EMAConfig(0.99, warmup="off"),
                         checkpoint=CheckpointConfig(dir="ck", every=7),
                         log=LogConfig(metrics_path="m.jsonl", progress=False))
    flat.check()
    nested.check()
    assert flat == nested


def test_flat_names_still_read():
    config = TrainConfig(4, swa=SWAConfig(start=1, lr=0.1))
    assert (config.swa_start, config.swa_lr, config.swag_rank, config.ema_decay) == \
        (1, 0.1, None, None)
    assert (config.precision, config.accumulate, config.scheduler_interval) == \
        ("fp32", 1, "epoch")


def test_defaults_of_a_flat_group_option_leave_the_group_off():
    config = _flat(swag_diagonal=False, swa_schedule="anneal", ema_warmup=True)
    assert config.swa is None and config.swag is None and config.ema is None
    config.check()


def test_each_group_checks_its_own_options():
    with pytest.raises(ConfigError, match="swa_cycle_shape"):
        TrainConfig(4, swa=SWAConfig(start=1, lr=0.1, cycle_shape="square")).check()
    with pytest.raises(ConfigError, match="ema_decay must be a fraction"):
        TrainConfig(ema=EMAConfig(1.5)).check()
    with pytest.raises(ConfigError, match="swag_rank is set but swa_start is None"):
        TrainConfig(swag=SWAGConfig(rank=3)).check()
    with pytest.raises(ConfigError, match="TrainConfig.step must be a StepConfig"):
        TrainConfig(step="fp16").check()  # type: ignore[arg-type]


def test_an_unknown_flat_keyword_is_a_type_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TypeError, match="noise_multiplier"):
            TrainConfig(noise_multiplier=1.0)


def test_replace_and_flat_keywords_never_change_another_configs_groups():
    import dataclasses

    base = TrainConfig(epochs=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = [dataclasses.replace(base, accumulate=a) for a in (1, 2, 4)]
        mine = SWAConfig(start=1, lr=0.1)
        config = TrainConfig(4, swa=mine, swa_lr=0.2)
    assert [m.step.accumulate for m in made] == [1, 2, 4] and base.step.accumulate == 1
    assert mine.lr == 0.1 and config.swa.lr == 0.2


def test_flat_switches_and_options_of_groups_that_are_off_behave_as_before():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TrainConfig(4, ema_decay=0.9, swa_start=1, swa_lr=0.1, swag_rank=2)
        config.ema_decay = None  # the old way to turn a group off
        config.swag_rank = None
        assert config.ema is None and config.swag is None
        quiet = TrainConfig(ema_warmup=False, swa_anneal_epochs=2, bn_batches=3)
    quiet.check()
    assert quiet.ema is None and quiet.swa is None
    assert (quiet.bn_batches, quiet.swa_anneal_epochs, quiet.ema_warmup) == (3, 2, "off")
    config.check()
