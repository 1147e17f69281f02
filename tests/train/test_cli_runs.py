"""ember train and the run already in --out: a finished run is never retrained by --resume auto,
a private one is continued only with its accountant; plus the options that write more outputs
(--ema-decay, --swag-rank), the chosen --image-size, --skip-bad's list and one-line warnings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli_failures_and_limits import _args, _png, _shard
from test_cli_user_data import ember, one_error_line, snapshot

pytest.importorskip("opacus")

DP = ["--dp-epsilon", "8", "--dp-delta", "1e-3", "--max-grad-norm", "1"]


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    return _shard(root / "s.tar", [(f"k{i:03d}", _png(8, 8, i % 5), str(i % 2).encode())
                                   for i in range(24)])


def test_resume_auto_never_retrains_a_finished_private_run(shard, tmp_path):
    out = tmp_path / "run"
    assert ember(*_args(shard, out, *DP, "--epochs", "2")).returncode == 0
    before = snapshot(out)
    line = one_error_line(ember(*_args(shard, out, *DP, "--epochs", "2", "--resume", "auto")))
    assert "already finished 2 of --epochs 2" in line and "larger --epochs" in line
    assert snapshot(out) == before


def test_more_epochs_of_a_private_run_without_its_checkpoint_is_refused(shard, tmp_path):
    out = tmp_path / "run"
    assert ember(*_args(shard, out, *DP, "--epochs", "1")).returncode == 0
    before = snapshot(out)
    line = one_error_line(ember(*_args(shard, out, *DP, "--epochs", "3", "--resume", "auto")))
    assert "accountant" in line and "another --out" in line
    assert snapshot(out) == before


def test_more_epochs_continue_a_private_run_and_compose_its_budget(shard, tmp_path):
    out = tmp_path / "run"
    done = ember(*_args(shard, out, *DP, "--epochs", "1", "--keep-checkpoints"))
    assert done.returncode == 0, done.stderr
    first = json.loads((out / "summary.json").read_text())
    done = ember(*_args(shard, out, *DP, "--epochs", "2", "--resume", "auto",
                        "--keep-checkpoints"))
    assert done.returncode == 0, done.stderr
    second = json.loads((out / "summary.json").read_text())
    assert second["privacy"]["steps"] == 2 * first["privacy"]["steps"]
    assert second["privacy"]["noise_multiplier"] == first["privacy"]["noise_multiplier"]
    assert second["epsilon"] > first["epsilon"]
    assert "ember train: warning: continuing the private run" in done.stderr
    assert second["epochs_done"] == 2 and second["finished"]


def test_a_second_private_run_on_the_same_data_says_budgets_add_up(shard, tmp_path):
    out = tmp_path / "run"
    assert ember(*_args(shard, out, *DP)).returncode == 0
    done = ember(*_args(shard, out, *DP, "--force"))
    assert done.returncode == 0, done.stderr
    assert "add up" in done.stdout and "epsilon" in done.stdout


def test_small_private_batches_with_empty_poisson_batches_train(shard, tmp_path):
    out = tmp_path / "run"
    done = ember(*_args(shard, out, *DP, "--batch-size", "1", "--epochs", "2"))
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["empty_steps"] > 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert not any(r.get("loss") == "nan" for r in steps)


def test_ema_and_swag_are_saved_and_evaluated(shard, tmp_path):
    out = tmp_path / "run"
    done = ember(*_args(shard, out, "--epochs", "3", "--swa-start", "1", "--swag-rank", "2",
                        "--swag-samples", "3", "--ema-decay", "0.9", "--eval-data", str(shard)))
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "ema.pt").exists() and (out / "swag.pt").exists()
    assert "eval_ema_accuracy" in summary["history"][-1]
    assert summary["swag"]["collected"] == 2 and summary["swag"]["samples"] == 3
    assert 0 <= summary["swag"]["eval_accuracy"] <= 1 and summary["swag"]["eval_nll"] > 0
    assert "SWAG (3 samples)" in done.stdout


def test_the_image_size_chosen_from_the_first_image_is_printed(tmp_path):
    big = _shard(tmp_path / "big.tar", [(f"k{i}", _png(300, 200, i), str(i % 2).encode())
                                        for i in range(4)])
    done = ember(*_args(big, tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    assert "training on 64x64 images (the first image is 200x300" in done.stdout
    small = _shard(tmp_path / "small.tar", [(f"k{i}", _png(12, 10, i), str(i % 2).encode())
                                            for i in range(4)])
    done = ember(*_args(small, tmp_path / "run2"))
    assert "training on 10x12 images (the first image's size" in done.stdout


def test_skip_bad_names_what_it_skipped(tmp_path):
    bad = _shard(tmp_path / "d" / "b.tar", [("good0", _png(8, 8), b"0"), ("junk1", b"nope", b"1"),
                                            ("good2", _png(8, 8, 2), b"1")])
    out = tmp_path / "run"
    done = ember(*_args(bad, out, "--skip-bad", "--image-size", "8"))
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    items = summary["skipped_bad_items"]
    assert items and all("junk1" in json.dumps(i) for i in items)
    assert "junk1" in done.stdout and "b.tar" in done.stdout
    assert not list(out.glob(".skipped-*"))


def test_a_delta_above_one_over_n_is_a_one_line_warning(shard, tmp_path):
    done = ember(*_args(shard, tmp_path / "run", "--dp-epsilon", "8", "--dp-delta", "0.5",
                        "--max-grad-norm", "1"))
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "delta" in line]
    assert warned and all(line.startswith("ember train: warning: ") for line in warned)
    assert "warnings.warn" not in done.stderr and "UserWarning" not in done.stderr


def test_seed_help_does_not_claim_to_seed_the_dp_noise():
    done = ember("train", "--help")
    text = " ".join(done.stdout.split())
    assert "DP-SGD noise is always keyed from the OS" in text
    assert "--ema-decay" in text and "--dp-max-epsilon" in text


def test_skip_bad_on_evaluation_data_is_marked_and_leaves_no_file(tmp_path):
    bad = _shard(tmp_path / "d" / "b.tar", [("good0", _png(8, 8), b"0"), ("junk1", b"nope", b"1"),
                                            ("good2", _png(8, 8, 2), b"1")])
    out = tmp_path / "run"
    done = ember(*_args(bad, out, "--skip-bad", "--image-size", "8", "--eval-data", str(bad),
                        "--swa-start", "0", "--swag-rank", "2", "--epochs", "2",
                        "--swag-samples", "2"))
    assert done.returncode == 0, done.stderr
    assert not list(out.glob(".skipped-*"))
    items = json.loads((out / "summary.json").read_text())["skipped_bad_items"]
    assert {i["during"] for i in items} == {"training", "evaluation"}
    assert all(i["key"] == "junk1" for i in items)


@pytest.mark.parametrize("extra, words", [
    (["--accumulate", "2"], ["--accumulate", "--dp-max-physical-batch-size"]),
    (["--checkpoint-every", "3"], ["--checkpoint-every", "epoch"]),
    (["--precision", "bf16"], ["--precision", "fp32"]),
    (["--dp-max-epsilon", "0.0001"], ["--dp-max-epsilon"]),
])
def test_dp_refusals_are_in_flag_terms(shard, tmp_path, extra, words):
    line = one_error_line(ember(*_args(shard, tmp_path / "run", *DP, *extra)))
    for w in words:
        assert w in line
    for python in ("privacy ", "PrivacyConfig", "_"):
        assert python not in line.split("error: ", 1)[1].replace(str(tmp_path), ""), line


def test_swag_samples_needs_swag_rank(shard, tmp_path):
    line = one_error_line(ember(*_args(shard, tmp_path / "run", "--swag-samples", "5")))
    assert "--swag-samples" in line and "--swag-rank" in line


def test_data_given_twice_is_refused_naming_the_brace_pattern(shard, tmp_path):
    done = ember("train", "--data", str(shard), "--data", str(shard), "--num-classes", "2",
                 "--out", str(tmp_path / "run"), "--no-progress")
    assert done.returncode == 2
    assert "--data" in done.stderr and "{000000..000009}" in done.stderr
    assert not (tmp_path / "run").exists()


def test_the_swa_models_accuracy_is_printed_and_sizes_say_height_by_width(tmp_path):
    wide = _shard(tmp_path / "w.tar", [(f"k{i}", _png(80, 60, i), str(i % 2).encode())
                                       for i in range(4)])
    done = ember(*_args(wide, tmp_path / "run", "--epochs", "2", "--swa-start", "1",
                        "--eval-data", str(wide)))
    assert done.returncode == 0, done.stderr
    assert "the first image is 60x80 (height x width)" in done.stdout
    assert "SWA: test accuracy" in done.stdout
