"""Mixed precision: fp16 with GradScaler (unscale before clipping, one update per real step,
overflowing steps skipped and reported) and bf16 without a scaler, on CPU."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ember.train import ConfigError, Precision, TrainConfig, fit, weights_digest


def _data(n_batches: int = 12, batch: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 16, generator=g), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(n_batches)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


class OverflowAt:
    """Cross-entropy, except that call number ``at`` (1-based) returns an infinite loss."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = nn.functional.cross_entropy(logits, target)
        return loss * float("inf") if self.calls == self.at else loss


def test_fp16_overflow_step_is_skipped_and_reported(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    digests, records = {}, {}

    def on_step(step, record):
        digests[step] = weights_digest(model)
        records[step] = record

    log = tmp_path / "m.jsonl"
    # micro-batch 5 is the first half of step 3 (accumulate=2): the whole step must be skipped
    result = fit(model, opt, _data(), TrainConfig(epochs=1, precision="fp16", accumulate=2,
                                                  max_grad_norm=1.0, progress=False,
                                                  metrics_path=log),
                 loss_fn=OverflowAt(5), on_step=on_step)
    assert result.steps == 6
    assert result.skipped_steps == 1
    assert [s for s, r in records.items() if r["skipped"]] == [3]
    assert digests[3] == digests[2]  # the skipped step left the weights alone
    assert digests[4] != digests[3]
    assert records[3]["scale"] == records[2]["scale"] / 2  # one back-off for the effective batch
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["step"] for r in lines if r["event"] == "step" and r["skipped"]] == [3]
    assert [r["skipped_steps"] for r in lines if r["event"] == "epoch"] == [1]
    assert lines[-1]["event"] == "end" and lines[-1]["skipped_steps"] == 1


def test_fp16_scaler_updates_once_per_real_step(monkeypatch):
    calls = {"update": 0, "scale": 0}
    real_update, real_scale = torch.amp.GradScaler.update, torch.amp.GradScaler.scale

    def update(self, *a, **k):
        calls["update"] += 1
        return real_update(self, *a, **k)

    def scale(self, *a, **k):
        calls["scale"] += 1
        return real_scale(self, *a, **k)

    monkeypatch.setattr(torch.amp.GradScaler, "update", update)
    monkeypatch.setattr(torch.amp.GradScaler, "scale", scale)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    result = fit(model, opt, _data(n_batches=13), TrainConfig(epochs=2, precision="fp16",
                                                              accumulate=4, progress=False),
                 on_step=lambda s, r: scales.append(r["scale"]))
    assert result.steps == 6  # 3 steps per epoch; one leftover micro-batch per epoch dropped
    assert result.dropped_microbatches == 2
    assert calls == {"update": 6, "scale": 26}
    assert len(set(scales)) == 1  # no overflow, no growth within 2000 steps: one scale throughout


def test_fp16_clips_unscaled_gradients():
    norms = {}
    for precision in ("fp32", "fp16"):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fit(model, opt, _data(n_batches=1), TrainConfig(epochs=1, precision=precision,
                                                        max_grad_norm=1e6, progress=False),
            on_step=lambda s, r, p=precision: norms.setdefault(p, r["grad_norm"]))
    # a norm of the scaled gradients would be 65536 times larger
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=0.02)


def test_bf16_trains_without_a_scaler():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    data = _data(n_batches=8)
    result = fit(model, opt, data, TrainConfig(epochs=15, precision="bf16", progress=False),
                 on_step=lambda s, r: records.append(r))
    assert "scale" not in records[0]
    assert result.skipped_steps == 0
    assert result.history[-1]["train_loss"] < 0.7 * result.history[0]["train_loss"]
    assert Precision("bf16").make_scaler() is None
    with Precision("bf16").autocast():
        assert model(data[0][0]).dtype == torch.bfloat16


def test_fp16_policy_uses_a_cpu_grad_scaler_and_autocast():
    policy = Precision("fp16")
    assert policy.uses_scaler
    scaler = policy.make_scaler()
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() == 2.0**16
    with policy.autocast():
        assert _model()(torch.randn(2, 16)).dtype == torch.float16


def test_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown precision 'fp8'.*fp32, bf16, fp16"):
        Precision("fp8")
    with pytest.raises(ConfigError, match="unknown precision"):
        fit(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), _data(),
            TrainConfig(precision="half", progress=False))
