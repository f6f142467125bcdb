"""``kvlb simulate`` and ``kvlb tune`` smoke runs through the real CLI (no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from balancer.cli.main import main
from loadtests.stats import SUMMARY_FIELDS


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_simulate_smoke_report_has_every_field(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_file = tmp_path / "sim.json"
    code, out = _run(capsys, "simulate", "--smoke", "--json", "--output", str(out_file))
    assert code == 0
    report = json.loads(out)
    assert report == json.loads(out_file.read_text("utf-8"))
    assert report["kind"] == "kvlb-simulate"
    assert list(report["summary"]) == list(SUMMARY_FIELDS)
    summary = report["summary"]
    assert summary["requests"] == 200 and summary["ok"] + summary["errors"] == 200
    assert summary["ttft_p90_s"] > 0 and 0 <= summary["hit_rate"] <= 1
    assert len(summary["replica_requests"]) == 4
    for name in ("virtual_s", "events", "wall_s", "routed_pruned", "index_unique_blocks"):
        assert name in report["sim"]
    assert report["config"]["weights"]["overlap_credit"] == 1.0


def test_simulate_compare_with_a_loadtest_report(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    small = ("simulate", "--smoke", "--requests", "60")
    code, out = _run(capsys, *small, "--json")
    summary = json.loads(out)["summary"]
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"summary": summary}), "utf-8")
    code, out = _run(capsys, *small, "--json", "--compare-with", str(same))
    assert code == 0 and json.loads(out)["comparison"]["ok"] is True
    slower = tmp_path / "slower.json"
    slower.write_text(json.dumps({**summary, "ttft_p90_s": summary["ttft_p90_s"] * 2 + 0.05}), "utf-8")
    code, out = _run(capsys, *small, "--compare-with", str(slower))
    assert code == 1 and "ttft_p90_s" in out and "NO" in out


def test_simulate_trace_and_readable_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rows = [
        {"timestamp": 100 * n, "input_length": 900, "output_length": 4, "hash_ids": [n % 3, 10 + n]}
        for n in range(30)
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows), "utf-8")
    code, out = _run(
        capsys, "simulate", "--trace", str(trace), "--replicas", "3", "--requests", "60", "--rate", "20"
    )
    assert code == 0
    assert "60 requests on 3 replicas" in out
    for name in SUMMARY_FIELDS:
        assert name in out


def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--smoke", "--weights", "overlap_credit=7"]) == 2
    assert main(["tune", "--smoke", "--grid", "nonsense=1"]) == 2
    assert "kvlb" in capsys.readouterr().err


def test_tune_smoke_recommends_usable_weights(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "frontier.png"
    code, out = _run(capsys, "tune", "--smoke", "--json", "--plot", str(plot), "--max-imbalance", "3")
    assert code == 0
    report = json.loads(out)
    assert len(report["points"]) == 4
    for point in report["points"]:
        assert list(point["summary"]) == list(SUMMARY_FIELDS)
    assert any(p["frontier"] for p in report["points"])
    command = report["recommendation"]["command"]
    assert command.startswith("kvlb admin policy set name=cost ")
    if report["plot"] is not None:  # matplotlib is optional
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tiny = ("--requests", "40", "--grid", "overlap_credit=1", "--no-plot", "--min-hit-rate", "1")
    code, text = _run(capsys, "tune", "--smoke", *tiny)
    assert code == 1 and "no point meets" in text
