"""Options as data: each option is a dataclass field whose metadata says how it is checked, named
and offered on the command line, so the checks, the error messages and ``ember train``'s flags
come from one place.

An option's *name* (used in error messages and for its flag) is its group's prefix plus the field
name (``SWAConfig.start`` is ``swa_start``, flag ``--swa-start``) unless the field says otherwise.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterator, Sequence
from typing import Any

from ember.train.errors import ConfigError

__all__ = ["Option", "Rule", "check_fields", "option", "options_of", "violation"]


class Rule(enum.Enum):
    """What values an option takes (None is allowed where the option's default is None)."""

    ANY = "any"
    BOOL = "a bool"
    INT_POSITIVE = "an integer >= 1"
    INT_NONNEGATIVE = "a non-negative integer"
    POSITIVE = "> 0"
    NONNEGATIVE = ">= 0"
    FRACTION = "a fraction in [0, 1]"
    OPEN_UNIT = "in (0, 1)"
    CHOICE = "one of"
    NAMES = "a sequence of parameter names"


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_ACCEPTS = {
    Rule.ANY: lambda v: True,
    Rule.BOOL: lambda v: isinstance(v, bool),
    Rule.INT_POSITIVE: lambda v: _integer(v) and v >= 1,
    Rule.INT_NONNEGATIVE: lambda v: _integer(v) and v >= 0,
    Rule.POSITIVE: lambda v: _real(v) and v > 0,
    Rule.NONNEGATIVE: lambda v: _real(v) and v >= 0,
    Rule.FRACTION: lambda v: _real(v) and 0 <= v <= 1,
    Rule.OPEN_UNIT: lambda v: _real(v) and 0 < v < 1,
    Rule.NAMES: lambda v: not isinstance(v, str) and isinstance(v, Sequence)
    and all(isinstance(n, str) for n in v),
}


def option(default: Any = dataclasses.MISSING, rule: Rule = Rule.ANY, help: str = "", *,
           choices: Sequence[str] = (), name: str | None = None, flag: str | None = None,
           cli: bool = True, maximum: float | None = None, default_factory: Any = None,
           optional: bool | None = None) -> Any:
    """A dataclass field that is an option: ``rule`` checks it, ``help`` documents it (also as
    its flag's help), ``optional`` allows None (by default where the default is None), ``name``
    overrides the group prefix + field name, ``flag`` the flag derived from the name,
    ``cli=False`` keeps it off the command line, ``maximum`` bounds numbers."""
    meta = {"rule": rule, "help": help, "choices": tuple(choices), "name": name, "flag": flag,
            "cli": cli, "maximum": maximum,
            "optional": (default is None) if optional is None else optional}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a config group, as the checks and the CLI see it."""

    group: str  # attribute of TrainConfig holding the group ("" for TrainConfig's own fields)
    field: str
    name: str
    flag: str
    rule: Rule
    help: str
    choices: tuple[str, ...]
    default: Any
    cli: bool
    maximum: float | None
    optional: bool


def options_of(cls: type, group: str = "", prefix: str = "") -> Iterator[Option]:
    """The options among the fields of dataclass ``cls`` (fields made with :func:`option`)."""
    for f in dataclasses.fields(cls):
        if "rule" not in f.metadata:
            continue
        m = f.metadata
        name = m["name"] or prefix + f.name
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        yield Option(group, f.name, name, m["flag"] or "--" + name.replace("_", "-"), m["rule"],
                     m["help"], m["choices"], default, m["cli"], m["maximum"], m["optional"])


def violation(opt: Option, value: Any) -> str | None:
    """What is wrong with ``value`` for ``opt``, as the end of a sentence that opens with the
    option's name (``"must be > 0, got -1"``), or None if nothing is."""
    if value is None and opt.optional:
        return None
    if opt.rule is Rule.CHOICE:
        if value in opt.choices:
            return None
        return f"must be one of {', '.join(opt.choices)}, got {value!r}"
    if not _ACCEPTS[opt.rule](value):
        return f"must be {opt.rule.value}" \
            + (" or None" if opt.optional and opt.default is not None else "") + f", got {value!r}"
    if opt.maximum is not None and _real(value) and value > opt.maximum:
        return f"must be at most {opt.maximum:g}, got {value!r}"
    return None


def check_fields(config: Any, prefix: str = "", label: str = "") -> None:
    """Check every option field of ``config`` against its rule; a :class:`ConfigError` names the
    first bad one (``label`` opens the message, e.g. ``"privacy "``)."""
    for opt in options_of(type(config), prefix=prefix):
        value = getattr(config, opt.field)
        wrong = violation(opt, value)
        if wrong is None:
            continue
        if opt.rule is Rule.CHOICE:  # as torch and argparse word it
            raise ConfigError(f"unknown {label}{opt.name} {value!r}; expected one of "
                              f"{', '.join(opt.choices)}")
        raise ConfigError(f"{label}{opt.name} {wrong}")
