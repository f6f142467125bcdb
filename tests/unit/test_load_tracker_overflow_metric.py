"""The load tracker's cap (``LoadConfig.max_tracked_requests``) has an overflow metric: the
reservations it dropped were counted only in ``LoadTracker.stats()``, which nothing exported."""

from __future__ import annotations

from balancer.load.tracker import LoadConfig, LoadTracker
from balancer.metrics import Metrics
from balancer.types import ReplicaId


def test_reservations_dropped_at_the_cap_are_exported() -> None:
    tracker = LoadTracker(LoadConfig(max_tracked_requests=2))
    metrics = Metrics.create()
    metrics.load_trackers.source = lambda: {"m": tracker.stats()}
    for number in range(5):
        assert tracker.reserve(f"request-{number}", ReplicaId("r0"), 100, 4, now=float(number))
    sample = metrics.registry.get_sample_value
    assert sample("kvlb_load_tracker_overflow_total", {"pool": "m"}) == 3
    assert sample("kvlb_load_tracker_requests", {"pool": "m"}) == 2
    assert sample("kvlb_load_tracker_expired_total", {"pool": "m"}) == 0
