"""``kvlb bench index --smoke``: the report has every field (no timing assertions)."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from balancer.cli.main import main

KVLB_FIELDS = {
    "apply_blocks_per_s",
    "apply_blocks_per_cpu_s",
    "apply_runs_blocks_per_s",
    "apply_evicting_blocks_per_s",
    "events",
    "held_blocks",
    "unique_blocks",
    "match_us",
    "bytes_per_block",
    "bytes_per_block_estimate",
    "rss_bytes_per_block",
    "hash_8k_ms",
}
MATCH_FIELDS = {"p50", "p99", "mean", "cpu", "by_kind", "unfiltered", "wrong_results"}


def run_bench(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert main(["bench", "index", "--smoke", *flags]) == 0
    return capsys.readouterr().out


def check_kvlb(report: dict[str, Any]) -> None:
    assert set(report) >= {"shape", "calibration_loop_ms", "mix", "targets", "kvlb", "dynamo"}
    assert sum(report["mix"].values()) == pytest.approx(1.0)
    kvlb = report["kvlb"]
    assert set(kvlb) >= KVLB_FIELDS
    assert set(kvlb["match_us"]) >= MATCH_FIELDS
    assert set(kvlb["match_us"]["by_kind"]) == {"hit", "prefix", "miss"}
    assert kvlb["match_us"]["wrong_results"] == 0
    assert set(kvlb["hash_8k_ms"]) == {"16", "32"}
    assert kvlb["held_blocks"] >= report["shape"]["held_blocks"]
    assert kvlb["unique_blocks"] <= kvlb["held_blocks"]
    for name in ("apply_blocks_per_s", "bytes_per_block", "bytes_per_block_estimate"):
        assert kvlb[name] > 0


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() walks only what it made
def test_smoke_json_has_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    report = json.loads(run_bench(capsys, "--json"))
    check_kvlb(report)
    dynamo = report["dynamo"]
    if dynamo["available"]:
        assert set(dynamo) >= {
            "version",
            "apply_blocks_per_s",
            "match_us",
            "rss_bytes_per_block",
            "hash_8k_ms",
        }
        assert dynamo["match_us"]["wrong_results"] == 0
        assert set(dynamo["ratios_kvlb_over_dynamo"]) >= {
            "apply_blocks_per_s",
            "match_p50_us",
            "hash_8k_ms_16",
        }
    else:
        assert "not installed" in dynamo["reason"]


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() walks only what it made
def test_without_dynamo_the_bench_carries_on(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "dynamo", None)  # makes ``import dynamo.llm`` fail
    monkeypatch.setitem(sys.modules, "dynamo.llm", None)
    out = run_bench(capsys)
    table, _, last = out.rpartition("\n\n")
    assert "dynamo: not installed" in table
    assert "match p50" in table and "hash 8k tokens bs=16" in table
    report = json.loads(last)
    check_kvlb(report)
    assert report["dynamo"]["available"] is False
