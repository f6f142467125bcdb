"""Smoke test of the soak mode: ``kvlb loadtest --duration 8s --fault-every 3s`` as a process.

One kvlb and three emulated replicas (real processes) under 10 requests/s, two replica faults (at 3 s
and 6 s), a sample a second. Until 2026-12-01 it ran 12 s with a fault every 5 s and a sample every
2 s: the same two faults and more samples, in 4 s less of load. Checks
that the command completes and passes, that stdout and ``report.json`` carry every field of the soak
report (samples of RSS, fds, asyncio tasks, index size, per-interval requests and errors; per fault
the convergence figures; the flat-line verdicts), and that every request is counted in exactly one
interval. No timing assertions: the figures depend on the machine's load.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SAMPLE_FIELDS = (
    "t_s", "rss_mb", "fds", "tasks", "index_held_blocks", "index_unique_blocks", "engine_blocks",
    "inflight", "completed", "errors", "lost", "error_rate", "fault", "drained",
)  # fmt: skip
FAULT_FIELDS = ("fault", "at_s", "note", "within_s", "equal_s")
GROWTH_FIELDS = ("first_quarter", "last_quarter", "growth", "limit", "ok")


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    out = tmp_path_factory.mktemp("soak")
    argv = [
        sys.executable, "-m", "balancer", "loadtest", "--duration", "8s", "--fault-every", "3s",
        "--sample-every", "1s", "--rate", "10", "--seed", "3", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    printed = json.loads(done.stdout)
    assert printed == json.loads((out / "report.json").read_text())
    return out, printed


def test_report_has_every_field(soak: tuple[Path, dict[str, object]]) -> None:
    _, report = soak
    meta, requests = report["meta"], report["requests"]  # type: ignore[index]
    assert "--duration 8s" in meta["command"]
    assert meta["options"]["duration_s"] == 8.0 and meta["options"]["fault_every_s"] == 3.0
    assert requests["sent"] > 50 and requests["outcomes"].get("lost", 0) == 0
    for key in ("error_rate", "p50_ok_s", "p99_ok_s", "lost_details"):
        assert key in requests, key
    faults = report["faults"]  # type: ignore[index]
    assert [f["fault"] for f in faults] == ["restart_flushed", "hwm_loss_replay"]
    for fault in faults:
        assert set(FAULT_FIELDS) <= set(fault), fault
    samples = report["samples"]  # type: ignore[index]
    assert len(samples) >= 5
    for sample in samples:
        assert set(SAMPLE_FIELDS) <= set(sample), sample
        assert sample["rss_mb"] > 0 and sample["fds"] > 0
        assert sample["tasks"] is not None and sample["tasks"] > 0  # kvlb_process_asyncio_tasks
        assert sample["index_held_blocks"] is not None
    assert samples[-1]["drained"] and not any(s["drained"] for s in samples[:-1])
    # every request completed in exactly one interval (the last sample is taken after the drain)
    assert sum(s["completed"] for s in samples) == requests["sent"]
    assert sum(s["errors"] for s in samples) == requests["sent"] - requests["outcomes"]["ok"]
    assert max(s["index_held_blocks"] for s in samples) > 0


def test_verdicts(soak: tuple[Path, dict[str, object]]) -> None:
    _, report = soak
    verdict = report["verdict"]  # type: ignore[index]
    checks = verdict["checks"]
    for key in ("rss_mb", "fds", "tasks"):
        assert set(GROWTH_FIELDS) <= set(checks[key]), checks[key]
        assert checks[key]["growth"] == pytest.approx(
            checks[key]["last_quarter"] - checks[key]["first_quarter"]
        )
    assert checks["lost"] == {"value": 0, "limit": 0, "ok": True}
    assert verdict["passed"] is True


def test_markdown_and_plot_or_a_note(soak: tuple[Path, dict[str, object]]) -> None:
    out, _ = soak
    markdown = (out / "report.md").read_text()
    for heading in ("# kvlb soak: PASSED", "## Verdicts", "## Faults", "## Over time"):
        assert heading in markdown
    assert "| restart_flushed |" in markdown
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in markdown
    else:
        assert (out / "soak_over_time.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "logs" / "kvlb-0.stderr").exists()
