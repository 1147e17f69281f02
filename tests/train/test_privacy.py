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
               "--max-grad-norm", "1.0", "--no-progress", "--out", str(out), "--swag-rank", "0",
               "--dp-accountant", "prv"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    summary = json.loads((out / "summary.json").read_text())
    eps = [r["epsilon"] for r in summary["history"]]
    assert len(eps) == 2 and 0 < eps[0] < eps[1] <= 8.0
    assert summary["epsilon"] == eps[-1] and summary["noise_multiplier"] > 0
    report = summary["privacy"]
    assert report["accountant"] == "prv" and report["epsilon"] == eps[-1]
    assert report["private"] is True and report["delta"] == 1e-5
    assert report["steps"] == 2 * round(1 / report["sample_rate"])
    for e, value in enumerate(eps):
        assert f"epoch {e + 1}/2: epsilon {value:.4f}" in printed.out
    rc = main(["train", "--data", train, "--num-classes", "10",
               "--dp-epsilon", "8", "--no-progress", "--out", str(out)])
    assert rc == 2 and "--dp-delta" in capsys.readouterr().err
    rc = main(["train", "--data", train, "--num-classes", "10",
               "--dp-noise-multiplier", "1.0", "--no-progress", "--out", str(out)])
    assert rc == 2 and "not differential privacy" in capsys.readouterr().err


# ---- defects: each of these failed before its fix --------------------------------------------

def _privacy(**kw):
    base = dict(noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, noise_seed=3)
    base.update(kw)
    return PrivacyConfig(**base)


def _bn_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(12, affine=kind != "no-affine")
    if kind == "frozen":
        bn.weight.requires_grad_(False)
        bn.bias.requires_grad_(False)
    return nn.Sequential(nn.Linear(8, 12), bn, nn.ReLU(), nn.Linear(12, 3))


@pytest.mark.parametrize("kind", ["no-affine", "frozen"])
def test_batchnorm_without_trainable_parameters_is_refused_or_replaced(kind):
    _, _, loader = _setup()
    model = _bn_model(kind)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(ConfigError, match=r"BatchNorm.*replace_batchnorm=True"):
        _fit(model, opt, loader, _privacy(), epochs=1)
    result = _fit(model, opt, loader, _privacy(replace_batchnorm=True), epochs=1)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in result.model.modules())
    assert isinstance(result.model[1], nn.GroupNorm)
    assert result.model[1].affine == (kind == "frozen")


def test_gdp_accountant_is_refused_because_it_underestimates():
    with pytest.raises(ConfigError, match="gdp.*underestimate"):
        _privacy(accountant="gdp").check()


def test_steps_and_sample_rate_come_from_the_real_loader():
    from opacus.accountants import RDPAccountant

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(930, 4, generator=g),
                                          torch.randint(0, 2, (930,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=10)
    result = _fit(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                  PrivacyConfig(epsilon=1.0, delta=1e-5, max_grad_norm=1.0), epochs=3)
    assert result.steps == 279 and result.privacy["steps"] == 279
    assert result.privacy["sample_rate"] == 1 / 93
    assert result.epsilon <= 1.0
    acc = RDPAccountant()
    acc.history = [(result.noise_multiplier, 1 / 93, 279)]
    assert result.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)


def test_noise_seed_is_loud_and_never_resumed_as_private(tmp_path):
    model, opt, loader = _setup()
    with pytest.warns(UserWarning, match="not private"):
        result = fit(model, opt, loader, TrainConfig(epochs=1, progress=False,
                                                     checkpoint_dir=tmp_path),
                     privacy=_privacy(noise_seed=5))
    assert result.privacy["private"] is False and result.history[0]["dp_private"] is False
    assert load_checkpoint(tmp_path / "last.pt")["privacy"]["generator"] == "seeded"
    model, opt, loader = _setup()
    with pytest.raises(ConfigError, match="noise_seed"):
        _fit(model, opt, loader, _privacy(noise_seed=None), epochs=2, checkpoint_dir=tmp_path,
             resume="auto")
    model, opt, loader = _setup()
    private = _fit(model, opt, loader, _privacy(noise_seed=None), epochs=1)
    assert private.privacy["private"] is True


def _opacus_leftovers(model: nn.Module) -> list[str]:
    found = []
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks \
                or getattr(m, "_backward_pre_hooks", None):
            found.append(f"hooks on {name or 'model'}")
        if hasattr(m, "autograd_grad_sample_hooks"):
            found.append(f"autograd_grad_sample_hooks on {name or 'model'}")
    for name, p in model.named_parameters():
        for attr in ("grad_sample", "_forward_counter", "summed_grad", "_current_grad_sample"):
            if hasattr(p, attr):
                found.append(f"{name}.{attr}")
    return found


def test_returned_model_and_averages_carry_no_opacus_state_and_train_again():
    model, opt, loader = _setup()
    result = _fit(model, opt, loader, _privacy(), epochs=2, ema_decay=0.9, swa_start=1,
                  swa_lr=0.05, swag_rank=None)
    assert type(result.model) is nn.Sequential and result.model is model
    for kept in (result.model, result.ema.module, result.swa.module):
        assert _opacus_leftovers(kept) == []
    again = _fit(result.model, opt, loader, None, epochs=1)  # plain fine-tuning
    assert again.steps > 0
    private = _fit(result.model, opt, loader, _privacy(), epochs=1)  # and private again
    assert private.epsilon > 0 and _opacus_leftovers(private.model) == []


@pytest.mark.parametrize("sampler", [
    lambda n: torch.utils.data.SubsetRandomSampler(range(n // 2)),
    lambda n: torch.utils.data.RandomSampler(range(n), replacement=True),
    lambda n: torch.utils.data.RandomSampler(range(n), num_samples=n // 2),
    lambda n: torch.utils.data.WeightedRandomSampler([1.0] * n, n),
], ids=["subset", "replacement", "fewer", "weighted"])
def test_samplers_that_do_not_cover_the_dataset_are_refused(sampler):
    model, opt, loader = _setup()
    partial = torch.utils.data.DataLoader(loader.dataset, batch_size=BATCH, sampler=sampler(N))
    with pytest.raises(ConfigError, match="sampler"):
        _fit(model, opt, partial, _privacy(), epochs=1)
    shuffled = torch.utils.data.DataLoader(loader.dataset, batch_size=BATCH, shuffle=True)
    assert _fit(model, opt, shuffled, _privacy(), epochs=1).steps == N // BATCH


def test_empty_poisson_batches_leave_train_loss_finite(tmp_path):
    import json
    import math

    model, opt, loader = _setup()
    tiny = torch.utils.data.DataLoader(loader.dataset, batch_size=1)  # q = 1/96: ~35 empty batches
    result = _fit(model, opt, tiny, _privacy(), epochs=2, metrics_path=tmp_path / "m.jsonl")
    assert all(math.isfinite(r["train_loss"]) for r in result.history)
    assert all(0 < r["nonempty_batches"] < r["batches"] for r in result.history)
    epochs = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert all(isinstance(r["train_loss"], float) for r in epochs if r["event"] == "epoch")


# ---- new options --------------------------------------------------------------------------------

def test_max_physical_batch_size_counts_logical_steps_and_gives_the_same_update():
    from opacus.accountants import RDPAccountant

    runs = {}
    for physical in (None, 3):
        model, opt, loader = _setup()
        runs[physical] = _fit(model, opt, loader, _privacy(max_physical_batch_size=physical),
                              epochs=2)
    big, small = runs[None], runs[3]
    assert small.steps == big.steps == 2 * (N // BATCH)
    assert small.history[0]["batches"] > big.history[0]["batches"]  # physical batches
    acc = RDPAccountant()
    acc.history = [(1.0, 1 / (N // BATCH), small.steps)]
    assert small.epsilon == big.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    for a, b in zip(big.model.parameters(), small.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_max_epsilon_stops_at_the_last_step_under_the_bound():
    from opacus.accountants import RDPAccountant

    model, opt, loader = _setup()
    result = _fit(model, opt, loader, _privacy(noise_multiplier=1.5, max_epsilon=2.0), epochs=50)
    acc = RDPAccountant()
    acc.history = [(1.5, 1 / (N // BATCH), result.steps)]
    assert acc.get_epsilon(1e-5) <= 2.0 == result.privacy["max_epsilon"]
    acc.history = [(1.5, 1 / (N // BATCH), result.steps + 1)]
    assert acc.get_epsilon(1e-5) > 2.0
    assert result.steps < 50 * (N // BATCH) and result.privacy["stopped_early"] is True
    assert result.epsilon <= 2.0


def test_privacy_report_in_history_and_a_large_delta_warns():
    model, opt, loader = _setup()
    with pytest.warns(UserWarning, match="delta"):
        result = fit(model, opt, loader, TrainConfig(epochs=1, progress=False),
                     privacy=_privacy(delta=1 / N, noise_seed=None))
    report = result.privacy
    assert report["sample_rate"] == 1 / (N // BATCH) and report["noise_multiplier"] == 1.0
    assert report["delta"] == 1 / N and report["accountant"] == "rdp"
    assert report["steps"] == N // BATCH and report["epsilon"] == result.epsilon
    rec = result.history[-1]
    assert (rec["dp_sample_rate"], rec["dp_noise_multiplier"], rec["dp_delta"], rec["dp_steps"],
            rec["dp_accountant"], rec["epsilon"]) == (report["sample_rate"], 1.0, 1 / N,
                                                      N // BATCH, "rdp", result.epsilon)


def test_prv_accountant_matches_opacus_by_hand():
    from opacus.accountants import PRVAccountant

    model, opt, loader = _setup()
    result = _fit(model, opt, loader, _privacy(accountant="prv"), epochs=2)
    acc = PRVAccountant()
    for _ in range(result.steps):
        acc.step(noise_multiplier=1.0, sample_rate=1 / (N // BATCH))
    assert result.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_kill_and_resume_is_bit_identical_with_physical_batches_and_ema(tmp_path):
    class Killed(RuntimeError):
        pass

    privacy = _privacy(max_physical_batch_size=5)
    kw = dict(epochs=3, ema_decay=0.9, swa_start=2, swa_lr=0.05, swag_rank=2)
    model, opt, loader = _setup()
    full = _fit(model, opt, loader, privacy, **kw)

    def kill(step, record):
        if step == 2 * (N // BATCH) + 2:  # inside epoch 3, after epoch 2's checkpoint
            raise Killed

    model, opt, loader = _setup()
    with pytest.raises(Killed), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(model, opt, loader, TrainConfig(progress=False, checkpoint_dir=tmp_path, **kw),
            privacy=privacy, on_step=kill)
    model, opt, loader = _setup(seed=99)
    resumed = _fit(model, opt, loader, privacy, checkpoint_dir=tmp_path, resume="auto", **kw)
    assert weights_digest(resumed.model) == weights_digest(full.model)
    assert weights_digest(resumed.ema.module) == weights_digest(full.ema.module)
    assert weights_digest(resumed.swa.module) == weights_digest(full.swa.module)
    assert resumed.history == full.history and resumed.epsilon == full.epsilon


def test_kill_and_resume_stops_at_the_same_step_under_max_epsilon(tmp_path):
    class Killed(RuntimeError):
        pass

    # sigma 3, q = 1/6: the bound of 2.0 is reached after 57 steps, inside epoch 10; the run is
    # killed in that epoch after the stop's epoch began, and resumes from epoch 9's checkpoint
    privacy = _privacy(noise_multiplier=3.0, max_epsilon=2.0)
    model, opt, loader = _setup()
    full = _fit(model, opt, loader, privacy, epochs=50)
    assert full.privacy["stopped_early"] is True and full.steps == 57
    kill_at = (full.steps // (N // BATCH)) * (N // BATCH) + 1  # just past epoch 9's checkpoint
    assert kill_at < full.steps

    def kill(step, record):
        if step == kill_at:
            raise Killed

    model, opt, loader = _setup()
    with pytest.raises(Killed), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(model, opt, loader, TrainConfig(epochs=50, progress=False, checkpoint_dir=tmp_path),
            privacy=privacy, on_step=kill)
    model, opt, loader = _setup(seed=99)
    resumed = _fit(model, opt, loader, privacy, epochs=50, checkpoint_dir=tmp_path,
                   resume="auto")
    assert resumed.steps == full.steps and resumed.privacy["stopped_early"] is True
    assert resumed.epsilon == full.epsilon <= 2.0
    assert weights_digest(resumed.model) == weights_digest(full.model)
    assert resumed.history == full.history


def test_a_refused_loader_leaves_the_batchnorm_model_untouched():
    model, opt, loader = _setup(bn=True)
    partial = torch.utils.data.DataLoader(loader.dataset, batch_size=BATCH,
                                          sampler=torch.utils.data.SubsetRandomSampler(range(10)))
    with pytest.raises(ConfigError, match="sampler"):
        _fit(model, opt, partial, _privacy(replace_batchnorm=True), epochs=1)
    assert isinstance(model[1], nn.BatchNorm1d)
