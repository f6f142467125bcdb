"""Opt-in real-engine tests: skipped unless ``KVLB_REAL=1`` (``make test-real`` sets it).

They need the vLLM CPU venv and the tiny model under ``.real/`` (``scripts/real/install.sh``), take
minutes, and start real engines of 2–4 GB each, so plain ``make test`` / ``pytest`` never runs them.
Measured figures are gathered in one report, printed at the end of the run and written to
``.real/report.json``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from real_engines import MODEL_DIR, REAL_DIR, VLLM_BIN

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


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    figures = config.stash.get(REPORT_KEY, {})
    if not figures:
        return
    terminalreporter.section("real-engine figures")
    text = json.dumps(figures, indent=1, default=str)
    terminalreporter.write_line(text)
    REAL_DIR.mkdir(parents=True, exist_ok=True)
    (REAL_DIR / "report.json").write_text(text + "\n")
