"""``python -m loadtests.bench.admin_list`` at smoke size: a real balancer over three static replicas,
its client in a child process, every field of the report present and consistent. No timing
assertions."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadtests.bench.admin_list import format_report

COMMAND = ["--replicas", "3", "--calls", "4", "--warmup", "1", "--pause-ms", "0", "--interval-s", "0.1"]


@pytest.mark.faults_long  # make faults: three processes start (17 s at load 12, beside a bench run)
def test_smoke_run_reports_every_field() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.bench.admin_list", *COMMAND, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert (report["replicas"], report["calls"], report["warmup"]) == (3, 4, 1)
    assert len(report["load"]) == 3 and report["utc"].endswith("Z")
    for kind in ("grpc", "http"):
        row = report[kind]
        assert row["calls"] == 4 and row["bytes"] > 3 * 1000  # three replicas' views
        for figure in ("hold_ms", "hold_cpu_ms", "busy_ms", "latency_ms"):
            summary = row[figure]
            assert summary["max"] >= summary["p99"] >= summary["p50"] >= 0, (kind, figure)
        assert row["busy_ms"]["max"] >= row["hold_ms"]["max"]
    table = format_report(report)
    assert "Admin/ListReplicas" in table and "GET /admin/replicas" in table
