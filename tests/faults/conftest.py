"""tests/faults: the in-process harness on the path. Scenarios marked ``faults_long`` run only when ``-m``
names them (``make faults``; the mark and its skip are in tests/conftest.py)."""

from __future__ import annotations

import sys
from pathlib import Path

_INTEGRATION = str(Path(__file__).resolve().parents[1] / "integration")
if _INTEGRATION not in sys.path:
    sys.path.append(_INTEGRATION)  # the in-process harness (kvlb_harness) for the clock test
