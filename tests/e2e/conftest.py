"""tests/e2e: a test may reuse the integration harness's fake replicas (``kvlb_harness``)."""

from __future__ import annotations

import sys
from pathlib import Path

_INTEGRATION = str(Path(__file__).resolve().parents[1] / "integration")
if _INTEGRATION not in sys.path:
    sys.path.append(_INTEGRATION)
