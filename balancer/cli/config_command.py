"""``kvlb config``: the settings reference, a default settings file, and a file's check (I/O shell).

``kvlb config reference`` prints ``docs/configuration.md`` (:func:`balancer.config.reference.render_markdown`
on the source of :mod:`balancer.config.settings`, which this module reads); ``kvlb config defaults``
prints a complete settings file of the defaults; ``kvlb config check [FILE]`` loads FILE as ``kvlb
serve`` would (with ``KVLB_*`` and ``--set``) and prints the effective settings with every secret
redacted, or the loader's message and exit 2. None of them starts anything.
"""

from __future__ import annotations

import argparse
import sys
from typing import TypeAlias

SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def register(subparsers: SubParsers) -> None:
    parser = subparsers.add_parser(
        "config",
        help="the settings: reference, defaults, check a file",
        description="Print the settings reference (docs/configuration.md), a settings file of the "
        "defaults, or the effective settings of a file (secrets redacted).",
    )
    actions = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    actions.add_parser(
        "reference", help="print the settings reference as Markdown (docs/configuration.md)"
    ).set_defaults(handler=_reference)
    actions.add_parser("defaults", help="print a complete settings file (YAML) of the defaults").set_defaults(
        handler=_defaults
    )
    check = actions.add_parser(
        "check",
        help="load a settings file as kvlb serve would and print the effective settings",
        description="Load FILE (default: $KVLB_CONFIG, else none), then KVLB_* environment variables, "
        "then --set, validate, and print the effective settings as YAML with secrets redacted. "
        "Exit 2 with the loader's message on a bad setting.",
    )
    check.add_argument("file", nargs="?", metavar="FILE", help="YAML settings file (default: $KVLB_CONFIG)")
    check.add_argument(
        "--set",
        metavar="NAME=VALUE",
        action="append",
        default=[],
        help="override one setting, as kvlb serve --set (repeatable)",
    )
    check.set_defaults(handler=_check)


# The handlers import what they use: ``kvlb serve`` builds this parser too, and needs none of it.


def settings_source() -> str:
    """The source text of every module that defines a settings section (for their docstrings):
    :mod:`balancer.config.settings` and the sections it imports (:mod:`balancer.config.workers`)."""
    import inspect

    from balancer.config import settings as settings_module
    from balancer.config import workers as workers_module

    return "\n".join(inspect.getsource(module) for module in (settings_module, workers_module))


def _reference(args: argparse.Namespace) -> int:
    from balancer.config.reference import render_markdown

    sys.stdout.write(render_markdown(settings_source()))
    return 0


def _defaults(args: argparse.Namespace) -> int:
    from balancer.config.reference import defaults_yaml

    sys.stdout.write(defaults_yaml())
    return 0


def _check(args: argparse.Namespace) -> int:
    from balancer.config import load
    from balancer.config.reference import effective_yaml
    from balancer.errors import ConfigError

    try:
        settings = load(args.file, args.set)
    except ConfigError as exc:
        print(f"kvlb config check: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(effective_yaml(settings))
    return 0
