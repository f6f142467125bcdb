"""Counters read 0 from a replica's registration on, and the known label sets cover what the code counts.

``prometheus_client`` gives a labelled counter no sample until ``labels(...)`` is called, so "no decode
errors yet" would read as "no data". :meth:`balancer.metrics.Metrics.init_replica` creates every known
label set at 0; the sets are checked here against the reasons and outcomes the code actually uses.
"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import generate_latest

import balancer
from balancer.metrics import (
    APPLIED_OUTCOMES,
    DECODE_ERROR_REASONS,
    REPLAY_OUTCOMES,
    REPLAY_POLL_OUTCOMES,
    RESYNC_REASONS,
    Metrics,
)

SOURCES = sorted(Path(balancer.__file__).resolve().parent.rglob("*.py"))


def exported(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_a_registered_replica_has_every_counter_at_zero() -> None:
    metrics = Metrics.create()
    assert 'kvlb_events_decode_errors_total{engine="vllm"' not in exported(metrics)  # no sample yet
    metrics.init_replica("r0", "vllm", replays=True)
    metrics.init_replica("t0", "trtllm", replays=False)
    text = exported(metrics)
    for reason in DECODE_ERROR_REASONS:
        assert f'kvlb_events_decode_errors_total{{engine="vllm",reason="{reason}"}} 0.0' in text
        assert f'kvlb_events_decode_errors_total{{engine="trtllm",reason="{reason}"}} 0.0' in text
    for kind, status in APPLIED_OUTCOMES:
        assert f'kvlb_events_applied_total{{engine="vllm",status="{status}",type="{kind}"}} 0.0' in text
    for name in (
        "events_seq_gaps", "events_queue_overflow", "events_oversize", "events_disconnects",
        "scrape_errors", "route_predicted_cached_tokens", "route_reported_cached_tokens",
    ):  # fmt: skip
        assert f'kvlb_{name}_total{{replica="r0"}} 0.0' in text
    for reason in RESYNC_REASONS:
        assert f'kvlb_events_resyncs_total{{reason="{reason}",replica="r0"}} 0.0' in text
    assert 'kvlb_events_shed_total{replica="r0"} 0.0' in text  # a ZMQ source sheds, a TRT-LLM drain waits
    assert 'kvlb_events_shed_total{replica="t0"}' not in text
    for outcome in REPLAY_OUTCOMES:
        assert f'kvlb_events_replays_total{{outcome="{outcome}",replica="r0"}} 0.0' in text
        assert (
            f'kvlb_events_replays_total{{outcome="{outcome}",replica="t0"}}' not in text
        )  # no replay socket


def test_init_keeps_counts_already_made() -> None:
    metrics = Metrics.create()
    metrics.events_decode_errors_total.labels("sglang", "frame").inc(3)
    metrics.init_replica("r0", "sglang", replays=True)
    assert 'kvlb_events_decode_errors_total{engine="sglang",reason="frame"} 3.0' in exported(metrics)


def test_the_known_decode_error_reasons_cover_every_reason_in_the_code() -> None:
    used = {
        match
        for path in SOURCES
        for match in re.findall(r'EventDecodeError\(\s*"([a-z_]+)"', path.read_text(encoding="utf-8"))
    }
    assert used and used <= set(DECODE_ERROR_REASONS)


def test_the_known_replay_outcomes_cover_the_subscriber() -> None:
    text = (Path(balancer.__file__).resolve().parent / "sources" / "zmq_sub.py").read_text(encoding="utf-8")
    polls = set(
        re.findall(r'"([a-z_]+)" if found else \("([a-z_]+)" if complete else "([a-z_]+)"\)', text)[0]
    )
    assigned = set(re.findall(r'outcome = "([a-z_]+)"', text))
    assert polls == set(REPLAY_POLL_OUTCOMES)
    assert assigned | polls == set(REPLAY_OUTCOMES) | set(REPLAY_POLL_OUTCOMES)
