"""The python examples of README.md and docs/*.md run as written, and option tables match the code.

Every fenced ```python block of README.md and of each docs/*.md page (not docs/experiments/, not
docs/_incoming/) is one test case, named ``page:line``. Each block runs on its own: a fresh
namespace, executed in this process with a fresh temporary directory as the working directory, so
a reader can copy any single block and run it (blocks do not build on earlier blocks of their
page). torch's global random state and thread count are restored afterwards. An example should
take seconds; one still running after ``DEADLINE_S`` (a hang, or a block that needs a cluster or
a network) fails with a message saying so. A block that cannot
run here (a GPU, S3, a cluster) carries ``<!-- skip: reason -->`` on the line right before its
fence and is reported as skipped with that reason.

``table_rows(page, heading)`` / ``table_first_column(page, heading)`` read the markdown table under
a heading, for tests that hold an option table against the code (dataclass fields, argparse flags,
signatures); this module uses them for the averagers' tables in docs/swa.md.
"""

from __future__ import annotations

import inspect
import re
import signal
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

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


@pytest.fixture
def restored_torch_state(tmp_path, monkeypatch):
    """Runs the test in an empty directory and gives torch its random state and threads back."""
    monkeypatch.chdir(tmp_path)
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    yield tmp_path
    torch.set_rng_state(rng)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example_runs(example: Example, restored_torch_state) -> None:
    if example.skip_reason is not None:
        pytest.skip(f"{example.name}: {example.skip_reason}")
    code = compile(example.source, example.name, "exec")

    def over_time(signum, frame):
        raise TimeoutError(f"{example.name} ran for more than {DEADLINE_S} s: make it run in "
                           "seconds on CPU or mark it <!-- skip: reason --> in the page")

    previous = signal.signal(signal.SIGALRM, over_time)
    signal.alarm(DEADLINE_S)
    try:
        exec(code, {"__name__": "__docs_example__"})
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


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


def test_a_marked_block_is_skipped_with_its_reason_and_a_slow_one_fails(monkeypatch, tmp_path):
    page = ROOT / "README.md"
    marked = Example(page, 1, "raise RuntimeError('must not run')\n", "needs a GPU")
    with pytest.raises(pytest.skip.Exception, match="README.md:1: needs a GPU"):
        test_example_runs(marked, tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "DEADLINE_S", 1)
    slow = Example(page, 1, "import time\ntime.sleep(30)\n", None)
    with pytest.raises(TimeoutError, match="ran for more than 1 s"):
        test_example_runs(slow, tmp_path)
