"""Engine specifics live only in ``balancer/engines/``: no other module branches on an engine's name.

Every module under ``balancer/`` outside ``balancer/engines/`` is parsed with :mod:`ast` and searched
for an engine name string literal (``"sglang"``, ``"vllm"``, ``"trtllm"``) used as a branch: an
operand of a comparison (``==``, ``!=``, ``in`` ..., also inside a tuple, list or set operand), a
``case`` pattern of a ``match``, or a key of a dict literal (a dispatch table). Naming an engine
elsewhere (a docstring, the config field's ``Literal`` type, a default value) is fine; deciding by it
belongs in the engine's spec (:mod:`balancer.engines.spec`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest

import balancer
from balancer.config import EngineKind
from balancer.engines.registry import ENGINE_SPECS

ENGINE_NAMES = frozenset(get_args(EngineKind)) | frozenset(ENGINE_SPECS)
PACKAGE = Path(balancer.__file__).resolve().parent
ENGINES_PACKAGE = PACKAGE / "engines"


def _engine_names(node: ast.AST | None) -> Iterator[str]:
    """The engine names ``node`` spells as a string literal, directly or as a collection's element."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ENGINE_NAMES:
        yield node.value
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        for element in node.elts:
            yield from _engine_names(element)


def engine_branches(source: str) -> list[tuple[int, str]]:
    """``(line, engine name)`` of every branch on an engine name literal in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found.extend((node.lineno, name) for name in _engine_names(operand))
        elif isinstance(node, ast.match_case):
            for pattern in ast.walk(node.pattern):
                if isinstance(pattern, ast.MatchValue):
                    found.extend((pattern.lineno, name) for name in _engine_names(pattern.value))
        elif isinstance(node, ast.Dict):
            for key in node.keys:
                if key is not None:
                    found.extend((key.lineno, name) for name in _engine_names(key))
    return sorted(found)


def _modules_outside_engines() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if ENGINES_PACKAGE not in path.parents)


def test_the_scan_covers_the_service() -> None:
    modules = {path.relative_to(PACKAGE).as_posix() for path in _modules_outside_engines()}
    assert {"routing/router.py", "sources/build.py", "load/scraper.py", "fleet/leases.py"} <= modules
    assert "discovery/k8s_objects.py" in modules
    assert not any(module.startswith("engines/") for module in modules)


def test_no_module_outside_engines_branches_on_an_engine_name() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent).as_posix()}:{line}: {name!r}"
        for path in _modules_outside_engines()
        for line, name in engine_branches(path.read_text(encoding="utf-8"))
    ]
    assert offenders == [], "read the engine's spec (balancer.engines.registry.engine_spec) instead"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('if engine == "trtllm":\n    pass\n', [(1, "trtllm")]),
        ('ok = "vllm" != engine\n', [(1, "vllm")]),
        ('zmq = engine in ("sglang", "vllm")\n', [(1, "sglang"), (1, "vllm")]),
        ('zmq = engine not in {"trtllm"}\n', [(1, "trtllm")]),
        ('match engine:\n    case "sglang":\n        pass\n', [(2, "sglang")]),
        ('match engine:\n    case "sglang" | "vllm":\n        pass\n', [(2, "sglang"), (2, "vllm")]),
        ('match config:\n    case {"engine": "trtllm"}:\n        pass\n', [(2, "trtllm")]),
        ('BLOCK = {"sglang": 16, "trtllm": 32}\n', [(1, "sglang"), (1, "trtllm")]),
    ],
)
def test_the_scan_finds_each_kind_of_branch(source: str, expected: list[tuple[int, str]]) -> None:
    assert engine_branches(source) == expected


@pytest.mark.parametrize(
    "source",
    [
        '"""Decoders for sglang and trtllm."""\n',
        'EngineKind = Literal["sglang", "vllm", "trtllm"]\n',
        'engine: str = "sglang"\n',
        'kind = "trtllm"\n',
        'spec = engine_spec("vllm")\n',
        'if transport == "zmq":\n    pass\n',
        'match transport:\n    case "http_drain":\n        pass\n',
    ],
)
def test_the_scan_leaves_other_uses_of_a_name_alone(source: str) -> None:
    assert engine_branches(source) == []
