"""The soak's pure parts: durations with units, the quarters' medians and the flat-line verdicts."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from loadtests.faults.soak import kvlb_figures, parse_duration
from loadtests.faults.soak_report import GrowthLimits, judge, markdown, quarters


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("20s", 20.0), ("3m", 180.0), ("30M", 1800.0), ("1.5h", 5400.0), ("0", 0.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "3x", "-5s", "inf", "nan", "3 m s"])
def test_parse_duration_refuses_junk(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


def test_kvlb_figures_pick_the_series_by_labels() -> None:
    text = (
        '# HELP x\nkvlb_index_blocks{kind="unique"} 7.0\nkvlb_index_blocks{kind="held"} 12.0\n'
        "kvlb_process_asyncio_tasks 31.0\nother_metric 5\n"
    )
    assert kvlb_figures(text) == {
        "tasks": 31,
        "index_held_blocks": 12,
        "index_unique_blocks": 7,
        "inflight": None,
    }
    nothing = {"tasks": None, "index_held_blocks": None, "index_unique_blocks": None, "inflight": None}
    assert kvlb_figures("") == nothing  # kvlb did not answer
    assert kvlb_figures("kvlb_process_asyncio_tasks{oops 1\n") == nothing  # unparseable: no figure


def samples(values: list[float | None], key: str = "tasks") -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{"t_s": float(i), key: v, "drained": False} for i, v in enumerate(values)]
    rows.append({"t_s": float(len(values)), key: 0, "drained": True})  # after the load: left out
    return rows


def test_quarters_are_medians_of_the_first_and_last_quarter() -> None:
    # t = 0..8: first quarter t <= 2 (10, 11, 90 → 11), last quarter t >= 6 (20, 21, 22 → 21)
    assert quarters(samples([10, 11, 90, 50, 50, 50, 20, 21, 22]), "tasks") == (11.0, 21.0)
    assert quarters(samples([None, None, 5, 5, 5, 5, 5, 5, None]), "tasks") == (5.0, 5.0)
    assert quarters(samples([7]), "tasks") == (7.0, 7.0)
    assert quarters(samples([None, None]), "tasks") == (None, None)
    assert quarters([], "tasks") == (None, None)


def figures(tasks: list[float | None], lost: int = 0, fault_error: bool = False) -> dict[str, Any]:
    rows = [
        {"t_s": float(i), "rss_mb": 100.0, "fds": 40, "tasks": v, "drained": False}
        for i, v in enumerate(tasks)
    ]
    fault: dict[str, Any] = {
        "fault": "slow_replica",
        "at_s": 1.0,
        "within_s": 0.1,
        "equal_s": 0.1,
        "note": "x",
    }
    if fault_error:
        fault["error"] = "RuntimeError: r1 never became routable again"
    return {"samples": rows, "requests": {"outcomes": {"ok": 10, "lost": lost}}, "faults": [fault]}


def test_flat_lines_pass() -> None:
    # t = 0..7: first quarter t <= 1.75 (16, 17 → 16.5), last quarter t >= 5.25 (16, 16)
    verdict = judge(figures([16, 17, 16, 18, 16, 17, 16, 16]), GrowthLimits())
    assert verdict["passed"], verdict
    assert verdict["checks"]["tasks"]["growth"] == -0.5
    assert verdict["checks"]["rss_mb"] == {
        "first_quarter": 100.0, "last_quarter": 100.0, "growth": 0.0, "limit": 50.0, "ok": True,
    }  # fmt: skip


def test_growth_beyond_the_limit_fails() -> None:
    verdict = judge(figures([16, 16, 16, 30, 40, 50, 60, 60, 60]), GrowthLimits(tasks=20))
    assert not verdict["passed"]
    assert verdict["checks"]["tasks"] == {
        "first_quarter": 16.0, "last_quarter": 60.0, "growth": 44.0, "limit": 20, "ok": False,
    }  # fmt: skip
    assert verdict["checks"]["rss_mb"]["ok"] and verdict["checks"]["fds"]["ok"]


def test_a_lost_request_a_failed_fault_or_no_measure_fails() -> None:
    assert not judge(figures([16] * 8, lost=1), GrowthLimits())["passed"]
    assert not judge(figures([16] * 8, fault_error=True), GrowthLimits())["passed"]
    assert not judge(figures([None] * 8), GrowthLimits())["passed"]  # the tasks gauge never answered


def test_markdown_states_the_verdict() -> None:
    data = figures([16, 16, 16, 30, 40, 50, 60, 60, 60])
    for sample in data["samples"]:
        sample |= {"index_held_blocks": 5, "engine_blocks": 5, "inflight": 0, "completed": 1, "errors": 0,
                   "error_rate": 0.0, "fault": ""}  # fmt: skip
    data["requests"] |= {"sent": 10, "error_rate": 0.0, "p50_ok_s": 0.1, "p99_ok_s": 0.2, "lost_details": []}
    report = {
        "meta": {"command": "kvlb loadtest --duration 9s", "started": "now", "load_average": [0.1],
                 "options": {"rate": 20.0, "fault_every_s": 3.0, "sample_every_s": 1.0}},
        "elapsed_s": 9.0, "kvlb": {"pid": 1, "engines": ["sglang"]},
        **data, "verdict": judge(data, GrowthLimits()),
    }  # fmt: skip
    text = markdown(report, None)
    assert text.startswith("# kvlb soak: FAILED")
    assert "| tasks | 16.0 | 60.0 | 44.0 | 20.0 | **no** |" in text
    assert "| 1.0 s | slow_replica | 0.10 s | 0.10 s | x |" in text
