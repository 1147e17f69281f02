"""Bad configuration, missing shards and bad batches give clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ember.cli import main
from ember.train import ConfigError, TrainConfig, check_shards, fit, image_class_loader


@pytest.mark.parametrize("kwargs, message", [
    ({"epochs": 0}, "epochs must be an integer >= 1"),
    ({"accumulate": 0}, "accumulate must be an integer >= 1"),
    ({"precision": "fp8"}, "unknown precision 'fp8'"),
    ({"swa_start": 5, "swa_lr": 0.1, "epochs": 5}, r"swa_start must be an epoch in \[0, epochs=5\)"),
    ({"swa_start": 1}, "swa_start needs swa_lr"),
    ({"swa_lr": 0.1}, "swa_lr is set but swa_start is None"),
    ({"max_grad_norm": -1.0}, "max_grad_norm must be > 0"),
    ({"checkpoint_every": 10}, "checkpoint_every needs checkpoint_dir"),
    ({"seed": -3}, "seed must be a non-negative integer"),
    ({"swag_rank": 0}, "swag_rank must be an integer >= 1"),
])
def test_bad_train_config_names_the_option(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs).check()


def test_missing_shards_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"2 of 2 shards not found: .*a-0\.tar"):
        check_shards(str(tmp_path / "a-{0..1}.tar"))
    with pytest.raises(ConfigError, match="not found"):
        image_class_loader(str(tmp_path / "none.tar"), 8)


def test_ember_train_reports_missing_shards(tmp_path, capsys):
    rc = main(["train", "--data", str(tmp_path / "train-{000000..000009}.tar"), "--num-classes", "10"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "ember train: error: --data: 10 of 10 shards not found" in err


def test_ember_train_rejects_unknown_precision(capsys, digits_shards):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--data", digits_shards["train"], "--num-classes", "10", "--precision", "fp8"])
    assert exc.value.code == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_ember_train_rejects_inconsistent_options(capsys, digits_shards):
    rc = main(["train", "--data", digits_shards["train"], "--num-classes", "10",
               "--dp-epsilon", "1.0", "--dp-delta", "1e-5"])
    assert rc == 2
    assert "DP-SGD needs all of --dp-epsilon, --dp-delta and --max-grad-norm" in capsys.readouterr().err
    rc = main(["train", "--data", digits_shards["train"], "--num-classes", "10",
               "--dp-noise-multiplier", "1.0"])
    assert rc == 2
    assert "--dp-noise-multiplier was removed" in capsys.readouterr().err
    rc = main(["train", "--data", digits_shards["train"], "--num-classes", "1"])
    assert rc == 2
    assert "--num-classes must be >= 2" in capsys.readouterr().err


def test_ember_train_rejects_labels_outside_num_classes(tmp_path, capsys, digits_shards):
    rc = main(["train", "--data", digits_shards["train_small"], "--num-classes", "5", "--grayscale",
               "--epochs", "1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "label 5 is outside [0, 5)" in err and "--num-classes" in err and "sample" in err


def test_ember_train_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for option in ("--data", "--eval-data", "--num-classes", "--precision", "--accumulate",
                   "--clip-grad-norm", "--swa-start", "--swa-lr", "--swag-rank",
                   "--dp-epsilon", "--dp-delta", "--max-grad-norm", "--checkpoint-every", "--resume",
                   "--out", "torchrun"):
        assert option in text


def test_batches_must_be_input_target_pairs():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"expected batches of \(inputs, targets\)"):
        fit(model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.zeros(3, 2)],
            TrainConfig(epochs=1, progress=False))


def test_ember_train_resumes_and_extends_a_run(tmp_path, capsys, digits_shards):
    common = ["train", "--data", digits_shards["train_small"], "--eval-data", digits_shards["test"],
              "--num-classes", "10", "--grayscale", "--batch-size", "32", "--out", str(tmp_path),
              "--no-progress", "--resume", "auto"]
    assert main(common + ["--epochs", "1"]) == 0
    first = json.loads((tmp_path / "summary.json").read_text())
    assert main(common + ["--epochs", "2"]) == 0  # continues from the epoch-1 checkpoint
    second = json.loads((tmp_path / "summary.json").read_text())
    assert second["steps"] == 2 * first["steps"]
    assert [r["epoch"] for r in second["history"]] == [0, 1]
    assert second["history"][0] == first["history"][0]
    events = [json.loads(x)["event"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert events.count("start") == 1 and events.count("resume") == 1
    assert "test accuracy" in capsys.readouterr().out
    assert (tmp_path / "model.pt").is_file()
