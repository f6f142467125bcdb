"""How much slower this machine runs a process's first work after it idled (blocking, in process).

On a VM a vCPU that idled tens of milliseconds comes back with cold caches, and maybe a lower clock:
the next few hundred microseconds of Python take several times the CPU time they take back to back.
``kvlb bench overhead``'s ``spaced`` phase runs every path in that regime on purpose; this probe
measures the factor itself, with no server involved, so that a report says what the machine added.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

PROBE_KEYS = 200_000
"""Entries of the dict the probe reads."""
PROBE_STRIDE = 97
"""The probe reads every ``PROBE_STRIDE``-th key (about 2,000 reads, three passes)."""


def _probe_work(table: dict[int, int], keys: list[int]) -> int:
    total = 0
    for _ in range(3):
        for key in keys:
            total += table[key]
    return total


def idle_penalty(gap_ms: float, samples: int = 40) -> dict[str, Any]:
    """Median CPU time of a fixed Python workload (dict reads, about 0.2 ms) run back to back and run
    after ``gap_ms`` of sleep, alternating, and their ratio. Takes about ``samples × gap_ms``."""
    table = {key: key * 2 for key in range(PROBE_KEYS)}
    keys = list(range(0, PROBE_KEYS, PROBE_STRIDE))
    warm_ns: list[int] = []
    idle_ns: list[int] = []
    for _ in range(samples):
        _probe_work(table, keys)  # the back-to-back sample follows work
        started = time.process_time_ns()
        _probe_work(table, keys)
        warm_ns.append(time.process_time_ns() - started)
        time.sleep(gap_ms / 1000)
        started = time.process_time_ns()
        _probe_work(table, keys)
        idle_ns.append(time.process_time_ns() - started)
    warm_us, idle_us = statistics.median(warm_ns) / 1000, statistics.median(idle_ns) / 1000
    return {
        "gap_ms": gap_ms,
        "samples": samples,
        "back_to_back_us_p50": round(warm_us, 1),
        "after_idle_us_p50": round(idle_us, 1),
        "factor": round(idle_us / warm_us, 2) if warm_us > 0 else None,
    }
