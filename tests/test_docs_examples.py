"""The python examples of README.md and docs/*.md run as written, and option tables match the code.

Every fenced ```python block of README.md and of each docs/*.md page (not docs/experiments/, not
docs/_incoming/) is one test case, named ``page:line``. Each block runs on its own, as a reader
who copies it would run it: in a fresh Python process (``python -``, the block on stdin) whose
working directory is an empty temporary folder, so blocks do not build on earlier blocks of their
page and leave no state behind. An example should take seconds; one still running after
``DEADLINE_S`` (a hang, or a block that needs a cluster or a network) is killed and fails with a
message saying so (a signal in this process could not stop a library that retries through it, as
``ray.init`` did). A block that cannot run here (a GPU, S3, a cluster) carries
``<!-- skip: reason -->`` on the line right before its fence and is reported as skipped with that
reason.

``table_rows(page, heading)`` / ``table_first_column(page, heading)`` read the markdown table under
a heading, for tests that hold an option table against the code (dataclass fields, argparse flags,
signatures); this module uses them for the averagers' tables in docs/swa.md.
"""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 90  # an example takes seconds; this leaves room for a loaded 2-core machine
SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<reason>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")


@dataclass(frozen=True)
class Example:
    """One python block of a page: where it starts, its source, and why it is skipped (if it is)."""

    page: Path
    line: int
    source: str
    skip_reason: str | None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"


def doc_pages(root: Path = ROOT) -> list[Path]:
    """README.md and the pages directly under docs/ (experiments and incoming notes excluded)."""
    pages = [root / "README.md"] if (root / "README.md").exists() else []
    return pages + sorted((root / "docs").glob("*.md"))


def python_blocks(page: Path) -> list[Example]:
    """The fenced python blocks of a markdown page, in order, with their skip markers."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence = opening["fence"]
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if opening["info"].lower() in ("python", "py"):
            marker = SKIP.match(lines[i - 1]) if i > 0 else None
            body = textwrap.dedent("\n".join(lines[i + 1:end]) + "\n")
            found.append(Example(page, i + 1, body, marker["reason"] if marker else None))
        i = end + 1
    return found


def all_examples(root: Path = ROOT) -> list[Example]:
    return [example for page in doc_pages(root) for example in python_blocks(page)]


def table_rows(page: Path, heading: str) -> list[list[str]]:
    """The body rows (cells stripped) of the first markdown table under ``heading``.

    ``heading`` is the heading's text without its ``#`` marks. The table must come before the next
    heading of the same or a higher level; a missing heading or table is an AssertionError that
    names the page and the heading."""
    lines = page.read_text(encoding="utf-8").splitlines()
    level = None
    start = None
    for n, line in enumerate(lines):
        match = re.match(r"^(#+)\s+(.*?)\s*$", line)
        if match and match[2] == heading:
            level, start = len(match[1]), n + 1
            break
    assert start is not None and level is not None, f"{page.name}: no heading {heading!r}"
    rows: list[list[str]] = []
    for line in lines[start:]:
        match = re.match(r"^(#+)\s", line)
        if match and len(match[1]) <= level:
            break
        if line.lstrip().startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) >= 2, f"{page.name}: no table under {heading!r}"
    body = rows[2:] if set("".join(rows[1])) <= set("-: ") else rows[1:]
    return body


def table_first_column(page: Path, heading: str) -> list[str]:
    """The names in the first column of the table under ``heading``, backticks removed."""
    return [row[0].strip("`") for row in table_rows(page, heading)]


EXAMPLES = all_examples()


def run_example(example: Example, cwd: Path, deadline_s: float) -> None:
    """Run ``example`` in a fresh interpreter in ``cwd``; fail with its output if it raises, and
    kill it (with every process it started) and fail if it runs past ``deadline_s``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(example.source, timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: children it started go too
        proc.communicate()
        pytest.fail(f"{example.name} ran for more than {deadline_s} s (killed): make it run in "
                    "seconds on CPU or mark it <!-- skip: reason --> in the page", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"{example.name} exited with {proc.returncode}:\n{stderr[-4000:]}",
                    pytrace=False)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example_runs(example: Example, tmp_path) -> None:
    if example.skip_reason is not None:
        pytest.skip(f"{example.name}: {example.skip_reason}")
    run_example(example, tmp_path, DEADLINE_S)


def test_enough_examples_are_collected() -> None:
    """The pages keep at least 15 python examples, and each one is found by the extractor."""
    assert len(EXAMPLES) >= 15, [e.name for e in EXAMPLES]


def test_extractor_reads_fences_markers_and_tables(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n```python\nx = 1\n```\n\n<!-- skip: needs a GPU -->\n```python\ny = 2\n```\n"
        "\n```sh\nls\n```\n\n- item:\n\n  ```python\n  z = 3\n  ```\n\n"
        "## Options\n\n| option | default |\n|---|---|\n| `alpha` | 1 |\n| beta | 2 |\n\n"
        "## Next\n\n| other | x |\n|---|---|\n| gamma | 3 |\n",
        encoding="utf-8")
    blocks = python_blocks(page)
    assert [(b.line, b.source, b.skip_reason) for b in blocks] == [
        (3, "x = 1\n", None), (8, "y = 2\n", "needs a GPU"), (18, "z = 3\n", None)]
    assert table_first_column(page, "Options") == ["alpha", "beta"]
    assert table_rows(page, "Options")[1] == ["beta", "2"]
    with pytest.raises(AssertionError, match="no heading 'Missing'"):
        table_rows(page, "Missing")


def _documented_options(heading: str) -> dict[str, str]:
    return {row[0].strip("`"): row[1].strip("`") for row in table_rows(ROOT / "docs" / "swa.md", heading)}


def _signature_defaults(function) -> dict[str, str]:
    parameters = list(inspect.signature(function).parameters.values())[1:]  # self
    return {p.name: ("required" if p.default is inspect.Parameter.empty else repr(p.default))
            for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


@pytest.mark.parametrize("heading, target", [
    ("Options of SWA", "SWA"), ("Options of EMA", "EMA"), ("Options of SWAG", "SWAG"),
    ("Options of FastSWA", "FastSWA")])
def test_swa_option_tables_match_the_signatures(heading: str, target: str) -> None:
    """Every argument of the averager is in its table in docs/swa.md, with the code's default."""
    import ember.swa

    documented = _documented_options(heading)
    actual = _signature_defaults(getattr(ember.swa, target).__init__)
    assert documented == actual


def test_a_marked_block_is_skipped_with_its_reason_and_a_failing_or_slow_one_fails(tmp_path):
    page = ROOT / "README.md"
    marked = Example(page, 1, "raise RuntimeError('must not run')\n", "needs a GPU")
    with pytest.raises(pytest.skip.Exception, match="README.md:1: needs a GPU"):
        test_example_runs(marked, tmp_path)
    failing = Example(page, 2, "raise ValueError('bad example')\n", None)
    with pytest.raises(pytest.fail.Exception, match="(?s)README.md:2 exited with 1.*bad example"):
        test_example_runs(failing, tmp_path)
    slow = Example(page, 3, "import time\ntime.sleep(60)\n", None)
    with pytest.raises(pytest.fail.Exception, match="ran for more than 2 s"):
        run_example(slow, tmp_path, 2)
    writes = Example(page, 4, "open('out.txt', 'w').write('x')\n", None)
    run_example(writes, tmp_path, 60)
    assert (tmp_path / "out.txt").read_text() == "x"  # the block ran in the folder given
