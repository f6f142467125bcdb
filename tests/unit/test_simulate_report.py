"""Simulator reports: columnar records, pooled ITL histogram, comparison with a loadtest report."""

from __future__ import annotations

import dataclasses
import random

import pytest

from loadtests.simulate.report import GapHistogram, RecordColumns, compare, run_summary, summary_of
from loadtests.stats import SUMMARY_FIELDS, RequestRecord, Summary, percentile, summarize


def _columns() -> RecordColumns:
    cols = RecordColumns(["r0", "r1", "r2"])
    rng = random.Random(3)
    for n in range(40):
        i = cols.add(n * 0.5, 100 + n)
        if n % 10 == 9:
            cols.refuse(i, n * 0.5, 503)
            continue
        cols.route(i, n % 2)
        cols.first_token(i, n * 0.5 + rng.uniform(0.01, 0.2))
        cols.finish(i, n * 0.5 + 1.0, cached_tokens=n, completion_tokens=8)
    cols.add(30.0, 5)  # still in flight: cancelled
    return cols


def test_columns_are_the_records_summarize_expects() -> None:
    cols = _columns()
    plain = [
        RequestRecord(**{**dataclasses.asdict(record), "tags": (), "itl_s": ()}) for record in cols
    ]  # materialised copies
    assert len(cols) == 41 and cols[-1].outcome == "cancelled" and cols[9].status == 503
    assert cols[0].replica == "r0" and cols[1].replica == "r1" and cols[0].cached_tokens == 0
    assert [r.request_id for r in cols[:3]] == ["sim-0", "sim-1", "sim-2"]
    assert summarize(cols, 31.0, replicas=cols.replicas) == summarize(plain, 31.0, replicas=cols.replicas)
    summary = summarize(cols, 31.0, replicas=cols.replicas)
    assert summary.ok == 36 and summary.errors == 4 and summary.cancelled == 1
    assert summary.replica_requests == {"r0": 20, "r1": 16, "r2": 0}  # refused ones name no replica


def test_gap_histogram_percentiles_match_exact_ones() -> None:
    rng = random.Random(5)
    values = [rng.lognormvariate(-4.5, 0.6) for _ in range(5000)]
    gaps = GapHistogram()
    for value in values:
        gaps.add(value)
    for p in (10, 50, 90, 99):
        exact = percentile(values, p)
        assert exact is not None
        assert gaps.percentile(p) == pytest.approx(exact, rel=0.003)
    weighted = GapHistogram()
    weighted.add(0.01, 3)
    weighted.add(0.05, 1)
    assert weighted.percentile(50) == pytest.approx(0.01, rel=0.002)
    assert weighted.percentile(100) == pytest.approx(0.05, rel=0.002)
    assert GapHistogram().percentile(50) is None


def test_run_summary_takes_itl_from_the_histogram() -> None:
    gaps = GapHistogram()
    gaps.add(0.02, 10)
    summary = run_summary(_columns(), gaps, 31.0)
    assert summary.itl_p50_s == pytest.approx(0.02, rel=0.002)
    assert summary.ttft_p90_s is not None and summary.hit_rate is not None


def _summary(**changes: object) -> Summary:
    return dataclasses.replace(summarize(_columns(), 31.0), **changes)  # type: ignore[arg-type]


def test_compare_within_and_outside_tolerance() -> None:
    real = _summary(ttft_p90_s=0.200, hit_rate=0.60)
    close = compare(_summary(ttft_p90_s=0.215, hit_rate=0.56), real, 0.10)
    assert [c.ok for c in close] == [True, True]
    assert close[0].relative_error == pytest.approx(0.075)
    far = compare(_summary(ttft_p90_s=0.250, hit_rate=0.50), real, 0.10)
    assert [c.ok for c in far] == [False, False]
    tight = compare(_summary(ttft_p90_s=0.215, hit_rate=0.60), real, 0.05)
    assert [c.ok for c in tight] == [False, True]


def test_compare_slack_near_zero_and_missing_fields() -> None:
    real = _summary(ttft_p90_s=0.002, hit_rate=0.0)
    checks = compare(_summary(ttft_p90_s=0.004, hit_rate=0.005), real, 0.10)
    assert all(c.ok for c in checks)  # inside the absolute slack of 5 ms and 1 point
    missing = compare(_summary(hit_rate=None), _summary(hit_rate=0.5), 0.10)
    assert missing[1].ok is False and missing[1].relative_error is None


def test_summary_of_accepts_a_report_or_a_bare_summary() -> None:
    summary = _summary()
    assert summary_of({"summary": summary.to_dict(), "kind": "x"}) == summary
    assert summary_of(summary.to_dict()) == summary
    other = _summary(ttft_p90_s=9.0)
    loadtest = {
        "meta": {},
        "routers": [
            {"name": "round_robin", "kind": "kvlb", "policy": "round_robin", "summary": other.to_dict()},
            {"name": "sglang", "kind": "peer", "policy": "cost", "summary": other.to_dict()},
            {"name": "kvlb-cost", "kind": "kvlb", "policy": "cost", "summary": summary.to_dict()},
            {"name": "broken", "kind": "kvlb", "policy": "cost", "summary": {}},
        ],
    }
    assert summary_of(loadtest, policy="cost") == summary
    assert summary_of(loadtest, router="round_robin") == other
    with pytest.raises(ValueError, match="no router entry"):
        summary_of(loadtest, router="broken")
    partial = {name: summary.to_dict()[name] for name in SUMMARY_FIELDS[:-1]}
    with pytest.raises(ValueError, match="imbalance"):
        summary_of({"summary": partial})
