"""Engine specifics live only in ``balancer/engines/``: no other module branches on an engine's name.

Every module under ``balancer/`` outside ``balancer/engines/`` is parsed with :mod:`ast` and searched
for an engine name string literal (``"sglang"``, ``"vllm"``, ``"trtllm"``) used as a branch: an
operand of a comparison (``==``, ``!=``, ``in`` ..., also inside a tuple, list or set operand), a
``case`` pattern of a ``match``, or a key of a dict literal (a dispatch table). Naming an engine
elsewhere (a docstring, the config field's ``Literal`` type, a default value) is fine; deciding by it
belongs in the engine's spec (:mod:`balancer.engines.spec`).

The same modules are also searched for a string literal (not a docstring) spelling one engine's
metric prefix (``vllm:``, ``sglang:``/``sglang_``, ``trtllm_``/``trtllm:``), load endpoint or report
field (:data:`ENGINE_WORDS`): parsing an engine's reports belongs in its module under
``balancer/engines/``. The generic exceptions are listed in :data:`ALLOWED_WORDS`, each with its
reason; an entry no longer needed fails the test too.
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


# --- engine metric names, report fields and endpoints --------------------------------------------

ENGINE_WORDS = (
    # Prometheus metric prefixes: vLLM, SGLang (both spellings), TRT-LLM (and Dynamo's relabelling)
    "vllm:",
    "sglang:",
    "sglang_",
    "trtllm_",
    "trtllm:",
    # load endpoints and JSON report fields only one engine speaks
    "/v1/loads",
    "/get_load",
    "/prometheus/metrics",
    "/kv_cache_events",
    "num_running_reqs",
    "numActiveRequests",
    "kvCacheStats",
    "cache_config_info",
)
"""Substrings of a string literal that name one engine's metric, endpoint or report field: reading
them is parsing that engine's reports, which belongs in its module under ``balancer/engines/``."""

ALLOWED_WORDS: dict[tuple[str, str], str] = {
    ("policy/sglang.py", "sglang_"): "the sglang_threshold policy's name: SGLang Model Gateway's "
    "routing rule, applied to replicas of every engine",
    ("policy/registry.py", "sglang_"): "the sglang_threshold policy's name in the policy registry",
    ("sources/trtllm_poll.py", "trtllm_"): "the trtllm_poll config section named in the HTTP drain "
    "poller's own setting errors (a transport's settings, not an engine's report)",
    ("metrics.py", "/kv_cache_events"): "the help text of kvlb_events_drains_total, which counts "
    "the http_drain transport's calls",
    ("sources/trtllm_relay.py", "trtllm_"): "the relay source's kind (trtllm_relay), a label of the "
    "transport in /admin/replicas",
}
"""Generic modules allowed to spell an engine word, each with its reason: ``(module under
balancer/, word) -> why``."""


def _docstrings(tree: ast.AST) -> set[int]:
    """``id`` of every string constant that is a statement of its own (a docstring)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def engine_words(source: str) -> list[tuple[int, str]]:
    """``(line, word)`` of every :data:`ENGINE_WORDS` entry in a string literal of ``source`` that
    is not a docstring (f-string parts included)."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.extend((node.lineno, word) for word in ENGINE_WORDS if word in node.value)
    return sorted(found)


def test_no_module_outside_engines_spells_an_engine_metric_or_report_field() -> None:
    offenders = []
    used = set()
    for path in _modules_outside_engines():
        module = path.relative_to(PACKAGE).as_posix()
        for line, word in engine_words(path.read_text(encoding="utf-8")):
            if (module, word) in ALLOWED_WORDS:
                used.add((module, word))
            else:
                offenders.append(f"balancer/{module}:{line}: {word!r}")
    assert offenders == [], "parse an engine's reports in its module under balancer/engines/"
    assert used == set(ALLOWED_WORDS), f"allowlist entries no longer needed: {set(ALLOWED_WORDS) - used}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('NAME = "vllm:num_requests_waiting"\n', [(1, "vllm:")]),
        ('P = ("sglang:", "sglang_")\n', [(1, "sglang:"), (1, "sglang_")]),
        ('x = f"{prefix}trtllm_{name}"\n', [(1, "trtllm_")]),
        ('x = row["numActiveRequests"]\n', [(1, "numActiveRequests")]),
        ('"""Reads vllm:num_requests_waiting."""\n', []),
        ('def f():\n    """sglang_ metrics."""\n', []),
        ('engine = "sglang"\n', []),
    ],
)
def test_the_word_scan_reads_literals_not_docstrings(source: str, expected: list[tuple[int, str]]) -> None:
    assert engine_words(source) == expected
