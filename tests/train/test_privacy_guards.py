"""fit(privacy=...) guards: layers and buffers that would leak training data, samplers that
leave examples out, secret checkpoints, Opacus's attributes removed, clear errors."""

from __future__ import annotations

import json
import os
import stat
import sys
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("opacus")

from ember.train import ConfigError, TrainConfig, fit, weights_digest  # noqa: E402
from ember.train.checkpoint import load_checkpoint  # noqa: E402
from ember.train.privacy import PrivacyConfig  # noqa: E402

N, BATCH = 48, 8


def _data(shape=(8,)):
    g = torch.Generator().manual_seed(1234)
    return torch.utils.data.TensorDataset(torch.randn(N, *shape, generator=g),
                                          torch.randint(0, 3, (N,), generator=g))


def _loader(dataset=None, **kw):
    kw.setdefault("batch_size", BATCH)
    return torch.utils.data.DataLoader(dataset if dataset is not None else _data(), **kw)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 3))


def _privacy(**kw):
    base = dict(noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, noise_seed=3)
    base.update(kw)
    return PrivacyConfig(**base)


def _fit(model, loader, privacy, optimizer=None, **kw):
    optimizer = optimizer or torch.optim.SGD([p for p in model.parameters()
                                              if not isinstance(p, nn.parameter.UninitializedParameter)],
                                             lr=0.1)
    kw.setdefault("epochs", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fit(model, optimizer, loader, TrainConfig(progress=False, **kw), privacy=privacy)


class _Flat(nn.Module):
    def forward(self, x):
        return x.flatten(1)


# ---- 1: data-dependent buffers ------------------------------------------------------------------

@pytest.mark.parametrize("replace", [False, True])
def test_instance_norm_with_running_stats_is_refused_naming_the_layer(replace):
    torch.manual_seed(0)
    model = nn.Sequential(nn.InstanceNorm1d(4, track_running_stats=True), _Flat(),
                          nn.Linear(24, 3))
    before = weights_digest(model)
    with pytest.raises(ConfigError, match=r"'0'.*InstanceNorm1d.*track_running_stats"):
        _fit(model, _loader(_data((4, 6))), _privacy(replace_batchnorm=replace))
    assert weights_digest(model) == before
    # without running statistics, instance norm is per example: accepted
    ok = nn.Sequential(nn.InstanceNorm1d(4), _Flat(), nn.Linear(24, 3))
    assert _fit(ok, _loader(_data((4, 6))), _privacy()).steps == N // BATCH


class _Tracker(nn.Module):
    """Keeps a running mean of its inputs in a buffer: a statistic of the raw training data."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.register_buffer("seen", torch.zeros(8))
        self.register_buffer("scale", torch.ones(()))  # constant: fine

    def forward(self, x):
        if self.training and x.shape[0]:
            self.seen.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.lin(x) * self.scale


def test_a_buffer_a_training_step_changes_is_refused_and_restored():
    model = _Tracker()
    with pytest.raises(ConfigError, match=r"buffer 'seen'.*_Tracker"):
        _fit(model, _loader(), _privacy())
    assert torch.equal(model.seen, torch.zeros(8))  # no statistic of the data left in the model
    assert torch.equal(model.scale, torch.ones(()))


# ---- 2: a BatchNorm registered under two names --------------------------------------------------

class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(8, 12)
        self.bn = nn.BatchNorm1d(12, affine=False)
        self.bn2 = self.bn
        self.lin2 = nn.Linear(12, 3)

    def forward(self, x):
        return self.lin2(self.bn2(self.bn(self.lin1(x))))


def test_a_batchnorm_under_two_names_is_replaced_under_both():
    torch.manual_seed(0)
    model = _Shared()
    with pytest.raises(ConfigError, match="BatchNorm"):
        _fit(model, _loader(), _privacy())
    result = _fit(model, _loader(), _privacy(replace_batchnorm=True))
    assert isinstance(model.bn, nn.GroupNorm) and model.bn2 is model.bn
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                   for _, m in result.model.named_modules(remove_duplicate=False))


# ---- 3: samplers that do not cover the loader's dataset ----------------------------------------

@pytest.mark.parametrize("make", [
    lambda ds: torch.utils.data.SequentialSampler(range(N - 8)),
    lambda ds: torch.utils.data.SequentialSampler(list(range(N - 8))),
    lambda ds: torch.utils.data.DistributedSampler(range(N - 8), num_replicas=1, rank=0),
    lambda ds: torch.utils.data.RandomSampler(range(N - 8), num_samples=N),
], ids=["sequential-range", "sequential-list", "distributed", "random-num-samples"])
def test_samplers_over_fewer_examples_than_the_dataset_are_refused(make):
    ds = _data()
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=make(ds))
    model = _mlp()
    with pytest.raises(ConfigError, match=r"sampler \((SequentialSampler|DistributedSampler|"
                                          r"RandomSampler)\)"):
        _fit(model, loader, _privacy())


def test_samplers_over_the_whole_dataset_are_accepted():
    ds = _data()
    for sampler in (torch.utils.data.SequentialSampler(ds),
                    torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0)):
        loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler)
        assert _fit(_mlp(), loader, _privacy()).steps == N // BATCH


# ---- 4: checkpoints hold the noise key ----------------------------------------------------------

@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permission bits")
def test_private_checkpoints_are_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        _fit(_mlp(), _loader(), _privacy(noise_seed=None), checkpoint_dir=tmp_path / "ck")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "ck" / "last.pt").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "ck").st_mode) == 0o700


def _cli(tmp_path, *extra):
    from ember.cli import main
    from ember.demo import write_digits_shards

    shards = write_digits_shards(tmp_path / "digits", maxcount=200)
    out = tmp_path / "out"
    rc = main(["train", "--data", shards["train"], "--num-classes", "10", "--epochs", "1",
               "--batch-size", "64", "--max-grad-norm", "1.0", "--dp-delta", "1e-5",
               "--no-progress", "--out", str(out), "--swag-rank", "0", *extra])
    return rc, out


def test_cli_removes_the_private_checkpoint_unless_asked_and_never_publishes_the_key(
        tmp_path, capsys):
    rc, out = _cli(tmp_path, "--dp-epsilon", "8")
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert not (out / "checkpoints" / "last.pt").exists()
    assert "noise key" in printed.out and "--keep-checkpoints" in printed.out
    summary = json.loads((out / "summary.json").read_text())
    assert "train_loss" in summary["privacy"]["not_covered_by_dp"]  # item 6

    rc, out = _cli(tmp_path / "kept", "--dp-epsilon", "8", "--keep-checkpoints")
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    ckpt = out / "checkpoints" / "last.pt"
    assert ckpt.is_file() and "noise key" in printed.out and "do not publish" in printed.out
    if sys.platform != "win32":
        assert stat.S_IMODE(os.stat(ckpt).st_mode) == 0o600
    # key: bytes 8..24 of an ember.csprng state (see ember.csprng.generator._state_bytes)
    key = bytes(load_checkpoint(ckpt)["privacy"]["generator_states"][0][8:24].numpy())
    assert len(key) == 16 and any(key)
    for name in ("model.pt", "summary.json", "metrics.jsonl"):
        blob = (out / name).read_bytes()
        assert key not in blob and key.hex().encode() not in blob, name
    assert b"generator_states" not in (out / "summary.json").read_bytes()


# ---- 5: Opacus's activations left on the modules ------------------------------------------------

def _opacus_attributes(model):
    names = ("activations", "max_batch_len", "ft_compute_sample_grad", "autograd_grad_sample_hooks",
             "norm_sample", "_forward_counter")
    return [(n, a) for n, m in model.named_modules() for a in names if hasattr(m, a)]


def test_no_opacus_module_attributes_are_left_after_a_run_or_an_error():
    model = _mlp()
    _fit(model, _loader(), _privacy())
    assert _opacus_attributes(model) == []

    model, calls = _mlp(), [0]

    def bad_loss(logits, y):  # raises after the forward stored the batch's inputs
        calls[0] += 1
        if calls[0] == 2:
            raise ValueError("bad loss")
        return nn.functional.cross_entropy(logits, y)

    with pytest.raises(ValueError, match="bad loss"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader(),
            TrainConfig(epochs=1, progress=False), loss_fn=bad_loss, privacy=_privacy())
    assert _opacus_attributes(model) == []


# ---- 6: what epsilon does not cover -------------------------------------------------------------

def test_the_report_lists_the_fields_epsilon_does_not_cover():
    result = _fit(_mlp(), _loader(), _privacy())
    uncovered = result.privacy["not_covered_by_dp"]
    assert {"train_loss", "nonempty_batches", "batches"} <= set(uncovered)
    assert all(k in result.history[0] for k in ("train_loss", "nonempty_batches", "batches"))


# ---- 7: an unreachable epsilon ------------------------------------------------------------------

def test_too_low_an_epsilon_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"epsilon=0\.0001 is too low"):
        _fit(_mlp(), _loader(), PrivacyConfig(epsilon=1e-4, delta=1e-5, max_grad_norm=1.0),
             epochs=50)


def test_cli_too_low_epsilon_is_one_error_line(tmp_path, capsys):
    rc, _ = _cli(tmp_path, "--dp-epsilon", "0.0001", "--epochs", "50")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("ember train: error: --dp-epsilon 0.0001 is too low")


# ---- 8: lazy BatchNorm --------------------------------------------------------------------------

def test_uninitialised_lazy_batchnorm_is_refused_with_replace_batchnorm():
    model = nn.Sequential(nn.Linear(8, 12), nn.LazyBatchNorm1d(), nn.Linear(12, 3))
    with pytest.raises(ConfigError, match=r"'1'.*LazyBatchNorm1d.*uninitiali"):
        _fit(model, _loader(), _privacy(replace_batchnorm=True),
             optimizer=torch.optim.SGD([model[0].weight], lr=0.1))


# ---- 9: a model in eval mode --------------------------------------------------------------------

def test_a_model_in_eval_mode_is_trained_in_train_mode():
    model = _mlp().eval()
    result = _fit(model, _loader(), _privacy())
    assert result.steps == N // BATCH and model.training


# ---- 10: resuming with another noise_seed -------------------------------------------------------

def test_resuming_with_another_noise_seed_is_refused(tmp_path):
    _fit(_mlp(), _loader(), _privacy(noise_seed=1), checkpoint_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"noise_seed"):
        _fit(_mlp(), _loader(), _privacy(noise_seed=2), epochs=2, checkpoint_dir=tmp_path,
             resume="auto")
    assert _fit(_mlp(), _loader(), _privacy(noise_seed=1), epochs=2, checkpoint_dir=tmp_path,
                resume="auto").privacy["steps"] == 2 * (N // BATCH)


# ---- 12: PyTorch's full-backward-hook warning ---------------------------------------------------

def test_private_fit_does_not_print_the_full_backward_hook_warning():
    model = _mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader(),
            TrainConfig(epochs=1, progress=False), privacy=_privacy(noise_seed=None))
    messages = [str(w.message) for w in caught]
    assert not any("Full backward hook" in m for m in messages), messages

