"""The ``kvlb`` command line (I/O shell).

Each subcommand lives in its own module that exposes ``register(subparsers)``; this module only
assembles them, so adding a command is one line in ``_COMMAND_MODULES``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Protocol

_COMMAND_MODULES: tuple[str, ...] = (
    "loadtests.bench.command",
    "loadtests.emulate",
    "balancer.cli.command",
    "loadtests.command",
    "loadtests.demo.command",
    "loadtests.simulate.command",
)


class _CommandModule(Protocol):
    def register(self, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None: ...


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvlb",
        description="kvlb: a KV-cache-aware load balancer for LLM inference.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        module: _CommandModule = importlib.import_module(name)
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    return handler(args)
