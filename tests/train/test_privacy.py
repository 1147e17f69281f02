"""fit(privacy=...): DP-SGD through Opacus on ember; budget, exact resume, bad inputs."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("opacus")

from ember.train import ConfigError, TrainConfig, fit, weights_digest  # noqa: E402
from ember.train.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from ember.train.privacy import PrivacyConfig  # noqa: E402

N, BATCH = 96, 16


def _setup(seed: int = 0, bn: bool = False):
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 12), nn.ReLU(), nn.Dropout(0.1), nn.Linear(12, 3)]
    if bn:
        layers.insert(1, nn.BatchNorm1d(12))
    model = nn.Sequential(*layers)
    g = torch.Generator().manual_seed(1234)  # the same data whatever the model's seed
    data = torch.utils.data.TensorDataset(torch.randn(N, 8, generator=g),
                                          torch.randint(0, 3, (N,), generator=g))
    torch.manual_seed(seed)  # dropout
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loader


def _fit(model, optimizer, loader, privacy, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fit(model, optimizer, loader, TrainConfig(progress=False, **kw), privacy=privacy)


def test_epsilon_matches_opacus_accountant_run_by_hand(tmp_path):
    from opacus.accountants import RDPAccountant
    from opacus.accountants.utils import get_noise_multiplier

    model, opt, loader = _setup()
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, max_grad_norm=1.0)
    result = _fit(model, opt, loader, privacy, epochs=3, metrics_path=tmp_path / "m.jsonl")
    q = 1 / (N // BATCH)
    sigma = get_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, sample_rate=q, epochs=3,
                                 accountant="rdp")
    assert result.noise_multiplier == pytest.approx(sigma, rel=0, abs=0)
    acc = RDPAccountant()
    per_epoch = []
    for _ in range(3):
        for _ in range(N // BATCH):
            acc.step(noise_multiplier=sigma, sample_rate=q)
        per_epoch.append(acc.get_epsilon(1e-5))
    assert [r["epsilon"] for r in result.history] == pytest.approx(per_epoch, rel=1e-12)
    assert result.epsilon == pytest.approx(per_epoch[-1], rel=1e-12)
    assert result.epsilon <= 4.0 + 1e-6
    import json
    logged = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["epsilon"] for r in logged if r.get("event", r.get("kind")) == "epoch"
            or "train_loss" in r] == pytest.approx(per_epoch, rel=1e-12)


def test_kill_and_resume_is_bit_identical_with_the_same_epsilon(tmp_path):
    privacy = PrivacyConfig(noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, noise_seed=5)
    model, opt, loader = _setup()
    full = _fit(model, opt, loader, privacy, epochs=3)

    model, opt, loader = _setup()
    _fit(model, opt, loader, privacy, epochs=1, checkpoint_dir=tmp_path)  # "killed" after epoch 1
    ckpt = load_checkpoint(tmp_path / "last.pt")
    assert ckpt["privacy"]["history"]
    model, opt, loader = _setup(seed=99)  # fresh objects, other initial weights
    resumed = _fit(model, opt, loader, privacy, epochs=3, checkpoint_dir=tmp_path, resume="auto")
    assert weights_digest(resumed.model) == weights_digest(full.model)
    assert resumed.epsilon == full.epsilon
    assert torch.equal(resumed.history[-1]["train_loss"] * torch.ones(1),
                       full.history[-1]["train_loss"] * torch.ones(1))


def test_os_keyed_noise_is_restored_from_the_checkpoint(tmp_path):
    privacy = PrivacyConfig(noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0)
    model, opt, loader = _setup()
    _fit(model, opt, loader, privacy, epochs=1, checkpoint_dir=tmp_path)
    state = load_checkpoint(tmp_path / "last.pt")
    digests, eps = [], []
    for i in range(2):
        d = tmp_path / f"r{i}"
        save_checkpoint(d / "last.pt", {k: v for k, v in state.items() if k != "format"})
        model, opt, loader = _setup(seed=i + 10)
        r = _fit(model, opt, loader, privacy, epochs=2, checkpoint_dir=d, resume="auto")
        digests.append(weights_digest(r.model))
        eps.append(r.epsilon)
    assert digests[0] == digests[1] and eps[0] == eps[1]


@pytest.mark.parametrize("kwargs, match", [
    ({"epsilon": 0.0, "delta": 1e-5, "max_grad_norm": 1.0}, "epsilon must be > 0"),
    ({"epsilon": -1.0, "delta": 1e-5, "max_grad_norm": 1.0}, "epsilon must be > 0"),
    ({"epsilon": 1.0, "delta": 1.0, "max_grad_norm": 1.0}, r"delta must be in \(0, 1\)"),
    ({"epsilon": 1.0, "delta": 1e-5}, "needs max_grad_norm"),
    ({"epsilon": 1.0, "max_grad_norm": 1.0}, "needs delta"),
    ({"delta": 1e-5, "max_grad_norm": 1.0}, "epsilon or a noise_multiplier"),
    ({"epsilon": 1.0, "delta": 1e-5, "max_grad_norm": 1.0, "accountant": "x"}, "accountant"),
])
def test_bad_privacy_config_is_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PrivacyConfig(**kwargs).check()
    model, opt, loader = _setup()
    before = weights_digest(model)
    with pytest.raises(ConfigError, match=match):
        _fit(model, opt, loader, PrivacyConfig(**kwargs), epochs=1)
    assert weights_digest(model) == before


def test_batchnorm_is_refused_naming_the_layer_or_replaced_by_groupnorm():
    model, opt, loader = _setup(bn=True)
    privacy = PrivacyConfig(noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0)
    with pytest.raises(ConfigError, match=r"BatchNorm.*replace_batchnorm=True"):
        _fit(model, opt, loader, privacy, epochs=1)
    weight = model[1].weight
    privacy.replace_batchnorm = True
    result = _fit(model, opt, loader, privacy, epochs=1)
    assert isinstance(result.model[1], nn.GroupNorm)
    assert result.model[1].weight is weight  # the optimizer's parameter, now trained
    assert result.epsilon > 0


@pytest.mark.parametrize("kw, match", [
    ({"precision": "bf16"}, "fp32"), ({"accumulate": 2}, "accumulate"),
    ({"max_grad_norm": 1.0}, "per example"),
])
def test_unsupported_combinations_are_refused(kw, match):
    model, opt, loader = _setup()
    with pytest.raises(ConfigError, match=match):
        _fit(model, opt, loader, PrivacyConfig(noise_multiplier=1.0, delta=1e-5,
                                               max_grad_norm=1.0), epochs=1, **kw)


def test_a_loader_without_indices_is_refused():
    model, opt, _ = _setup()
    batches = [(torch.randn(4, 8), torch.zeros(4, dtype=torch.int64))]
    with pytest.raises(ConfigError, match="map-style dataset"):
        _fit(model, opt, batches, PrivacyConfig(noise_multiplier=1.0, delta=1e-5,
                                                max_grad_norm=1.0), epochs=1)


def test_ember_train_cli_dp_flags(tmp_path, capsys):
    import json

    from ember.cli import main
    from ember.demo import write_digits_shards

    shards = write_digits_shards(tmp_path / "digits", maxcount=200)
    train = shards["train"]

    out = tmp_path / "out"
    rc = main(["train", "--data", train, "--num-classes", "10",
               "--epochs", "2", "--batch-size", "32", "--dp-epsilon", "8", "--dp-delta", "1e-5",
               "--max-grad-norm", "1.0", "--no-progress", "--out", str(out), "--swag-rank", "0"])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    eps = [r["epsilon"] for r in summary["history"]]
    assert len(eps) == 2 and 0 < eps[0] < eps[1] <= 8.0 + 1e-6
    assert summary["epsilon"] == eps[-1] and summary["noise_multiplier"] > 0
    rc = main(["train", "--data", train, "--num-classes", "10",
               "--dp-epsilon", "8", "--no-progress", "--out", str(out)])
    assert rc == 2 and "--dp-delta" in capsys.readouterr().err
    rc = main(["train", "--data", train, "--num-classes", "10",
               "--dp-noise-multiplier", "1.0", "--no-progress", "--out", str(out)])
    assert rc == 2 and "not differential privacy" in capsys.readouterr().err
