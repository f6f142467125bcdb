"""The repeated-warning limiter (balancer/log_limit.py): first occurrence logged, then one line per
interval with the count held back; bounded causes; held-back occurrences counted per cause."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from balancer.errors import ConfigError
from balancer.log_limit import LimitedWarnings, RepeatLimiter
from balancer.metrics import Metrics


def test_first_occurrence_logs_then_one_line_per_interval_with_the_count() -> None:
    limiter = RepeatLimiter(interval_s=10.0)
    assert limiter.occur("redis", 0.0) == 0  # the first: logged
    assert [limiter.occur("redis", t) for t in (0.5, 1.0, 9.9)] == [None, None, None]
    assert limiter.occur("redis", 10.0) == 3  # the summary line: 3 held back
    assert limiter.occur("redis", 10.5) is None
    assert limiter.occur("redis", 25.0) == 1
    assert limiter.occur("redis", 40.0) == 0  # quiet for an interval: logged, nothing held back


def test_causes_are_limited_apart_and_resolving_one_logs_its_next_occurrence_at_once() -> None:
    limiter = RepeatLimiter(interval_s=60.0)
    assert limiter.occur("a", 0.0) == 0
    assert limiter.occur("b", 0.1) == 0
    assert limiter.occur("a", 0.2) is None
    assert limiter.resolve("a") == 1  # one was held back and never logged
    assert limiter.occur("a", 0.3) == 0
    assert limiter.occur("b", 0.4) is None
    assert limiter.resolve("never-seen") == 0


def test_the_number_of_causes_is_bounded_and_the_least_recent_goes_first() -> None:
    limiter = RepeatLimiter(interval_s=60.0, max_causes=3)
    for position, cause in enumerate("abc"):
        limiter.occur(cause, float(position))
    limiter.occur("a", 3.0)  # a is now the most recent
    limiter.occur("d", 4.0)  # b, the least recent, is forgotten
    assert len(limiter) == 3
    assert limiter.occur("a", 5.0) is None
    assert limiter.occur("b", 5.0) == 0  # forgotten, so logged again: harmless


@pytest.mark.parametrize("interval_s, max_causes", [(0.0, 10), (-1.0, 10), (1.0, 0)])
def test_bad_limits_are_refused(interval_s: float, max_causes: int) -> None:
    with pytest.raises(ConfigError):
        RepeatLimiter(interval_s=interval_s, max_causes=max_causes)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abcdef"), st.floats(min_value=0.0, max_value=5.0)), max_size=200),
    st.floats(min_value=0.1, max_value=30.0),
)
def test_every_occurrence_is_logged_or_counted_exactly_once(
    steps: list[tuple[str, float]], interval_s: float
) -> None:
    """Whatever the timing: lines + held back == occurrences, per cause, at most one line per
    interval per cause (after the first), and never more than ``max_causes`` remembered."""
    limiter = RepeatLimiter(interval_s=interval_s, max_causes=6)  # all six causes fit: exact counts
    small = RepeatLimiter(interval_s=interval_s, max_causes=4)  # forgets: only the bound is checked
    now = 0.0
    seen: dict[str, int] = {}
    reported: dict[str, int] = {}
    last_line: dict[str, float] = {}
    for cause, advance in steps:
        now += advance
        seen[cause] = seen.get(cause, 0) + 1
        verdict = limiter.occur(cause, now)
        small.occur(cause, now)
        assert len(small) <= 4
        if verdict is None:
            continue
        if cause in last_line and verdict > 0:
            assert now - last_line[cause] >= interval_s
        last_line[cause] = now
        reported[cause] = reported.get(cause, 0) + 1 + verdict
    for cause in seen:
        assert reported.get(cause, 0) + limiter.resolve(cause) == seen[cause]


def test_limited_warnings_log_once_count_the_rest_and_summarise(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics.create(CollectorRegistry())
    now = [0.0]
    logger = logging.getLogger("kvlb.test.limited")
    warnings = LimitedWarnings(logger, metrics.log_suppressed_total, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvlb.test.limited"):
        for step in range(121):  # a poll every 0.5 s for a minute
            now[0] = step * 0.5
            warnings.warning("policy_invalid", "", "ignoring the policy: %s", "bad json")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "ignoring the policy: bad json"
    assert len(lines) == 2 and "(119 more since the last such line" in lines[1]
    assert metrics.registry.get_sample_value("kvlb_log_suppressed_total", {"cause": "policy_invalid"}) == 119
    warnings.resolved("policy_invalid", "")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvlb.test.limited"):
        assert warnings.warning("policy_invalid", "", "again")
        assert warnings.warning("other", "r1", "another cause logs at once")
        assert warnings.warning("other", "r2", "another subject too")
        assert not warnings.warning("other", "r2", "but not twice")
    assert len(caplog.records) == 3


def test_causes_forgotten_at_the_cap_are_counted_by_their_cause(caplog: pytest.LogCaptureFixture) -> None:
    """The limiter drops its least recently seen cause past ``max_causes``; each drop is counted in
    ``kvlb_log_causes_forgotten_total{cause}`` under the dropped one's cause (not its subject, a
    replica id: the label stays bounded), and the forgotten subject logs again at once."""
    metrics = Metrics.create(CollectorRegistry())
    logger = logging.getLogger("kvlb.test.forgotten")
    warnings = LimitedWarnings(
        logger,
        metrics.log_suppressed_total,
        clock=lambda: 0.0,
        limiter=RepeatLimiter(max_causes=2),
        forgotten=metrics.log_causes_forgotten_total,
    )
    sample = metrics.registry.get_sample_value
    with caplog.at_level(logging.WARNING, logger="kvlb.test.forgotten"):
        assert warnings.warning("zmq_disconnected", "r0/0", "r0 down")
        assert warnings.warning("zmq_disconnected", "r1/0", "r1 down")
        assert sample("kvlb_log_causes_forgotten_total", {"cause": "zmq_disconnected"}) is None
        assert warnings.warning("replay_timeout", "r2/0", "r2 silent")  # the third: r0's goes
        assert sample("kvlb_log_causes_forgotten_total", {"cause": "zmq_disconnected"}) == 1
        assert warnings.warning("zmq_disconnected", "r0/0", "r0 down again")  # forgotten: logged at once
        assert sample("kvlb_log_causes_forgotten_total", {"cause": "zmq_disconnected"}) == 2  # r1's went
        assert not warnings.warning("replay_timeout", "r2/0", "r2 silent")
    assert warnings.limiter.forgotten == 2 and len(warnings.limiter) == 2


def test_every_limited_warnings_of_the_service_counts_what_it_forgets() -> None:
    """Each ``LimitedWarnings`` that ``balancer/`` builds is given ``forgotten`` (or the causes its
    limiter drops at the cap would go uncounted again)."""
    root = Path(__file__).resolve().parents[2] / "balancer"
    calls = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LimitedWarnings":
                calls.append((path.name, {keyword.arg for keyword in node.keywords}))
    assert len(calls) >= 10
    assert [name for name, keywords in calls if "forgotten" not in keywords] == []
