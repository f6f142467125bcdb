"""``python -m loadtests.tenant_race`` at a smoke size: a real ``kvlb serve --workers 2`` and a fake
replica as child processes; each trial's tenant gets its one request in (or, when the workers race,
one more per other worker) and the rest 429. Asserts no timings."""

from __future__ import annotations

import json
import subprocess
import sys


def test_tenant_race_smoke() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "loadtests.tenant_race", "--trials", "3", "--connections", "4"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(completed.stdout)
    assert result["trials"] == 3 and result["workers"] == 2
    assert result["none_let_in"] == 0 and result["other_statuses"] == {}, result
    assert 3 <= result["let_in"] <= 3 * 2 and result["most_in_one_trial"] <= 2, result
    assert result["over"] == result["let_in"] - 3
