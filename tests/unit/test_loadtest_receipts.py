"""The load test's router names for the no-events mode, and kvlb's receipts read from /metrics."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from balancer.metrics import Metrics
from loadtests.peers import parse_router
from loadtests.runs import receipt_figures


def test_no_events_routers() -> None:
    plain = parse_router("kvlb_no_events")
    assert (plain.kind, plain.policy, plain.kv_events) == ("kvlb", "cost", False)
    tuned = parse_router("kvlb:cost+decode_weight=0.1~no_events")
    assert (tuned.policy, tuned.weights, tuned.kv_events) == ("cost", (("decode_weight", 0.1),), False)
    assert parse_router("round_robin~no_events").policy == "round_robin"
    assert parse_router("kvlb").kv_events
    with pytest.raises(ValueError, match="kvlb routers only"):
        parse_router("sglang_cache_aware~no_events")


def test_receipt_figures_sum_over_replicas() -> None:
    metrics = Metrics.create(CollectorRegistry())
    for replica, exact, within in (("a", 8, 9), ("b", 0, 1)):
        metrics.receipts_total.labels(replica).inc(10 if replica == "a" else 2)
        metrics.receipts_exact_total.labels(replica).inc(exact)
        metrics.receipts_within_block_total.labels(replica).inc(within)
    metrics.index_receipt_drops_blocks_total.labels("a").inc(3)
    figures = receipt_figures(generate_latest(metrics.registry).decode())
    assert figures["receipts"] == 12 and figures["exact"] == 8 and figures["within_one_block"] == 10
    assert figures["exact_share"] == pytest.approx(8 / 12)
    assert figures["within_one_block_share"] == pytest.approx(10 / 12)
    assert (figures["dropped_blocks"], figures["learned_blocks"]) == (3, 0)
    assert receipt_figures("")["exact_share"] is None
