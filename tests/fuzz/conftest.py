"""tests/fuzz: the HTTP and gRPC tests reuse the integration harness (emulated replicas + a balancer)."""

from __future__ import annotations

import sys
from pathlib import Path

_INTEGRATION = str(Path(__file__).resolve().parents[1] / "integration")
if _INTEGRATION not in sys.path:
    sys.path.append(_INTEGRATION)
