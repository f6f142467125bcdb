"""tests/faults: scenarios marked ``faults_long`` run only when ``-m`` names them (``make faults``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_INTEGRATION = str(Path(__file__).resolve().parents[1] / "integration")
if _INTEGRATION not in sys.path:
    sys.path.append(_INTEGRATION)  # the in-process harness (kvlb_harness) for the clock test


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "faults_long: long fault-injection runs (make faults)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "faults_long" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="long fault run: make faults (pytest -m faults_long)")
    for item in items:
        if "faults_long" in item.keywords:
            item.add_marker(skip)
