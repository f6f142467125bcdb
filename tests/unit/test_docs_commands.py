"""The documents' ``kvlb`` command lines still parse, and their settings files load: every ``kvlb
…`` (or ``python -m balancer …``) line of a fenced shell block in the README, ``deploy/README.md``
and ``docs/`` is given to the real ``kvlb`` parser (the service's commands and every tool's,
:func:`balancer.cli.main.build_parser`), and a command, subcommand, flag or choice it no longer
knows fails this test with the document's
line. A new user copies these lines first (the new user's walk of 2026-12-01, h-newuser); the flags
of the tools moved often, and nothing else read the documents' copies of them.

What is not a command line: a line whose first word after ``kvlb`` ends with ``:`` (an output such
as ``kvlb console: http://…``), and a line with a shell variable (``kvlb loadtest $T``: its words
are not in the document). Placeholders are allowed: ``<the tenants flags>`` and ``[--seed 1 |
--seed 2]`` are dropped, ``<dir>/capacity.json`` is read as ``X/capacity.json`` and ``--out <tmp>``
as ``--out X``, and a value refused by its type (``--seed N``, ``--rate R``) passes
when it is a capital placeholder. The command is cut at the first shell operator (``>``, ``|``,
``&&``, ``;``). Nothing is run. Each fenced ``yaml`` block that is a whole settings file (a mapping
with ``pools``) goes through the settings loader, as ``kvlb config check`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import yaml

from balancer.cli.main import build_parser, chosen_parser
from balancer.config.loader import SettingsSource, parse_settings
from balancer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_COMMAND = re.compile(r"^(?:nice -n \d+ )?(?:/usr/bin/time (?:-v )?)?(?:kvlb|python -m balancer)\s+(.*)$")
_SHELL_INFO = {"", "bash", "sh", "shell", "console"}
_OPERATORS = {">", ">>", "|", "&&", "||", ";", "2>", "2>&1", "&"}
_ANGLE_PLACEHOLDER = re.compile(r"<[^<>]*>")
_MARK = "PLACEHOLDER"
_PLACEHOLDER_REFUSAL = re.compile(r"invalid (?:\w+ value|choice): '([A-Z][A-Z_]{0,7})'")


def yaml_blocks(text: str) -> Iterator[tuple[int, str]]:
    """``(line number of the fence, text)`` of every fenced ``yaml`` block."""
    fence = ""
    lines: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if not fence:
            if match and match.group(2).strip() == "yaml":
                fence, lines, start = match.group(1), [], number
        elif match and match.group(1).startswith(fence) and not match.group(2).strip():
            fence = ""
            yield start, "\n".join(lines)
        else:
            lines.append(line)


def shell_lines(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of every logical line of the fenced blocks whose info string is a
    shell's or empty, continuation lines (a trailing ``\\``) joined to their first."""
    fence = ""
    info = ""
    pending: tuple[int, str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if not fence:
            if match:
                fence, info = match.group(1), match.group(2).strip()
            continue
        if match and match.group(1).startswith(fence) and not match.group(2).strip():
            if pending is not None and info in _SHELL_INFO:
                yield pending
            fence, pending = "", None
            continue
        if info not in _SHELL_INFO:
            continue
        first, joined = (
            (number, line.strip()) if pending is None else (pending[0], f"{pending[1]} {line.strip()}")
        )
        if joined.endswith("\\"):
            pending = (first, joined[:-1].rstrip())
        else:
            pending = None
            yield first, joined


def command_words(line: str) -> list[str] | None:
    """The words after ``kvlb`` of a documented command line, placeholders dropped; ``None`` when
    the line is not one to check."""
    match = _COMMAND.match(line)
    if not match:
        return None
    try:  # <the tenants flags>, <chat dir>/capacity.json, --out <tmp>: the mark stands for each
        words = shlex.split(_ANGLE_PLACEHOLDER.sub(_MARK, match.group(1)), comments=True)
    except ValueError:
        return None
    if not words or words[0].endswith(":") or any("$" in word for word in words):
        return None
    kept: list[str] = []
    optional = False  # inside an optional group: [--seed 1 | --seed 2]
    for word in words:
        if word in _OPERATORS and not optional:
            break
        optional = optional or word.startswith("[")
        if optional:
            optional = not word.endswith("]")
        elif word != _MARK:
            kept.append(word.replace(_MARK, "X"))
        elif kept and kept[-1].startswith("-"):  # a flag's value
            kept.append("X")
    return kept


@functools.cache
def kvlb_parser() -> argparse.ArgumentParser:
    """One parser for every line: parsing leaves it as it was."""
    return build_parser()


def refusal(parser_words: list[str]) -> str | None:
    """What the ``kvlb`` parser says of these words (its last error line), ``None`` when it takes
    them."""
    parser = kvlb_parser()
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args, unknown = parser.parse_known_args(parser_words)
            if unknown:
                chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit:
        last = said.getvalue().strip().splitlines()[-1]
        return None if _PLACEHOLDER_REFUSAL.search(last) else last
    return None


def refused_commands(relpath: str, text: str) -> list[str]:
    return [
        f"{relpath}:{number}: kvlb {' '.join(words)}\n    {said}"
        for number, line in shell_lines(text)
        if (words := command_words(line)) is not None and (said := refusal(words)) is not None
    ]


def test_every_documented_kvlb_command_line_parses() -> None:
    documents = documents_read()
    assert "README.md" in documents and "docs/loadtest.md" in documents and "docs/simulate.md" in documents
    checked = sum(
        1
        for relpath in documents
        for _, line in shell_lines((ROOT / relpath).read_text("utf-8"))
        if command_words(line) is not None
    )
    assert checked >= 100, checked  # 141 on 2026-12-01: the extraction still finds them
    found = [
        finding
        for relpath in documents
        for finding in refused_commands(relpath, (ROOT / relpath).read_text("utf-8"))
    ]
    assert not found, "\n".join(found)


def documents_read() -> list[str]:
    """The README and every Markdown file of ``docs/`` and ``deploy/``, repository-relative."""
    paths = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "deploy").rglob("*.md")]
    return [path.relative_to(ROOT).as_posix() for path in sorted(paths)]


def refused_configs(relpath: str, text: str) -> tuple[int, list[str]]:
    """How many whole settings files (a YAML mapping with ``pools``) the document shows, and what the
    settings loader says of those it refuses. One that reads an engine key (``api_key_file``, a
    secret's path on the reader's machine) is not loaded."""
    checked, found = 0, []
    for number, block in yaml_blocks(text):
        tree = yaml.safe_load(block)
        if not isinstance(tree, dict) or "pools" not in tree or "api_key_file" in block:
            continue
        checked += 1
        try:
            parse_settings(SettingsSource(f"{relpath}:{number}", block.encode()), (), {})
        except ConfigError as exc:
            found.append(f"{relpath}:{number}: {exc}")
    return checked, found


def test_every_documented_settings_file_loads() -> None:
    """``kvlb config check`` on each settings file of the documents (the minimal ``kvlb.yaml`` of
    http-api.md, the vLLM fleet of emulator.md, ...) passes."""
    checked, found = 0, []
    for path in sorted(
        [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "deploy").rglob("*.md")]
    ):
        count, refused = refused_configs(path.relative_to(ROOT).as_posix(), path.read_text("utf-8"))
        checked, found = checked + count, found + refused
    assert checked >= 4, checked  # 4 on 2026-12-01
    assert not found, "\n".join(found)
    bad = "```yaml\npools:\n  - model: m\n    replicas: [{id: a, url: 'http://h:1', engine: sglang}]\n"
    assert refused_configs("docs/a.md", bad + "listen: {port: 1}\n```\n") == (1, [])
    assert refused_configs("docs/a.md", bad + "listen: {prot: 1}\n```\n")[1] != []  # a misspelt key


def test_the_checker_finds_a_gone_flag_a_gone_command_and_a_bad_choice() -> None:
    text = "\n".join(
        [
            "```bash",
            "kvlb emulate --replicas 3 --engine mixed \\",
            "  --no-such-flag 2          # a continuation line",
            "kvlb simulate --workload tenants --seed N   # a placeholder",
            "kvlb capacity <the tenants flags> --start-rate 16 [--seed 1 | --seed 2] --out <a dir>/x --nope",
            "kvlb teleport --now",
            "kvlb emulate --engine vllmx > out.txt",
            "kvlb console: http://127.0.0.1:43127/ui/",
            "kvlb loadtest $T --concurrency 4",
            "kvlb config defaults > all-defaults.yaml",
            "```",
            "```yaml",
            "kvlb serve --gone",
            "```",
            "```",
            "python -m balancer admin --url http://127.0.0.1:8000 replicas --tabel",
            "```",
        ]
    )
    found = refused_commands("docs/a.md", text)
    assert [f.split("\n")[0] for f in found] == [
        "docs/a.md:2: kvlb emulate --replicas 3 --engine mixed --no-such-flag 2",
        "docs/a.md:5: kvlb capacity --start-rate 16 --out X/x --nope",
        "docs/a.md:6: kvlb teleport --now",
        "docs/a.md:7: kvlb emulate --engine vllmx",
        "docs/a.md:16: kvlb admin --url http://127.0.0.1:8000 replicas --tabel",
    ]
    assert "unrecognized arguments: --no-such-flag 2" in found[0]
    assert "invalid choice: 'teleport'" in found[2]
