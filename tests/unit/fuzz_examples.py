"""The example counts of tests/unit's property and fuzz tests (test helper): ``make test`` runs a share
of each full count, ``make faults`` the full counts (``KVLBTEST_UNIT_FUZZ_SHARE=1``), as tests/fuzz's
``KVLBTEST_FUZZ_PAYLOADS`` sizes its fuzzing."""

from __future__ import annotations

import os

SHARE = float(os.environ.get("KVLBTEST_UNIT_FUZZ_SHARE", "0.25"))
"""The share of each full count to run (0.25 in ``make test``; 1 in ``make faults``)."""


def examples(full: int) -> int:
    """``full`` examples scaled by :data:`SHARE`, at least 50 (and never more than ``full``)."""
    return min(full, max(50, round(full * SHARE)))
