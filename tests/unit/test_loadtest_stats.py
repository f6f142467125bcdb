"""Load-test statistics on hand-made records, and the SSE parsing that builds records."""

from __future__ import annotations

import json

import pytest

from loadtests.report import replicas_per_group
from loadtests.sse import StreamState
from loadtests.stats import (
    SUMMARY_FIELDS,
    RequestRecord,
    Summary,
    by_tag,
    implausible_cached,
    percentile,
    ratio,
    ratios,
    send_lag,
    summarize,
    summarize_by,
)
from loadtests.workloads.base import RequestSpec


def _ok(rid: str, ttft: float, e2e: float, replica: str, **more: object) -> RequestRecord:
    values: dict[str, object] = {"prompt_tokens": 100, "completion_tokens": 10, "cached_tokens": 50}
    values.update(more)
    return RequestRecord(
        rid,
        "ok",
        start_s=0.0,
        status=200,
        ttft_s=ttft,
        e2e_s=e2e,
        replica=replica,
        **values,  # type: ignore[arg-type]
    )


RECORDS = [
    _ok("a", 0.1, 1.0, "r0", itl_s=(0.01, 0.03), tags=(("tenant", "t0"),)),
    _ok("b", 0.2, 2.0, "r0", itl_s=(0.02,), tags=(("tenant", "t0"),)),
    _ok("c", 0.3, 3.0, "r1", cached_tokens=0, tags=(("tenant", "t1"),)),
    _ok("d", 0.4, 4.0, "r0", prompt_tokens=300, cached_tokens=250, completion_tokens=30),
    RequestRecord("e", "http_error", start_s=0.5, status=429, error="HTTP 429", e2e_s=0.01, replica="r1"),
    RequestRecord("f", "timeout", start_s=0.6, error="slow", e2e_s=5.0),
    RequestRecord("g", "cancelled", start_s=0.7, e2e_s=0.2, ttft_s=0.05),
]


def test_percentiles_interpolate_between_closest_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # position 2.7: 3 + 0.7 · (4 − 3)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_summary_of_hand_made_records() -> None:
    summary = summarize(RECORDS, duration_s=2.0)
    assert (summary.requests, summary.ok, summary.errors, summary.timeouts, summary.cancelled) == (
        7,
        4,
        2,
        1,
        1,
    )
    assert summary.error_rate == pytest.approx(2 / 6)
    assert summary.req_per_s == pytest.approx(2.0)
    assert summary.output_tok_per_s == pytest.approx((10 + 10 + 10 + 30) / 2.0)
    # ok TTFTs [0.1, 0.2, 0.3, 0.4]: p50 at position 1.5, p90 at 2.7, p99 at 2.97.
    assert summary.ttft_p50_s == pytest.approx(0.25)
    assert summary.ttft_p90_s == pytest.approx(0.37)
    assert summary.ttft_p99_s == pytest.approx(0.397)
    assert summary.ttft_mean_s == pytest.approx(0.25)
    assert summary.e2e_p50_s == pytest.approx(2.5) and summary.e2e_p99_s == pytest.approx(3.97)
    # ITL gaps pooled: [0.01, 0.03, 0.02] → p50 0.02, p90 at position 1.8: 0.02 + 0.8 · 0.01.
    assert summary.itl_p50_s == pytest.approx(0.02) and summary.itl_p90_s == pytest.approx(0.028)
    assert (summary.prompt_tokens, summary.cached_tokens) == (600, 350)
    assert summary.hit_rate == pytest.approx(350 / 600)
    assert summary.replica_requests == {"r0": 3, "r1": 2}
    assert summary.replica_share == {"r0": pytest.approx(0.6), "r1": pytest.approx(0.4)}
    assert summary.imbalance == pytest.approx(3 / 2.5)


def test_the_hit_rate_counts_only_plausible_reported_cached_tokens() -> None:
    records = [
        _ok("a", 0.1, 1.0, "r0", cached_tokens=40),
        _ok("b", 0.1, 1.0, "r0", cached_tokens=None),  # not reported: no miss either
        _ok("c", 0.1, 1.0, "r0", cached_tokens=500),  # more than the prompt's 100
        _ok("d", 0.1, 1.0, "r0", cached_tokens=-1),
    ]
    summary = summarize(records, 1.0)
    assert summary.hit_rate == pytest.approx(0.4) and summary.cached_tokens == 40
    assert summary.prompt_tokens == 400  # every prompt reported
    assert implausible_cached(records) == 2
    assert summarize(records[2:], 1.0).hit_rate is None


def test_no_completion_tokens_reported_is_no_throughput_figure() -> None:
    silent = summarize([_ok("a", 0.1, 1.0, "r0", completion_tokens=None)], 1.0)
    assert silent.output_tok_per_s is None and silent.req_per_s == 1.0
    assert summarize([], 1.0).output_tok_per_s == 0.0  # no answer at all: nothing was produced


def test_unseen_replicas_count_as_idle_in_the_imbalance() -> None:
    summary = summarize(RECORDS, 2.0, replicas=["r0", "r1", "r2"])
    assert summary.replica_requests == {"r0": 3, "r1": 2, "r2": 0}
    assert summary.imbalance == pytest.approx(3 / (5 / 3))


def test_empty_and_uncached_runs_give_none_not_zero() -> None:
    empty = summarize([], 1.0)
    assert empty.requests == 0 and empty.ttft_p50_s is None and empty.error_rate is None
    assert empty.imbalance is None and empty.hit_rate is None
    no_cache = summarize([_ok("x", 0.1, 0.2, "r0", cached_tokens=None)], 1.0)
    assert no_cache.hit_rate is None and no_cache.prompt_tokens == 100


def test_summary_dict_has_the_stable_field_list_and_round_trips() -> None:
    assert SUMMARY_FIELDS == (
        "requests", "ok", "errors", "timeouts", "cancelled", "error_rate", "duration_s", "req_per_s",
        "output_tok_per_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s",
        "itl_p90_s", "e2e_mean_s", "e2e_p50_s", "e2e_p90_s", "e2e_p99_s", "prompt_tokens",
        "cached_tokens", "completion_tokens", "hit_rate", "replica_requests", "replica_share",
        "imbalance",
    )  # fmt: skip
    summary = summarize(RECORDS, 2.0)
    data = json.loads(json.dumps(summary.to_dict()))
    assert tuple(data) == SUMMARY_FIELDS
    assert Summary.from_dict(data) == summary


def test_records_round_trip_through_json() -> None:
    for record in RECORDS:
        assert RequestRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    assert RECORDS[0].to_dict()["tags"] == {"tenant": "t0"}


def test_ratios_compare_two_runs_and_refuse_to_divide_by_zero() -> None:
    fast = summarize(RECORDS[:2], 1.0)
    slow = summarize(RECORDS[2:4], 1.0)
    compared = ratios(fast, slow, ["ttft_p50_s", "errors", "hit_rate"])
    assert compared["ttft_p50_s"] == pytest.approx(0.15 / 0.35)
    assert compared["errors"] is None  # 0 / 0
    assert compared["hit_rate"] == pytest.approx((100 / 200) / (250 / 400))
    assert ratio(1.0, 0) is None and ratio(None, 2.0) is None and ratio(3.0, 2.0) == 1.5


def test_summaries_by_tag() -> None:
    groups = summarize_by(RECORDS, 2.0, by_tag("tenant"))
    assert list(groups) == ["t0", "t1"]
    assert groups["t0"].ok == 2 and groups["t0"].ttft_p50_s == pytest.approx(0.15)


def _spec() -> RequestSpec:
    return RequestSpec("s1", 4, prompt_token_ids=(1, 2), session_id="sess", tags=(("k", "v"),))


def test_stream_state_turns_sse_chunks_into_a_record() -> None:
    state = StreamState(start=10.0)
    chunks = [
        b": keep-alive\n\n",
        b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}], "usage": null}\n',
        b"\n",
        b'data: {"choices": [{"index": 0, "delta": {"content": "He"}}]}\n\n',
        b'data: {"choices": [{"index": 0, "text": "llo"}]}\r\n\r\n',
        b'data: {"choices": [{"index": 0, "delta": {"content": "!"}}]}\n\ndata: {"choices": [], "usage": ',
        b'{"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}}\n\n',
    ]
    times = [10.05, 10.1, 10.1, 10.2, 10.25, 10.4, 10.45]
    assert not any(state.feed(chunk, now) for chunk, now in zip(chunks, times, strict=True))
    assert state.feed(b"data: [DONE]\n\n", 10.5)
    state.status = 200
    state.settle()
    record = state.record(_spec(), run_start=9.0, end=10.5, scheduled_s=0.9)
    assert record.outcome == "ok" and record.start_s == pytest.approx(1.0)
    assert record.ttft_s == pytest.approx(0.2)  # the first chunk with content, not the role chunk
    assert record.itl_s == pytest.approx((0.05, 0.15))
    assert record.e2e_s == pytest.approx(0.5)
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (12, 3, 8)
    assert (record.session_id, record.tags, record.scheduled_s) == ("sess", (("k", "v"),), 0.9)


def test_stream_state_errors() -> None:
    unfinished = StreamState(start=0.0)
    unfinished.feed(b'data: {"choices": [{"text": "x"}]}\n\n', 0.1)
    unfinished.settle()
    assert unfinished.outcome == "error" and "[DONE]" in (unfinished.error or "")
    failed = StreamState(start=0.0)
    assert failed.feed(b'data: {"error": {"message": "overloaded", "code": 503}}\n\n', 0.1)
    failed.settle()
    assert failed.outcome == "error" and "overloaded" in (failed.error or "")
    with pytest.raises(ValueError):
        StreamState(start=0.0).feed(b"data: {not json\n\n", 0.1)
    cut = StreamState(start=0.0)  # a body that ends without the last blank line
    assert not cut.feed(b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n', 0.1)
    cut.end(0.2)
    cut.settle()
    assert cut.outcome == "ok" and cut.chunk_times == [0.1]


def test_replicas_per_group_counts_distinct_replicas_per_tenant_else_session() -> None:
    records = [
        _ok("a", 0.1, 1.0, "r0", tags=(("tenant", "t0"),), session_id="t0-u0"),
        _ok("b", 0.1, 1.0, "r1", tags=(("tenant", "t0"),), session_id="t0-u1"),
        _ok("c", 0.1, 1.0, "r1", tags=(("tenant", "t0"),), session_id="t0-u1"),
        _ok("d", 0.1, 1.0, "r2", session_id="chat-7"),  # no tenant tag: grouped by session
        _ok("e", 0.1, 1.0, "r2", session_id="chat-7"),
        RequestRecord("f", "timeout", start_s=0.6, error="slow", session_id="chat-8"),  # no replica
    ]
    assert replicas_per_group(records) == (2 + 1) / 2
    assert replicas_per_group([_ok("g", 0.1, 1.0, "r0")]) is None  # neither tag nor session


def test_send_lag_measures_how_far_the_open_loop_client_fell_behind() -> None:
    # Scheduled every 0.1 s; the client sent the last five 0.2-1.0 s late.
    records = [
        RequestRecord(f"r{i}", "ok", start_s=0.1 * i + (0.2 * (i - 4) if i > 4 else 0.0), scheduled_s=0.1 * i)
        for i in range(10)
    ]
    lag = send_lag(records)
    assert lag is not None
    assert lag.max_s == pytest.approx(1.0)
    assert lag.p90_s == pytest.approx(0.82)  # between the 9th (0.8) and the 10th (1.0)
    assert lag.scheduled_rate_per_s == pytest.approx(10.0)
    assert lag.sent_rate_per_s == pytest.approx(9 / 1.9)
    # the figures only: whether that is behind is loadtests/client_lag.py's rule (test_client_lag.py)
    schedule = [RequestRecord(f"r{i}", "ok", start_s=0.1 * i, scheduled_s=0.1 * i) for i in range(10)]
    on_time = send_lag(schedule)
    assert on_time is not None and on_time.max_s == 0.0 and on_time.p90_s == 0.0
    assert on_time.sent_rate_per_s == pytest.approx(on_time.scheduled_rate_per_s)
    assert send_lag(RECORDS) is None  # closed loop: no schedule
