"""``python -m loadtests.tenant_rate`` end to end at a smoke size: emulated replicas, a real ``kvlb
serve`` and the noisy client as child processes; with ``tenant_rate_per_s`` on, the flooding tenant
is refused with 429 while the quiet tenant is served, and the refusal mode prints a CPU cost per
refusal. Asserts no timings."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest


def run(*args: str) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, "-m", "loadtests.tenant_rate", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    document: dict[str, Any] = json.loads(completed.stdout)
    return document


def test_tenant_rate_smoke_refuses_the_flood_and_serves_the_quiet_tenant() -> None:
    (run_,) = run("--runs", "rate", "--seconds", "1", "--loops", "16", "--rate-per-s", "20")["runs"]
    assert run_["mode"] == "rate"
    assert run_["with"]["statuses"].get("200", 0) > 0 and set(run_["with"]["statuses"]) == {"200"}, run_
    assert run_["noisy_statuses"].get("429", 0) > 0, run_
    assert run_["with"]["p50_ms"] is not None


def test_tenant_rate_smoke_measures_a_refusal() -> None:
    (run_,) = run("--refusals", "--runs", "rate", "--seconds", "1", "--loops", "8")["runs"]
    assert run_["noisy_statuses"].get("429", 0) > 0, run_
    assert run_["cpu_us_per_refusal"] is not None and run_["cpu_us_per_refusal"] > 0, run_


@pytest.mark.faults_long  # make faults: 18 s of three scenarios; the flood's smoke stays in make test
def test_tenant_rate_smoke_runs_the_walk_scenarios() -> None:
    """Three of the walk's other scenarios, those with code of their own (text prompts tokenized in
    threads, bursts cut by the client, streams on raw sockets), one run each at a smoke size (a
    ``kvlb serve`` and a noisy client process per scenario: 40 s at a load of 20 on 2 cores), with
    ``limits.max_tokenizing_per_tenant``; the JSON document and the table (stderr) name every
    scenario, the quiet tenant is served in each. The others' requests are checked in
    ``tests/unit/test_tenant_noise.py``."""
    noises = ["huge", "bursts", "streams"]
    completed = subprocess.run(
        [sys.executable, "-m", "loadtests.tenant_rate", "--noise", ",".join(noises), "--runs", "tokenizing",
         "--seconds", "0.5", "--loops", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )  # fmt: skip
    runs = json.loads(completed.stdout)["runs"]
    assert [run_["noise"] for run_ in runs] == noises
    for run_ in runs:
        assert run_["mode"] == "tokenizing"
        assert run_["with"]["statuses"].get("200", 0) > 0, run_
        assert sum(run_["noisy_statuses"].values()) > 0, run_
    table_rows = [line for line in completed.stderr.splitlines() if line.startswith("| ")]
    assert [row.split(" (")[0] for row in table_rows[1:]] == ["| " + noise for noise in noises], table_rows
