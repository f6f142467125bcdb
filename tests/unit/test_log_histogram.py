"""The mergeable TTFT summary (balancer/service/log_histogram.py): quantiles within the stated
relative error of the exact nearest-rank ones, merging as adding, the wire form and its checks."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.service.log_histogram import (
    BUCKETS,
    MAX_S,
    MIN_S,
    RELATIVE_ERROR,
    LogHistogram,
    bucket_of,
    bucket_value,
)
from balancer.service.series import percentile

QS = (0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999, 1.0)
SLACK = 1e-12
"""Float rounding at a bucket's edge (log, then floor)."""

in_range = st.floats(min_value=MIN_S, max_value=MAX_S / 1.2, allow_nan=False, allow_infinity=False)


def histogram(values: list[float]) -> LogHistogram:
    made = LogHistogram()
    for value in values:
        made.add(value)
    return made


def within(got: float | None, exact: float | None) -> bool:
    assert got is not None and exact is not None
    return abs(got - exact) <= (RELATIVE_ERROR + SLACK) * exact


def test_the_stated_error_is_under_five_percent() -> None:
    assert RELATIVE_ERROR < 0.048
    assert MIN_S == 1e-4 and MAX_S > 10_000  # 0.1 ms .. past any first-byte timeout
    assert bucket_of(MIN_S / 2) == 0 and bucket_of(MAX_S * 10) == BUCKETS - 1


@settings(max_examples=300, deadline=None)
@given(st.lists(in_range, min_size=1, max_size=400))
def test_quantiles_are_within_the_stated_error_of_the_exact_ones(values: list[float]) -> None:
    made = histogram(values)
    ordered = sorted(values)
    assert made.total == len(values)
    for q in QS:
        assert within(made.quantile(q), percentile(ordered, q)), q


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(in_range, max_size=200), min_size=1, max_size=5))
def test_merged_parts_give_the_union_s_quantiles(parts: list[list[float]]) -> None:
    """Merging (through the wire form, as the workers do) is the histogram of all the values."""
    merged = LogHistogram()
    for part in parts:
        merged.merge(LogHistogram.from_json(histogram(part).to_json()))
    union = [value for part in parts for value in part]
    whole = histogram(union)
    assert merged.to_json() == whole.to_json() and merged.total == len(union)
    for q in QS:
        if union:
            assert merged.quantile(q) == whole.quantile(q)
            assert within(merged.quantile(q), percentile(sorted(union), q))
        else:
            assert merged.quantile(q) is None


def test_skewed_random_data_over_many_decades() -> None:
    rng = random.Random(7)
    for _ in range(20):
        values = [rng.lognormvariate(rng.uniform(-6, 3), rng.uniform(0.1, 3)) for _ in range(2_000)]
        values = [min(max(v, MIN_S), MAX_S / 1.2) for v in values]
        made = histogram(values)
        ordered = sorted(values)
        assert len(made.counts) <= BUCKETS
        assert made.quantiles(QS) == [made.quantile(q) for q in QS]
        for q in QS:
            assert within(made.quantile(q), percentile(ordered, q))


def test_bad_values_are_ignored_and_out_of_range_ones_clamped() -> None:
    made = histogram([math.nan, math.inf, -1.0, 0.0, 1e-9, 1e12])
    assert made.total == 3
    assert made.quantile(0.0) == bucket_value(0) and made.quantile(1.0) == bucket_value(BUCKETS - 1)
    assert LogHistogram().quantile(0.5) is None and LogHistogram().to_json() == []


@pytest.mark.parametrize(
    "wire",
    [
        None,
        {"first": 1},
        [3],
        [-1, 1],
        [1, -1],
        [1, 1.5],
        [1, "2"],
        [BUCKETS - 1, 1, 1],
        [0] + [1] * (BUCKETS + 1),
    ],
)
def test_a_bad_wire_form_is_a_value_error(wire: object) -> None:
    with pytest.raises(ValueError):
        LogHistogram.from_json(wire)


def test_the_wire_form_round_trips() -> None:
    made = histogram([0.01, 0.5, 0.5, 2.0])
    again = LogHistogram.from_json(made.to_json())
    assert again.to_json() == made.to_json() and again.total == 4 and again.first == bucket_of(0.01)
    assert LogHistogram.from_json([]).total == 0
