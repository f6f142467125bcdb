"""The request path's metric handles (``Metrics.children``) export what ``prometheus_client``'s own
``labels(...).inc/set/observe`` export for the same updates: the same ``/metrics`` text, sample for
sample (the ``_created`` timestamps apart), for every collector the request path updates."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from balancer.metrics import CounterHandle, GaugeHandle, HistogramHandle, Metrics

REPLICAS = ("up-0", "up-1", "up-2")
POLICIES = ("cost", "round_robin")

# (field of Metrics, label values drawn per update): every collector updated through ``children``.
LABELS: dict[str, tuple[tuple[str, ...], ...]] = {
    "requests_total": (
        ("/v1/chat/completions", "/v1/completions"),
        ("200", "429", "stream_error"),
        REPLICAS,
        POLICIES,
    ),
    "route_decision_seconds": (),
    "route_decisions_total": (POLICIES, REPLICAS),
    "predicted_cached_tokens_total": (REPLICAS,),
    "reported_cached_tokens_total": (REPLICAS,),
    "ttft_seconds": (REPLICAS, POLICIES),
    "e2e_seconds": (REPLICAS, POLICIES),
    "prediction_error_blocks": (REPLICAS,),
    "receipts_total": (REPLICAS,),
    "receipts_exact_total": (REPLICAS,),
    "receipts_within_block_total": (REPLICAS,),
    "receipt_stale_blocks_total": (REPLICAS,),
    "index_receipt_drops_blocks_total": (REPLICAS,),
    "index_receipt_learned_blocks_total": (REPLICAS,),
    "index_receipt_taught_blocks_total": (REPLICAS,),
    "index_receipt_confirmed_blocks_total": (REPLICAS,),
    "prediction_accuracy_ratio": (REPLICAS,),
    "console_series_overflow_total": (("ttft",),),
}

# Values on, next to and between every bucket bound of the request path's histograms, and beyond.
_BOUNDS = sorted(
    {
        bound
        for name in ("ttft_seconds", "route_decision_seconds", "prediction_error_blocks")
        for bound in getattr(Metrics.create(), name)._upper_bounds
        if math.isfinite(bound)
    }
)
EDGES = [v for b in _BOUNDS for v in (b, math.nextafter(b, -math.inf), math.nextafter(b, math.inf))]
VALUES = st.one_of(
    st.sampled_from(EDGES),
    st.integers(-600, 9000),
    st.floats(-1e4, 1e4, allow_nan=False),
    st.sampled_from([0, 0.0, -0.0, math.inf, -math.inf, math.nan]),
)
UPDATES = st.lists(st.tuples(st.sampled_from(sorted(LABELS)), st.integers(0, 10**6), VALUES), max_size=120)


def exported(registry: CollectorRegistry) -> str:
    """The registry's text, ``_created`` samples (creation timestamps) and the process's own
    figures (CPU, memory) left out."""
    lines = generate_latest(registry).decode().splitlines()
    return "\n".join(line for line in lines if "_created" not in line and "kvlb_process_" not in line)


def apply(metrics: Metrics, name: str, pick: int, value: float, *, handles: bool) -> None:
    """One update of ``name``'s child picked by ``pick``: through ``children`` (the handles) or
    through ``prometheus_client``'s ``labels()`` (the reference)."""
    collector = getattr(metrics, name)
    values = tuple(options[pick % len(options)] for options in LABELS[name])
    target = (
        metrics.children.of(collector, *values)
        if handles
        else (collector.labels(*values) if values else collector)
    )
    if isinstance(collector, Histogram):
        target.observe(value)
    elif isinstance(collector, Gauge):
        target.set(value)
    else:
        assert isinstance(collector, Counter)
        if value < 0 or math.isnan(value):
            with pytest.raises(ValueError):
                target.inc(-1 if math.isnan(value) else value)
        else:
            target.inc(value)


@settings(max_examples=300, deadline=None)
@given(UPDATES)
def test_handles_export_what_prometheus_client_exports(updates: list[tuple[str, int, float]]) -> None:
    mine, reference = Metrics.create(), Metrics.create()
    for name, pick, value in updates:
        apply(mine, name, pick, value, handles=True)
        apply(reference, name, pick, value, handles=False)
    assert exported(mine.registry) == exported(reference.registry)


def test_a_request_paths_updates_match_line_for_line() -> None:
    """A long random run (2,000 requests' worth) with integer and float values, as dispatch makes them."""
    rng = random.Random(7)
    mine, reference = Metrics.create(), Metrics.create()
    for _ in range(2000 * len(LABELS) // 4):
        name, pick = rng.choice(sorted(LABELS)), rng.randrange(10**6)
        value = rng.choice([rng.random() * 0.2, rng.randint(-600, 600), rng.choice(EDGES)])
        for metrics, handles in ((mine, True), (reference, False)):
            apply(
                metrics,
                name,
                pick,
                value if name.endswith(("seconds", "blocks", "ratio")) else abs(value),
                handles=handles,
            )
    text = exported(mine.registry)
    assert text == exported(reference.registry)
    assert "kvlb_route_decision_seconds_count" in text and "kvlb_http_requests_total{" in text


def test_handle_types_and_memo() -> None:
    metrics = Metrics.create()
    of = metrics.children.of
    assert isinstance(of(metrics.receipts_total, "a"), CounterHandle)
    assert isinstance(of(metrics.prediction_accuracy_ratio, "a"), GaugeHandle)
    assert isinstance(of(metrics.ttft_seconds, "a", "cost"), HistogramHandle)
    assert isinstance(of(metrics.route_decision_seconds), HistogramHandle)
    assert of(metrics.receipts_total, "a") is of(metrics.receipts_total, "a")


def test_a_handle_updates_the_registrys_child() -> None:
    """What a handle adds is what the registry reads (not a copy): the same child ``labels()`` returns."""
    registry = CollectorRegistry()
    metrics = Metrics.create(registry)
    metrics.children.of(metrics.receipts_total, "a").inc(3)
    metrics.receipts_total.labels("a").inc(2)
    metrics.children.of(metrics.receipts_total, "a").inc()
    assert registry.get_sample_value("kvlb_route_receipts_total", {"replica": "a"}) == 6.0
    metrics.children.of(metrics.route_decision_seconds).observe(0.0001)
    assert registry.get_sample_value("kvlb_route_decision_seconds_bucket", {"le": "0.0001"}) == 1.0
    assert registry.get_sample_value("kvlb_route_decision_seconds_bucket", {"le": "5e-05"}) == 0.0
