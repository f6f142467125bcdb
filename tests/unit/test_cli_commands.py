"""The ``kvlb`` command line: the service's commands, then the tools' entry points in a stable order;
a broken tool is reported and left out; ``kvlb sim`` warns and runs as ``kvlb emulate``."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

from balancer.cli.main import COMMAND_GROUP, TOOL_OF_COMMAND, build_parser, installed_tools, main
from loadtests.emulate import COMMAND as EMULATE

EVERY_COMMAND = [
    "serve", "admin", "config", "bench", "demo", "emulate", "sim", "loadtest", "capacity", "simulate", "tune",
]  # fmt: skip
"""The service's commands, then each tool's by entry-point name (``emulate`` adds ``sim``,
``loadtest`` adds ``capacity``, ``simulate`` adds ``tune``)."""


def _commands(tools: list[EntryPoint] | None = None) -> list[str]:
    parser = build_parser(tools)
    (subparsers,) = (a for a in parser._actions if a.dest == "command")
    assert isinstance(subparsers.choices, dict)
    return list(subparsers.choices)


def test_every_command_in_a_stable_order() -> None:
    assert {tool.name for tool in installed_tools()} == {"bench", "demo", "emulate", "loadtest", "simulate"}
    assert _commands() == EVERY_COMMAND
    assert _commands(list(reversed(installed_tools()))) == EVERY_COMMAND


def test_a_broken_tool_is_reported_and_the_rest_still_work(capsys: pytest.CaptureFixture[str]) -> None:
    broken = [
        EntryPoint("aaa", "kvlb_no_such_module:register", COMMAND_GROUP),
        EntryPoint("zzz", "loadtests.emulate:no_such_function", COMMAND_GROUP),
        EntryPoint("clash", "loadtests.emulate:register", COMMAND_GROUP),  # 'emulate' before the real one
    ]
    parser = build_parser([*broken, *installed_tools()])
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3
    assert errors[0].startswith("kvlb: command 'aaa' is unavailable (kvlb_no_such_module:register): ")
    assert "ModuleNotFoundError" in errors[0]
    assert errors[1].startswith("kvlb: command 'emulate' is unavailable") and "conflicting" in errors[1]
    assert errors[2].startswith("kvlb: command 'zzz' is unavailable") and "AttributeError" in errors[2]
    args = parser.parse_args(["serve", "--set", "listen.port=0"])
    assert args.handler.__name__ == "run_serve"
    assert parser.parse_args(["simulate"]).command == "simulate"


def test_the_service_commands_need_no_tool(capsys: pytest.CaptureFixture[str]) -> None:
    assert _commands([]) == ["serve", "admin", "config"]
    assert capsys.readouterr().err == ""


def test_sim_is_a_deprecated_alias_of_emulate(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--replicas", "1", "--slowdown", "0", "--tokenizer", "none"]  # an invalid fault setting
    assert main(["emulate", *argv]) == 2
    emulate_err = capsys.readouterr().err.splitlines()
    assert main(["sim", *argv]) == 2
    sim_err = capsys.readouterr().err.splitlines()
    assert sim_err[0] == "kvlb sim: deprecated, use 'kvlb emulate' (the same options)"
    assert sim_err[1:] == [line.replace("kvlb emulate:", "kvlb sim:", 1) for line in emulate_err]
    assert len(emulate_err) == 1 and emulate_err[0].startswith("kvlb emulate: ")
    parser = build_parser()
    same = ["--replicas", "3", "--engine", "mixed", "--profile", "cpu-test", "--tokenizer", "none"]
    as_sim, as_emulate = parser.parse_args(["sim", *same]), parser.parse_args(["emulate", *same])
    assert EMULATE.spec_from_args(as_sim) == EMULATE.spec_from_args(as_emulate)


def test_kvlb_serve_imports_neither_a_tool_nor_the_service_before_it_runs() -> None:
    # the first process of `kvlb serve` may re-execute itself on jemalloc: what it imported before
    # is paid twice, so a bad setting is refused with only the config loader imported
    probe = (
        "import sys\n"
        "from balancer.cli.main import main\n"
        "code = main(['serve', '--set', 'no_such_setting=1'])\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'loadtests', 'replicas'}))\n"
        "print(sorted(m for m in sys.modules if m in ('balancer.app', 'balancer.cli.workers')))\n"
        "raise SystemExit(code)\n"
    )
    argv = [sys.executable, "-c", probe]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "no_such_setting" in done.stderr
    assert done.stdout.splitlines() == ["[]", "[]"]
    # a tool's command still loads the tools
    listed = subprocess.run(
        [sys.executable, "-m", "balancer", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert listed.returncode == 0 and "capacity" in listed.stdout


def test_a_tools_command_loads_only_its_own_tool() -> None:
    tools = ("loadtests.bench.command", "loadtests.command", "loadtests.demo.command", "loadtests.emulate")
    probe = (
        "import sys\n"
        "from balancer.cli.main import main\n"
        "code = main(sys.argv[1:])\n"
        f"print(sorted(m for m in {tools!r} + ('loadtests.simulate.command',) if m in sys.modules))\n"
        "raise SystemExit(code)\n"
    )
    argv = ["--replicas", "1", "--slowdown", "0", "--tokenizer", "none"]  # an invalid fault setting
    # `sim`, `capacity` and `tune`, which their tools add beside their namesakes, load that tool only
    # (before 2026-12-01 every tool: `kvlb capacity` imported the load test and the demo and the bench)
    for command, more, loaded in (
        ("emulate", argv, ["loadtests.emulate"]),
        ("sim", argv, ["loadtests.emulate"]),
        ("capacity", ["--max-points", "1"], ["loadtests.command"]),
        ("tune", ["--no-plot", "--rate", "0"], ["loadtests.simulate.command"]),
    ):
        done = subprocess.run(
            [sys.executable, "-c", probe, command, *more],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2 and f"kvlb {command}" in done.stderr, done.stderr
        assert done.stdout.splitlines() == [str(loaded)], command


def test_each_command_named_for_a_tool_is_registered_by_that_tool() -> None:
    tools = {tool.name: tool for tool in installed_tools()}
    for command, name in TOOL_OF_COMMAND.items():
        assert command not in tools  # a tool of its own name would be loaded first
        assert command in _commands([tools[name]]), (command, name)
