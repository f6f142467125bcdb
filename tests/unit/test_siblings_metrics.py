"""``merge_metrics``: several workers' Prometheus text as one exposition, each sample labelled."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from balancer.api.siblings import merge_metrics


def worker_text(requests: int, inflight: float) -> str:
    registry = CollectorRegistry()
    Counter("kvlb_http_requests", "Requests.", ["status"], registry=registry).labels("200").inc(requests)
    Gauge("kvlb_inflight_requests", "In flight.", registry=registry).set(inflight)
    Histogram("kvlb_route_decision_seconds", "Decisions.", registry=registry).observe(0.001)
    return generate_latest(registry).decode()


def test_every_sample_is_labelled_with_its_worker_and_parses_back() -> None:
    merged = merge_metrics({0: worker_text(3, 1), 1: worker_text(5, 2)})
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    requests = {
        s.labels["worker"]: s.value
        for s in families["kvlb_http_requests"].samples
        if s.name.endswith("_total")
    }
    assert requests == {"0": 3.0, "1": 5.0}
    assert families["kvlb_http_requests"].type == "counter"
    inflight = {s.labels["worker"]: s.value for s in families["kvlb_inflight_requests"].samples}
    assert inflight == {"0": 1.0, "1": 2.0}
    buckets = [s for s in families["kvlb_route_decision_seconds"].samples if s.name.endswith("_count")]
    assert sorted(s.labels["worker"] for s in buckets) == ["0", "1"]
    assert merged.count("# TYPE kvlb_http_requests_total counter") == 1
