"""The console's series sampler (balancer/service/series.py): intervals, rates, percentiles, bounds."""

from __future__ import annotations

import random

import pytest

from balancer.config import ConsoleConfig
from balancer.errors import ConfigError
from balancer.service.log_histogram import BUCKETS, RELATIVE_ERROR
from balancer.service.series import OTHER_REPLICAS, SeriesSampler, percentile


def sampler(**kw: object) -> tuple[SeriesSampler, list[str]]:
    overflows: list[str] = []
    args: dict[str, object] = {"interval_s": 5.0, "intervals": 4, "max_replicas": 8}
    args.update(kw)
    s = SeriesSampler(**args, on_overflow=overflows.append)  # type: ignore[arg-type]
    return s, overflows


def near(got: float | None, want: float) -> bool:
    """``got`` within the histogram's stated relative error of ``want`` (and its 6-digit rounding)."""
    return got is not None and abs(got - want) <= (RELATIVE_ERROR + 1e-6) * want


def test_one_interval_counts_rates_and_percentiles() -> None:
    s, overflows = sampler()
    for i in range(10):
        s.on_commit("r0" if i < 7 else "r1", 100, 50 if i < 7 else 0, 1000.5)
        s.on_ttft((i + 1) / 10, 1001.0)
    s.on_usage(100, 80, 1002.0)
    s.on_usage(100, 0, 1003.0)
    out = s.series(minutes=5 / 60, wall=1004.0)
    assert out["interval_s"] == 5.0 and out["span_s"] == 20.0
    [row] = out["intervals"]
    assert row["ts"] == 1000.0
    assert row["requests"] == 10 and row["replicas"] == {"r0": 7, "r1": 3}
    assert row["prompt_tokens"] == 1000 and row["predicted_cached_tokens"] == 350
    assert row["predicted_hit_rate"] == 0.35
    assert row["reported_hit_rate"] == 0.4
    assert near(row["ttft_p50_s"], 0.5) and near(row["ttft_p90_s"], 0.9) and row["ttft_count"] == 10
    assert "ttft_histogram" not in row  # only when asked
    assert overflows == []


def test_empty_intervals_are_listed_with_null_rates() -> None:
    s, _ = sampler()
    s.on_commit("r0", 10, 10, 1000.0)
    out = s.series(minutes=15 / 60, wall=1012.0)
    assert [row["ts"] for row in out["intervals"]] == [1000.0, 1005.0, 1010.0]
    empty = out["intervals"][1]
    assert empty["requests"] == 0 and empty["replicas"] == {}
    assert empty["predicted_hit_rate"] is None and empty["ttft_p50_s"] is None


def test_ring_is_bounded_and_old_intervals_fall_off() -> None:
    s, _ = sampler(intervals=3)
    for k in range(10):
        s.on_commit("r0", 1, 0, 1000.0 + 5 * k)
    assert len(s._ring) == 3
    out = s.series(minutes=60, wall=1045.0)  # asks for more than the ring holds: gets the ring's span
    assert len(out["intervals"]) == 3
    assert [row["requests"] for row in out["intervals"]] == [1, 1, 1]


def test_replica_names_are_bounded() -> None:
    s, overflows = sampler(max_replicas=2)
    for name in ("a", "b", "c", "d", "a"):
        s.on_commit(name, 1, 0, 1000.0)
    [row] = s.series(minutes=5 / 60, wall=1000.0)["intervals"]
    assert row["replicas"] == {"a": 2, "b": 1, OTHER_REPLICAS: 2}
    assert overflows == ["replicas", "replicas"]


def test_every_ttft_is_counted_in_at_most_the_buckets() -> None:
    s, overflows = sampler()
    rng = random.Random(3)
    values = [rng.lognormvariate(-1.6, 2.0) for _ in range(10_000)] + [0.0, 1e-7, 1e9]
    for value in values:
        s.on_ttft(value, 1000.0)
    [row] = s.series(minutes=5 / 60, wall=1000.0, ttft_histograms=True)["intervals"]
    values.sort()
    assert row["ttft_count"] == len(values) and sum(row["ttft_histogram"][1:]) == len(values)
    assert len(row["ttft_histogram"]) <= BUCKETS + 1 and overflows == []
    assert near(row["ttft_p50_s"], percentile(values, 0.5) or 0.0)
    assert near(row["ttft_p90_s"], percentile(values, 0.9) or 0.0)


def test_histograms_are_listed_when_asked_and_closed_rows_kept_without_them() -> None:
    s, _ = sampler()
    s.on_ttft(0.2, 1000.0)
    s.on_ttft(0.3, 1006.0)
    plain = s.series(minutes=10 / 60, wall=1006.0)
    full = s.series(minutes=10 / 60, wall=1006.0, ttft_histograms=True)
    assert plain["ttft_buckets"]["relative_error"] == round(RELATIVE_ERROR, 4)
    assert [sum(r["ttft_histogram"][1:]) for r in full["intervals"]] == [1, 1]
    assert all("ttft_histogram" not in r for r in plain["intervals"])
    assert all("ttft_histogram" not in r for r in s.series(minutes=10 / 60, wall=1006.0)["intervals"])
    assert (
        s.series(minutes=15 / 60, wall=1011.0, ttft_histograms=True)["intervals"][2]["ttft_histogram"] == []
    )


def test_a_clock_stepping_back_lands_in_the_newest_interval() -> None:
    s, _ = sampler()
    s.on_commit("r0", 1, 0, 1010.0)
    s.on_commit("r0", 1, 0, 990.0)
    assert len(s._ring) == 1 and s._ring[-1].requests == 2


def test_bad_samples_are_ignored() -> None:
    s, _ = sampler()
    s.on_ttft(float("nan"), 1000.0)
    s.on_ttft(-1.0, 1000.0)
    assert not s._ring


def test_percentile_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([1.0], 0.9) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.9) == 4.0


def test_invalid_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        SeriesSampler(0.0, 1, 1)
    with pytest.raises(ValueError):
        SeriesSampler(5.0, 0, 1)


def test_older_rows_are_computed_once_and_the_newest_stays_live() -> None:
    s, _ = sampler()
    s.on_commit("r0", 10, 5, 1000.0)
    s.on_commit("r0", 10, 5, 1005.0)
    first = s.series(minutes=10 / 60, wall=1005.0)["intervals"]
    s.on_commit("r1", 10, 10, 1006.0)  # lands in the newest interval only
    again = s.series(minutes=10 / 60, wall=1006.0)["intervals"]
    assert again[0] is first[0]  # the closed interval's row, kept
    assert first[1]["requests"] == 1 and again[1]["requests"] == 2
    assert again[1]["replicas"] == {"r0": 1, "r1": 1}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("series_interval_s", 0.1),
        ("series_interval_s", 7200.0),
        ("series_intervals", 0),
        ("series_ttft_samples", 0),
        ("series_max_replicas", 100_001),
    ],
)
def test_console_series_settings_are_bounded(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"console.{field}"):
        ConsoleConfig(**{field: value}).validate()  # type: ignore[arg-type]
    ConsoleConfig().validate()
