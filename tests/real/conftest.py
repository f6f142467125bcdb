"""Opt-in real-engine tests: skipped unless ``KVLB_REAL=1`` (``make test-real`` sets it).

They need the vLLM CPU venv and the tiny model under ``.real/``, or under ``$KVLB_REAL_DIR`` when set
(``scripts/real/install.sh`` reads the same variable), take
minutes, and start real engines of 2–4 GB each, so plain ``make test`` / ``pytest`` never runs them.
Measured figures are gathered in one report, printed at the end of the run as compact tables (the
figures, then kvlb's predicted vs the engine's reported cached tokens per request) and written whole
to ``build/real-report.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from real_engines import MODEL_DIR, VLLM_BIN

REPORT_PATH = Path(__file__).resolve().parents[2] / "build" / "real-report.json"
REQUEST_COLUMNS = ("phase", "group", "round", "replica", "prompt_tokens", "predicted", "cached", "error")

ENABLED = os.environ.get("KVLB_REAL") == "1"
REPORT_KEY = pytest.StashKey[dict[str, Any]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[REPORT_KEY] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    if ENABLED:
        missing = [str(p) for p in (VLLM_BIN, MODEL_DIR / "model.safetensors") if not p.exists()]
        if not missing:
            return
        reason = f"run scripts/real/install.sh first (missing: {', '.join(missing)})"
    else:
        reason = "real-engine test: set KVLB_REAL=1 (make test-real)"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def report(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Figures measured by the real tests, by section."""
    return request.config.stash[REPORT_KEY]


def _flat(prefix: str, value: Any) -> list[tuple[str, str]]:
    """``(dotted name, text)`` rows of a nested figure."""
    if isinstance(value, dict) and value:
        return [row for key, item in value.items() for row in _flat(f"{prefix}.{key}", item)]
    return [(prefix, json.dumps(value, default=str) if not isinstance(value, str) else value)]


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    return [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    figures = config.stash.get(REPORT_KEY, {})
    if not figures:
        return
    REPORT_PATH.parent.mkdir(parents=True, exist_ok=True)
    REPORT_PATH.write_text(json.dumps(figures, indent=1, default=str) + "\n")
    terminalreporter.section("real-engine figures")
    rows = [row for name, value in figures.items() if name != "requests" for row in _flat(name, value)]
    for line in _table(("figure", "value"), rows):
        terminalreporter.write_line(line)
    requests = figures.get("requests", [])
    if requests:
        terminalreporter.write_line("")
        terminalreporter.write_line("cached tokens per request: kvlb's prediction vs the engine's report")
        cells = [tuple(str(r[c]) for c in REQUEST_COLUMNS) for r in requests]
        for line in _table(REQUEST_COLUMNS, cells):
            terminalreporter.write_line(line)
    terminalreporter.write_line(f"(all figures as JSON: {REPORT_PATH})")
