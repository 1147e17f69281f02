"""A run killed and resumed from its last checkpoint ends with bit-identical state (fp32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ember.train import TrainConfig, fit, image_class_loader, weights_digest
from ember.train.errors import ConfigError


class Killed(RuntimeError):
    pass


def _setup(urls: str, workers: int = 0):
    from ember.csprng import create_generator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    loader = image_class_loader(urls, 16, seed=3, shuffle=64, grayscale=True,
                                generator=create_generator(7), num_workers=workers)
    return model, opt, sched, loader


def _config(tmp, **kw) -> TrainConfig:
    base = dict(epochs=4, accumulate=2, max_grad_norm=1.0, swa_start=2,
                swa_lr=0.02, swag_rank=2, seed=11, checkpoint_dir=tmp / "ckpt", progress=False,
                metrics_path=tmp / "metrics.jsonl")
    base.update(kw)
    return TrainConfig(**base)


def _final(result) -> dict:
    return {"model": weights_digest(result.model), "swa": weights_digest(result.swa.module),
            "swag": {k: v.clone() for k, v in result.swag.state_dict().items()
                     if isinstance(v, torch.Tensor)},
            "stream": result.generator.get_state().clone(), "steps": result.steps,
            "history": [{k: v for k, v in r.items()} for r in result.history]}


def _run(urls, tmp, kill_at=None, workers=0, **kw):
    model, opt, sched, loader = _setup(urls, workers)

    def on_step(step, record):
        if step == kill_at:
            raise Killed(step)

    return fit(model, opt, loader, _config(tmp, **kw), scheduler=sched, on_step=on_step)


def _assert_same(a: dict, b: dict) -> None:
    assert a["model"] == b["model"]
    assert a["swa"] == b["swa"]
    assert a["swag"].keys() == b["swag"].keys()
    for k in a["swag"]:
        assert torch.equal(a["swag"][k], b["swag"][k]), k
    assert torch.equal(a["stream"], b["stream"])
    assert a["steps"] == b["steps"]
    assert a["history"] == b["history"]


@pytest.mark.parametrize("kill_at", [7, 27])  # mid-epoch before SWA, and inside the SWA phase
def test_killed_and_resumed_run_is_bit_identical(digits_shards, tmp_path, kill_at):
    urls = digits_shards["train_small"]
    reference = _final(_run(urls, tmp_path / "ref"))
    assert reference["steps"] > kill_at

    with pytest.raises(Killed):
        _run(urls, tmp_path / "cut", kill_at=kill_at, checkpoint_every=3)
    # the next process starts from scratch: new model, optimizer, loader, generators
    torch.manual_seed(12345)
    resumed = _final(_run(urls, tmp_path / "cut", resume="auto", checkpoint_every=3))
    _assert_same(reference, resumed)

    events = [json.loads(line)["event"] for line in (tmp_path / "cut" / "metrics.jsonl").open()]
    assert events.count("resume") == 1 and events[-1] == "end"


def test_resume_is_refused_when_settings_differ(digits_shards, tmp_path):
    urls = digits_shards["train_small"]
    with pytest.raises(Killed):
        _run(urls, tmp_path, kill_at=4, checkpoint_every=2)
    with pytest.raises(ConfigError, match="accumulate=2"):
        _run(urls, tmp_path, resume="auto", accumulate=1)
    with pytest.raises(ConfigError, match="precision"):
        _run(urls, tmp_path, resume="auto", precision="bf16")


def test_resume_from_missing_checkpoint_is_a_clear_error(digits_shards, tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint"):
        _run(digits_shards["train_small"], tmp_path, resume=tmp_path / "nothing.pt")


def test_resume_is_bit_identical_with_dataloader_workers(digits_shards, tmp_path):
    urls = digits_shards["train_small"]
    reference = _final(_run(urls, tmp_path / "ref", workers=2, epochs=2, swa_start=1))
    with pytest.raises(Killed):
        _run(urls, tmp_path / "cut", kill_at=5, workers=2, epochs=2, swa_start=1, checkpoint_every=2)
    resumed = _final(_run(urls, tmp_path / "cut", workers=2, epochs=2, swa_start=1, checkpoint_every=2,
                          resume="auto"))
    _assert_same(reference, resumed)


@pytest.mark.parametrize("options", [
    # fast-SWA: cyclic rate per step, collection every 2 steps in the late half of each cycle,
    # a diagonal SWAG over the last layer, the user's scheduler stepped per step, an EMA
    dict(swa_schedule="cyclic", swa_cycle=4, swa_lr_max=0.05, swa_every_steps=2,
         swag_rank=20, swag_diagonal=True, swag_params=("4.weight", "4.bias"),
         scheduler_interval="step",
         ema_decay=0.9),
    # every-N collection under a linear SWALR anneal and a constant rate (~20 s each: slow)
    pytest.param(dict(swa_every_steps=3, swa_anneal_strategy="linear", swa_anneal_epochs=2),
                 marks=pytest.mark.slow),
    pytest.param(dict(swa_every_steps=5, swa_schedule="constant"), marks=pytest.mark.slow),
], ids=["fastswa", "every-steps-linear", "constant"])
def test_resume_is_bit_identical_with_step_collection_options(digits_shards, tmp_path, options):
    urls = digits_shards["train_small"]
    reference = _run(urls, tmp_path / "ref", **options)
    # more collections than the 2 SWA-phase epochs: collection really happens within epochs
    assert reference.steps > 27 and reference.swa.n_updates > 2
    ref = _final(reference)
    with pytest.raises(Killed):
        _run(urls, tmp_path / "cut", kill_at=27, checkpoint_every=3, **options)
    torch.manual_seed(12345)
    resumed = _run(urls, tmp_path / "cut", resume="auto", checkpoint_every=3, **options)
    _assert_same(ref, _final(resumed))
    assert resumed.swa.n_updates == reference.swa.n_updates
    if reference.ema is not None:
        assert weights_digest(resumed.ema.module) == weights_digest(reference.ema.module)
    # a resumed run with a different collection setting is refused
    with pytest.raises(ConfigError, match="swa_every_steps"):
        _run(urls, tmp_path / "cut", resume="auto", **{**options, "swa_every_steps": 1})
