"""The layers between the packages, read from the source with ``ast`` (no module is imported).

``balancer`` is the service and imports none of its tools; ``replicas`` (the engine emulator) stands
alone; ``loadtests`` (load tests, simulator, demo, bench) may import both. Every import statement
counts, function-local ones included, and so does a string naming a module of a package a layer
must not reach (``python -m replicas.command`` in a subprocess is an import too). The ``kvlb``
command line finds the tools through entry points, never ``importlib.import_module``.

A rule is one :class:`Rule` in :data:`RULES`; add one there.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("balancer", "replicas", "loadtests")
GENERATED = ("balancer._proto",)
"""Modules generated at build time (gRPC stubs): not ours to layer."""


@dataclass(frozen=True, slots=True)
class Rule:
    """Modules under ``where`` (but not under ``exempt``) reach nothing under ``forbidden``."""

    name: str
    """What the rule keeps true, as a sentence."""
    where: str
    """A package (dotted); the rule covers it and every module below it."""
    forbidden: tuple[str, ...]
    """Packages or modules (dotted) that no covered module may import or name."""
    exempt: tuple[str, ...] = ()
    """Packages below ``where`` the rule does not cover."""

    def covers(self, module: str) -> bool:
        return within(module, (self.where,)) and not within(module, self.exempt)


RULES = (
    Rule("the service imports none of its tools", "balancer", ("loadtests", "replicas")),
    Rule("the emulator stands alone", "replicas", ("balancer", "loadtests")),
    Rule(
        "nothing below the faces imports them",
        "balancer",
        ("balancer.api", "balancer.cli"),
        exempt=("balancer.api", "balancer.cli", "balancer.app", "balancer.__main__"),
    ),
    Rule(
        "the pure core reaches no service, face or I/O shell",
        "balancer.routing",
        ("balancer.service", "balancer.api", "balancer.sources", "balancer.fleet", "balancer.upstream"),
    ),
    Rule(
        "load parsing is generic: the engines build on it, it reaches no engine",
        "balancer.load",
        ("balancer.engines",),
    ),
    Rule(
        "the upstream response parser does no I/O",
        "balancer.upstream.http1",
        ("asyncio", "socket", "ssl", "aiohttp", "balancer.upstream.connections", "balancer.upstream.client"),
    ),
)

NO_DYNAMIC_IMPORTS = ("balancer",)
"""Packages whose modules import by name only (no ``importlib.import_module``, no ``__import__``)."""


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


@dataclass(frozen=True, slots=True)
class Reach:
    """One place where a module reaches another: an import, or a string naming a module."""

    target: str
    line: int
    how: str


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def our_modules() -> dict[str, Path]:
    """Every module of :data:`PACKAGES` (generated ones left out), by dotted name."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = module_name(path)
            if not within(name, GENERATED):
                modules[name] = path
    return modules


MODULES = our_modules()

_MODULE_STRING = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?")
"""A dotted module name, optionally with ``:attribute`` (``replicas.command``, ``pkg.mod:register``)."""


def reaches(module: str, source: str, *, is_package: bool = False) -> Iterator[Reach]:
    """What ``module`` imports (anywhere in it: top level, functions, ``if TYPE_CHECKING``) and the
    dotted module names its string constants hold."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Reach(alias.name, node.lineno, "import")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            yield Reach(base, node.lineno, "from-import")
            for alias in node.names:
                yield Reach(f"{base}.{alias.name}", node.lineno, "from-import")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _MODULE_STRING.fullmatch(node.value)
        ):
            yield Reach(node.value.partition(":")[0], node.lineno, "string")


def reaches_of(module: str) -> list[Reach]:
    path = MODULES[module]
    return list(reaches(module, path.read_text("utf-8"), is_package=path.name == "__init__.py"))


def test_every_package_is_scanned() -> None:
    for package in PACKAGES:
        assert package in MODULES and sum(within(m, (package,)) for m in MODULES) > 5


def test_the_scanner_sees_local_relative_and_string_imports() -> None:
    source = (
        "import os\n"
        "from . import sibling\n"
        "from ..up import thing\n"
        "def run():\n"
        "    import replicas.command\n"
        "    return ['python', '-m', 'loadtests.emulate', 'replicas']\n"
    )
    found = {(r.target, r.how) for r in reaches("balancer.cli.main", source)}
    assert {
        ("os", "import"),
        ("balancer.cli.sibling", "from-import"),
        ("balancer.up.thing", "from-import"),
        ("replicas.command", "import"),
        ("loadtests.emulate", "string"),
    } <= found
    assert ("replicas", "string") not in found  # a bare word ('replicas' is a JSON key) is no module


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.name)
def test_layering_rule(rule: Rule) -> None:
    covered = [module for module in MODULES if rule.covers(module)]
    assert covered, f"{rule.name}: no module under {rule.where}"
    broken = [
        f"{module} line {reach.line}: {reach.how} {reach.target}"
        for module in covered
        for reach in reaches_of(module)
        if within(reach.target, rule.forbidden)
    ]
    assert not broken, f"{rule.name}:\n" + "\n".join(broken)


@pytest.mark.parametrize("package", NO_DYNAMIC_IMPORTS)
def test_no_dynamic_imports(package: str) -> None:
    found = []
    for module, path in MODULES.items():
        if not within(module, (package,)):
            continue
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            dynamic = (
                (isinstance(node, ast.Attribute) and node.attr == "import_module")
                or (isinstance(node, ast.Name) and node.id == "__import__")
                or (isinstance(node, ast.ImportFrom) and any(a.name == "import_module" for a in node.names))
            )
            if dynamic:
                found.append(f"{module} line {getattr(node, 'lineno', '?')}")
    assert not found, "dynamic imports:\n" + "\n".join(found)
