"""``kvlb serve``'s default ``--workers``: the cores it may use, capped by its cgroup's CPU limit.

The cgroup files are written to a temporary directory laid out as ``/sys/fs/cgroup`` is (v2 and
v1); the cores come from this process's real affinity mask.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from balancer.cli.command import cgroup_cpu_limit, default_workers

CORES = len(os.sched_getaffinity(0))


def cgroup_v2(tmp: Path, cpu_max: str) -> Path:
    (tmp / "cpu.max").write_text(cpu_max + "\n")
    return tmp


def cgroup_v1(tmp: Path, quota_us: str, period_us: str = "100000") -> Path:
    (tmp / "cpu").mkdir()
    (tmp / "cpu" / "cpu.cfs_quota_us").write_text(quota_us + "\n")
    (tmp / "cpu" / "cpu.cfs_period_us").write_text(period_us + "\n")
    return tmp


@pytest.mark.parametrize(
    ("cpu_max", "limit"),
    [("max 100000", None), ("100000 100000", 1.0), ("50000 100000", 0.5), ("250000 100000", 2.5)],
)
def test_a_cgroup_v2_cpu_limit_caps_the_workers(tmp_path: Path, cpu_max: str, limit: float | None) -> None:
    """A container limited to 1 CPU on a bigger host gets 1 worker, not one per host core."""
    root = cgroup_v2(tmp_path, cpu_max)
    assert cgroup_cpu_limit(root) == limit
    expected = CORES if limit is None else max(1, min(CORES, math.ceil(limit)))
    assert default_workers(root) == expected


@pytest.mark.parametrize(("quota_us", "limit"), [("-1", None), ("100000", 1.0), ("150000", 1.5)])
def test_a_cgroup_v1_cpu_quota_caps_the_workers(tmp_path: Path, quota_us: str, limit: float | None) -> None:
    root = cgroup_v1(tmp_path, quota_us)
    assert cgroup_cpu_limit(root) == limit
    expected = CORES if limit is None else max(1, min(CORES, math.ceil(limit)))
    assert default_workers(root) == expected


def test_no_cgroup_or_a_garbled_one_leaves_the_cores(tmp_path: Path) -> None:
    assert default_workers(tmp_path) == CORES  # no cpu.max, no cpu/: not in a limited cgroup
    assert default_workers(cgroup_v2(tmp_path, "garbage")) == CORES


@pytest.mark.skipif(CORES < 2, reason="needs a machine with 2 cores or more to see the cap")
def test_the_cap_is_below_the_cores_here(tmp_path: Path) -> None:
    assert default_workers(cgroup_v2(tmp_path, "100000 100000")) == 1 < CORES
