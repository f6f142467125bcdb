"""The ``kvlb`` command line (I/O shell).

The service's own commands (``serve``, ``admin``: :mod:`balancer.cli.command`; ``config``:
:mod:`balancer.cli.config_command`) are registered here directly. Every other command is a tool
that plugs itself in: an installed entry point of the group ``kvlb.commands``
(``[project.entry-points."kvlb.commands"]`` in ``pyproject.toml``) naming a ``register(subparsers)``
function. The service never imports its tools. Tools are listed after the
service's commands, by entry-point name; a tool that fails to load is reported on stderr and left
out, so a broken tool never breaks ``kvlb serve``. A service command (``kvlb serve …``, ``kvlb admin
…``) loads no tool at all: importing them (the load-test machinery) slowed every ``kvlb serve``
start, twice with the jemalloc re-execution (time to "serving", ``--workers 1``: 3.5–5.0 s before,
1.4–3.8 s after, 2026-11-30, load 3–4). A tool's command line whose command names its
tool (``kvlb emulate …``, ``kvlb loadtest …``) loads only that one (:func:`tools_for`). This module
imports little at its top, so that ``kvlb serve`` takes SIGTERM and SIGINT
(:mod:`balancer.cli.early_signals`) before the rest is imported.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeAlias

from balancer.cli import early_signals

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

COMMAND_GROUP = "kvlb.commands"
"""The entry-point group of the tools' commands."""

SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
Register: TypeAlias = Callable[[SubParsers], None]
"""What a ``kvlb.commands`` entry point names: adds its subcommands to the ``kvlb`` parser."""


def installed_tools() -> list[EntryPoint]:
    """The ``kvlb.commands`` entry points of the installed distributions."""
    from importlib.metadata import entry_points

    return list(entry_points(group=COMMAND_GROUP))


def build_parser(tools: Iterable[EntryPoint] | None = None) -> argparse.ArgumentParser:
    """The ``kvlb`` parser: ``serve``, ``admin`` and ``config``, then ``tools`` (default:
    :func:`installed_tools`) by name. A tool that fails to load or to register is reported on stderr
    and left out."""
    from balancer.cli import command, config_command

    parser = argparse.ArgumentParser(
        prog="kvlb",
        description="kvlb: a KV-cache-aware load balancer for LLM inference.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    command.register(subparsers)
    config_command.register(subparsers)
    for tool in sorted(installed_tools() if tools is None else tools, key=lambda tool: tool.name):
        try:
            register: Register = tool.load()
            register(subparsers)
        except Exception as exc:  # any failure of a tool's import or registration leaves the others
            print(
                f"kvlb: command {tool.name!r} is unavailable ({tool.value}): {type(exc).__name__}: {exc}",
                file=sys.stderr,
            )
    return parser


SERVICE_COMMANDS = frozenset({"serve", "admin", "config"})
"""The commands of :mod:`balancer.cli.command` and :mod:`balancer.cli.config_command`: their
command lines load no tool."""


TOOL_OF_COMMAND = {"capacity": "loadtest", "tune": "simulate", "sim": "emulate"}
"""The commands a tool registers beside its namesake, by the entry-point name of that tool (the
comment of ``[project.entry-points."kvlb.commands"]`` in ``pyproject.toml``), so that their command
lines load that one tool too. Only a hint: a command its tool no longer registers loads every tool
(:func:`_main`), so a stale entry costs time, never the command."""


def tools_for(command: str | None) -> list[EntryPoint] | None:
    """The tools a command line starting with ``command`` loads: none for a service command, the
    tool of the same name when there is one (``kvlb emulate`` loads only ``emulate``: ``kvlb
    emulate --help`` took 0.35–0.56 s against 0.98–1.42 s with every tool, 2026-11-30), or the one
    :data:`TOOL_OF_COMMAND` names (``kvlb capacity --help``: 0.35 s against 0.75 s with every tool,
    2026-12-01), else every tool (``None``)."""
    if command in SERVICE_COMMANDS:
        return []
    name = TOOL_OF_COMMAND.get(command or "", command)
    named = [tool for tool in installed_tools() if tool.name == name]
    return named or None


EXIT_SIGINT = 128 + 2
"""The exit code of a tool's command line stopped by SIGINT that the tool did not handle itself."""


def main(argv: Sequence[str] | None = None) -> int:
    """``kvlb …``. When the process is a tool's command line (``argv`` is ``None``, the command not
    a service command), a SIGINT that reaches here (during the imports of the tools, which took
    seconds at a load of 12, or from a tool that does not handle it) is one line, ``kvlb TOOL:
    stopped by SIGINT``, and exit 130; before 2026-12-01 (h-capfollow2) it was a
    ``KeyboardInterrupt`` traceback (exit -2)."""
    given = list(sys.argv[1:] if argv is None else argv)
    command = given[0] if given else None
    if command == "serve" and argv is None:  # the process is kvlb serve: before the imports
        early_signals.install()
    if argv is not None or command in SERVICE_COMMANDS:
        return _main(given, command)
    try:
        early_signals.take_sigint()  # inside: one blocked across the start is taken here
        code = _main(given, command)
    except KeyboardInterrupt:
        named = f" {command}" if command and not command.startswith("-") else ""
        print(f"kvlb{named}: stopped by SIGINT", file=sys.stderr)
        code = EXIT_SIGINT
    forget_keyboard_interrupt()  # caught here or by the tool (its own line and 130): the code stands
    return code


def forget_keyboard_interrupt() -> None:
    """After a ``KeyboardInterrupt`` was caught: make sure the interpreter exits with the code
    returned. CPython marks one raised in code run from a string (``exec`` or ``eval`` of source,
    which ``dataclasses`` runs for every class it decorates, so during most imports) as unhandled
    even when it is caught, and a program run with ``-m`` (``python -m balancer``) then kills
    itself with SIGINT at exit (exit -2) whatever it returned; the next string it runs clears
    the mark (``run_eval_code_obj`` in ``Python/pythonrun.c``). Seen 2026-12-01: a SIGINT
    0.45-0.5 s into ``kvlb tune`` printed its one line and exited -2 in 3 of 10 tries."""
    eval("0")  # a constant: only clears the mark


def _main(given: list[str], command: str | None) -> int:
    tools = tools_for(command)
    parser = build_parser(tools)
    if tools and command not in _commands_of(parser):  # the tool did not register its namesake
        parser = build_parser()
    args, unknown = parser.parse_known_args(given)
    if unknown:  # said by the (sub)command that was given them, with its usage: `kvlb serve: error: ...`
        chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except BrokenPipeError:  # `kvlb admin replicas | head`: the reader left before the output ended
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)parser ``args`` went through: ``kvlb admin policy set``'s for those words."""
    while True:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, actions[0].dest, None) if actions else None
        choices = actions[0].choices if actions else None
        if not isinstance(choices, dict) or name not in choices:
            return parser
        parser = choices[name]


def _commands_of(parser: argparse.ArgumentParser) -> list[str]:
    (subparsers,) = (a for a in parser._actions if a.dest == "command")
    return list(subparsers.choices or ())
