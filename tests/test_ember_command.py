"""The top of the ``ember`` command: ``--version``, and ``ember bench`` saying what it
measures before its silent half minute."""

from __future__ import annotations

import pytest

from ember import __version__
from ember.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"ember {__version__} (torch ")


def test_bench_says_what_it_does_before_measuring(monkeypatch, capsys):
    import ember.csprng.benchmark as benchmark

    seen = {}

    def fake_run(quick: bool = False):
        seen["stderr_before"] = capsys.readouterr().err
        return [{"case": "rand float32", "size_mib": 1, "ember_gbps": 1.0, "torch_gbps": 1.0,
                 "ratio": 1.0, "goal": None}]

    monkeypatch.setattr(benchmark, "run", fake_run)
    assert main(["bench", "csprng", "--quick"]) == 0
    assert "timing ember.csprng" in seen["stderr_before"]
    assert "torch's default generator" in seen["stderr_before"]
    assert "done in" in capsys.readouterr().err


@pytest.mark.parametrize("argv, prog, names", [
    (["train", "--data", "x", "--epochs"], "ember train", "--epochs"),
    (["train", "--epochs", "3"], "ember train", "--data"),
    (["train", "--data", "x", "--bogus"], "ember train", "--bogus"),
    (["train", "--data", "x", "--epochs", "three"], "ember train", "three"),
    (["shards", "create"], "ember shards create", "source"),
    (["shards", "nope"], "ember shards", "nope"),
    (["fly"], "ember", "fly"),
])
def test_a_usage_error_is_one_line_naming_what_was_wrong(argv, prog, names, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"{prog}: error: ") and names in lines[0], lines[0]
    assert f"{prog} --help" in lines[0]  # where the full usage is
    assert captured.out == ""


def test_help_still_prints_the_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    assert "usage: ember train" in capsys.readouterr().out


def test_the_installed_ember_command_runs_and_refuses_in_one_line(tmp_path):
    # the console script pip installs (pyproject's [project.scripts]), not `python -m ember.cli`
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    script = shutil.which("ember", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("ember is not installed beside this interpreter (run from a source tree)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([script, "--version"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith(f"ember {__version__} (torch ")
    folder = tmp_path / "photos" / "cat"
    folder.mkdir(parents=True)
    (folder / "x.png").write_text("not an image")
    done = subprocess.run([script, "shards", "create", str(tmp_path / "photos"), "-o",
                           str(tmp_path / "shards" / "s-%06d.tar")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember shards create: error: ")
    assert "x.png" in lines[0] and not (tmp_path / "shards").exists()
