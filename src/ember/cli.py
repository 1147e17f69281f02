"""The ``ember`` command: one sub-command per subsystem, each registered by its own module."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each module named here exposes ``register(subparsers)``; it adds its sub-command and sets
# ``func`` on the parsed namespace. Modules are imported only when the command line is built.
_COMMAND_MODULES = (
    "ember.demo",
    "ember.bench_cli",
    "ember.shards.cli",
    "ember.train.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ember",
        description="ember: secure randomness, tar-shard streaming, weight averaging and "
        "training for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency inside the module: report it
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
