"""docs/train.md's option tables equal the code: the config groups' fields and defaults
(``ember.train.config.train_options()``, the dataclasses, ``PrivacyConfig``) and ``ember train``'s
flags and defaults (``ember.train.cli.config_options()`` and the argparse parser itself), so the
page cannot drift from what it documents."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from ember.cli import build_parser
from ember.train.cli import config_options
from ember.train.config import (
    CheckpointConfig,
    EMAConfig,
    LogConfig,
    ScheduleConfig,
    StepConfig,
    SWAConfig,
    SWAGConfig,
    TrainConfig,
    train_options,
)
from ember.train.options import options_of
from ember.train.privacy_config import PrivacyConfig

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "train.md"

# Option.group -> the class whose field it is
GROUP_CLASS = {"": TrainConfig, "step": StepConfig, "schedule": ScheduleConfig, "swa": SWAConfig,
               "swag": SWAGConfig, "ema": EMAConfig, "checkpoint": CheckpointConfig,
               "log": LogConfig, "privacy": PrivacyConfig}


def split_row(line: str) -> list[str]:
    """The cells of a markdown table row; a ``|`` inside a code span or escaped as ``\\|`` does
    not split."""
    cells, cell, in_code = [], [], False
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and body[i + 1:i + 2] == "|":
            cell.append("|")
            i += 2
            continue
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            cells.append("".join(cell).strip())
            cell = []
        else:
            cell.append(ch)
        i += 1
    cells.append("".join(cell).strip())
    return cells


def read_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every table of a markdown page: (header cells, rows of cells)."""
    tables, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        is_table = lines[i].lstrip().startswith("|") and i + 1 < len(lines) \
            and re.fullmatch(r"\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*", lines[i + 1])
        if not is_table:
            i += 1
            continue
        header, rows, i = split_row(lines[i]), [], i + 2
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            rows.append(split_row(lines[i]))
            i += 1
        tables.append((header, rows))
    return tables


def code(cell: str) -> str:
    """The first code span of a cell (``"`None` when ..."`` -> ``"None"``)."""
    found = re.search(r"`([^`]*)`", cell)
    assert found is not None, f"no `code` in table cell {cell!r}"
    return found.group(1)


def table(header_first: str) -> list[list[str]]:
    """The rows of the one table whose first header cell is ``header_first``."""
    found = [rows for header, rows in read_tables(PAGE.read_text()) if header[0] == header_first]
    assert len(found) == 1, f"expected one table headed {header_first!r}, found {len(found)}"
    return found[0]


def test_the_table_reader_reads_code_spans_and_escaped_bars():
    text = "intro\n\n| a | b |\n|---|:--:|\n| `x|y` | one \\| two |\n| `z` | |\n\nafter | no\n"
    assert read_tables(text) == [(["a", "b"], [["`x|y`", "one | two"], ["`z`", ""]])]


@pytest.mark.parametrize("cls", [TrainConfig, StepConfig, ScheduleConfig, SWAConfig, SWAGConfig,
                                 EMAConfig, CheckpointConfig, LogConfig, PrivacyConfig],
                         ids=lambda c: c.__name__)
def test_each_config_table_lists_the_options_and_defaults_of_its_class(cls):
    rows = table(f"`{cls.__name__}` field")
    documented = [(code(r[0]), ast.literal_eval(code(r[1]))) for r in rows]
    assert documented == [(o.field, o.default) for o in options_of(cls)]
    assert all(r[2] for r in rows), "every option has a meaning"


def test_the_group_tables_together_are_train_options():
    documented = set()
    for opt in train_options():
        rows = table(f"`{GROUP_CLASS[opt.group].__name__}` field")
        documented |= {(opt.name, code(r[0])) for r in rows if code(r[0]) == opt.field}
    assert documented == {(o.name, o.field) for o in train_options()}


def test_the_groups_table_lists_trainconfigs_groups_and_their_defaults():
    groups = [f for f in dataclasses.fields(TrainConfig) if "rule" not in f.metadata]
    rows = table("`TrainConfig` group")
    assert [code(r[0]) for r in rows] == [f.name for f in groups]
    for row, f in zip(rows, groups, strict=True):
        if f.default is None:
            assert code(row[1]) == "None", f.name
        else:
            assert code(row[1]) == f"{f.default_factory.__name__}()", f.name  # type: ignore[union-attr]


def _train_parser() -> argparse.ArgumentParser:
    parser = build_parser(["train"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _flag_actions() -> dict[str, argparse.Action]:
    """``ember train``'s documented flags (long form) -> their actions (help shown)."""
    out = {}
    for action in _train_parser()._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        out[next(s for s in action.option_strings if s.startswith("--"))] = action
    return out


def _shown_default(action: argparse.Action, prog: str) -> str:
    """What ``--help`` shows as the flag's default: ``(default: X)`` at the end of its help."""
    text = action.help or ""
    text = text % dict(vars(action), prog=prog) if "%" in text else text
    found = re.search(r"\(default: (.*)\)$", text)
    assert found is not None, f"{action.option_strings[0]}'s help shows no default"
    return found.group(1)


def test_the_generated_flag_table_is_config_options():
    rows = table("generated flag")
    options = {o.flag: o for o in config_options()}
    in_help_order = [flag for flag in _flag_actions() if flag in options]
    assert [code(r[0]) for r in rows] == in_help_order
    assert set(in_help_order) == set(options)
    for row in rows:
        opt = options[code(row[0])]
        assert code(row[2]) == f"{GROUP_CLASS[opt.group].__name__}.{opt.field}", opt.flag


def test_the_generated_flags_defaults_are_those_ember_train_help_shows():
    actions, prog = _flag_actions(), _train_parser().prog
    for row in table("generated flag"):
        assert code(row[1]) == _shown_default(actions[code(row[0])], prog), code(row[0])


def test_the_flag_tables_together_are_every_flag_of_the_parser():
    documented = [code(r[0]) for r in table("generated flag") + table("command flag")]
    assert len(documented) == len(set(documented)), "a flag is documented twice"
    assert set(documented) == set(_flag_actions())


def test_the_commands_own_flags_show_the_parsers_defaults():
    actions = _flag_actions()
    for row in table("command flag"):
        action = actions[code(row[0])]
        if action.required:
            expected = "required"
        elif isinstance(action, argparse._StoreTrueAction):
            expected = "off"
        elif action.default is None:
            expected = "none"
        else:
            expected = str(action.default)
        assert code(row[1]) == expected, code(row[0])


def test_the_page_cites_only_files_that_exist_and_no_removed_names():
    text = PAGE.read_text()
    for path in set(re.findall(r"\btests/[\w/]+\.py\b", text)):
        assert (ROOT / path).is_file(), path
    for name in set(re.findall(r"\b(test_\w+\.py)\b", text)):
        assert list((ROOT / "tests").rglob(name)), name
    for link in set(re.findall(r"\]\(([\w/.-]+\.md)", text)):
        assert (PAGE.parent / link).is_file(), link
    assert "GaussianGradientNoise" not in text
    assert "needs max_grad_norm" not in text  # the error TrainConfig.noise_multiplier had
