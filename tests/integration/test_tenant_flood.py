"""``python -m loadtests.tenant_flood`` end to end at a smoke size: a real ``kvlb serve`` and the
slow replica as child processes; with the per-tenant caps on, the measured tenant is never refused
while the flooding one is. Asserts no timings."""

from __future__ import annotations

import json
import subprocess
import sys


def test_tenant_flood_smoke_isolates_the_measured_tenant() -> None:
    # 48 flooders: more than tenant A's 8 slots and 16 queue places (caps at half of 16 and 32)
    smoke = ("--seconds", "1.5", "--runs", "on", "--flooders", "48")
    completed = subprocess.run(
        [sys.executable, "-m", "loadtests.tenant_flood", *smoke],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    document, _ = json.JSONDecoder().raw_decode(completed.stdout)  # the JSON, then the table
    (run,) = document["runs"]
    assert run["mode"] == "on"
    assert run["b_ok"] > 0 and run["b_refused"] == 0, run
    assert run["a_statuses"].get("429", 0) > 0, run
    assert run["b_p50_ms"] is not None and run["b_p50_ms"] <= run["b_p99_ms"]
