"""``ember train`` and the ``ember`` command: the old run survives
an exception during its own restore, absurd --dp-epsilon, classes.json beside every shard,
resuming across DP and non-DP, options that need another option, interrupts at start-up."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
from test_cli_failures_and_limits import _args, _png, _shard
from test_cli_user_data import ember, one_error_line, snapshot


def _good(folder: Path, n: int = 6, classes: list[str] | None = None) -> Path:
    shard = _shard(folder / "s.tar", [(f"g{i:03d}", _png(8, 8, i % 5), str(i % 2).encode())
                                      for i in range(n)])
    if classes is not None:
        (folder / "classes.json").write_text(json.dumps({"classes": classes}))
    return shard


def test_the_old_run_comes_back_even_if_the_restore_is_interrupted(tmp_path, monkeypatch):
    from ember.train import cli

    _good(tmp_path)
    out = tmp_path / "run"
    assert ember(*_args(tmp_path / "s.tar", out)).returncode == 0
    before = snapshot(out)
    guard = cli._prepare_out(out, None, force=True)  # moves the old run aside
    (out / "metrics.jsonl").write_text("the new run's log\n")
    real, calls = os.replace, []

    def flaky(src, dst):  # the first move back fails as torch's SIGCHLD handler would make it
        calls.append(src)
        if len(calls) == 1:
            raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated")
        return real(src, dst)

    monkeypatch.setattr(cli.os, "replace", flaky)
    with contextlib.suppress(RuntimeError):
        guard.failed()
    monkeypatch.setattr(cli.os, "replace", real)
    assert snapshot(out) == before
    assert not [p for p in out.iterdir() if p.name.startswith(".ember-replaced")]


@pytest.mark.parametrize("eps", ["1e20", "101"])
def test_an_absurd_dp_epsilon_is_one_line(eps, tmp_path):
    _good(tmp_path)
    line = one_error_line(ember(*_args(tmp_path / "s.tar", tmp_path / "run", "--dp-epsilon", eps,
                                       "--dp-delta", "1e-5", "--max-grad-norm", "1")))
    assert "--dp-epsilon" in line and "100" in line


@pytest.mark.parametrize("flag", ["--data", "--eval-data"])
def test_classes_json_is_read_beside_every_shard_folder(flag, tmp_path):
    a = _good(tmp_path / "a", classes=["cat", "dog"])
    b = _good(tmp_path / "b", classes=["cat", "eel"])
    both = str(tmp_path / "{a,b}" / "s.tar")
    args = ["train", "--data", both if flag == "--data" else str(a), "--epochs", "1",
            "--out", str(tmp_path / "run"), "--no-progress"]
    if flag == "--eval-data":
        args += ["--eval-data", both]
    line = one_error_line(ember(*args))
    assert "classes.json" in line and str(b.parent) in line


def test_resuming_a_run_without_dp_with_dp_options_is_in_flag_terms(tmp_path):
    _good(tmp_path, 8)
    out = tmp_path / "run"
    assert ember(*_args(tmp_path / "s.tar", out)).returncode == 0
    line = one_error_line(ember(*_args(tmp_path / "s.tar", out, "--epochs", "2", "--resume", "auto",
                                       "--dp-epsilon", "1", "--dp-delta", "1e-5",
                                       "--max-grad-norm", "1")))
    assert "--dp-epsilon" in line and "load_state_dict" not in line and "ShardLoader" not in line


@pytest.mark.parametrize("extra, needs", [
    (["--swa-anneal-epochs", "2"], "--swa-start"),
    (["--dp-accountant", "prv"], "--dp-epsilon"),
    (["--lr", "1e-300"], "float32"),
])
def test_options_that_do_nothing_are_refused(extra, needs, tmp_path):
    _good(tmp_path)
    line = one_error_line(ember(*_args(tmp_path / "s.tar", tmp_path / "run", *extra)))
    assert extra[0] in line and needs in line


@pytest.mark.parametrize("argv, prog", [(["train", "--data", "x"], "ember train"),
                                        (["shards", "ls", "x.tar"], "ember shards ls")])
def test_ctrl_c_before_the_command_starts_is_one_line(argv, prog, monkeypatch):
    import ember.cli as top

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(top, "build_parser", lambda commands=None: _Raising(interrupted))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = top.main(argv)
    assert code == 130
    assert err.getvalue().splitlines() == [f"{prog.split()[0]} {argv[0]}: interrupted"]


class _Raising:
    def __init__(self, fn):
        self.parse_args = fn
