"""The ``ember`` command: one sub-command per subsystem, each registered by its own module."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

# command -> (the module whose ``register(subparsers)`` adds it and sets ``func`` on the parsed
# namespace, its line in `ember --help`). Only the module of the command being run is imported,
# so `ember --help` and `ember --version` do not import torch.
_COMMANDS = {
    "demo": ("ember.demo", "a pre-specified SGD/SWA/SWAG experiment on noisy digits, DP-SGD, "
             "speed; writes report.html"),
    "bench": ("ember.bench_cli", "run a benchmark and print its table"),
    "shards": ("ember.shards.cli", "inspect and re-shard WebDataset tar shards"),
    "train": ("ember.train.cli", "train a classifier on your own image + cls shards"),
}


def _version() -> str:
    from importlib import metadata

    from ember import __version__

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    return f"ember {__version__} (torch {torch}, Python {sys.version.split()[0]})"


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, ``PROG: error: WHAT (see PROG --help)``,
    exit status 2; sub-command parsers made from it are of the same kind."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if not hasattr(namespace, "_deepest_prog"):  # the innermost sub-command finishes first
            namespace._deepest_prog = self.prog
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        prog = vars(namespace).pop("_deepest_prog", self.prog)
        if extras:  # named by the sub-command they were given to, not by the top level
            message = f"unrecognized arguments: {' '.join(extras)}"
            self.exit(2, f"{prog}: error: {message} (see {prog} --help)\n")
        return namespace


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``ember`` parser with the full options of ``commands`` (default: every command); the
    others are listed by name and help line only."""
    parser = OneLineParser(
        prog="ember",
        description="ember: secure randomness, tar-shard streaming, weight averaging and "
        "training for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    full = set(_COMMANDS if commands is None else commands)
    for name, (module_name, help_line) in _COMMANDS.items():
        if name in full:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name != module_name:  # a real missing dependency inside it: report it
                    raise
            else:
                module.register(sub)
                continue
        sub.add_parser(name, help=help_line, add_help=False)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The sub-command named on the command line, if any (the first argument that is not an
    option: the top level has no options that take values)."""
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg if arg in _COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command(argv)
    try:
        parser = build_parser([command] if command else [])  # imports torch: seconds
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 0
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # before or after the command's own handling (imports, exit)
        print(f"ember{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
