"""``python -m loadtests.bench.metrics_cost`` runs and reports its figures (no timing asserted)."""

from __future__ import annotations

import pytest

from loadtests.bench import metrics_cost


def test_the_bench_reports_both_renderers_and_the_merge(capsys: pytest.CaptureFixture[str]) -> None:
    result = metrics_cost.main(["--replicas", "3", "--repeats", "2"])
    out = capsys.readouterr().out
    assert '"registries"' in out and "| full |" in out
    for name in ("load", "full"):
        row = result["registries"][name]
        assert row["exposition_same_bytes"] is True
        assert row["samples"] > 0 and row["bytes"] > 0
        for figure in ("generate_latest", "exposition", "merge_2"):
            assert set(row[figure]) == {"best_ms", "median_ms"}
    assert result["registries"]["full"]["samples"] > result["registries"]["load"]["samples"]
    full = result["registries"]["full"]
    assert full["changed_same_bytes"] is True  # after more requests observed, still generate_latest's text
    assert set(full["changed"]) == {"generate_latest", "exposition"}
    assert set(full["longest_step_ms"]) == {"first", "later"}
    assert set(full["longest_step_ms"]["first"]) == {"wall", "cpu"}
