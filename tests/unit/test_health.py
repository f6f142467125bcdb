"""Circuit breaker and routable-set rules."""

from __future__ import annotations

from balancer.health.book import BreakerConfig, HealthBook
from balancer.types import ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")


def book() -> HealthBook:
    hb = HealthBook(BreakerConfig(failure_threshold=2, open_s=5.0))
    hb.add(A, probe_ok=True)
    hb.add(B, probe_ok=True)
    return hb


def test_new_replica_waits_for_probe() -> None:
    hb = HealthBook()
    hb.add(A)
    assert hb.routable(0.0) == []
    hb.on_probe(A, True, 0.0)
    assert hb.routable(0.0) == [A]


def test_breaker_opens_half_opens_and_closes() -> None:
    hb = book()
    hb.on_failure(A, 1.0, "connect")
    assert hb.routable(1.0) == [A, B]  # one failure is below the threshold
    hb.on_failure(A, 2.0, "connect")
    assert hb.routable(2.0) == [B]  # open
    assert hb.routable(6.9) == [B]
    assert hb.routable(7.0) == [A, B]  # half-open: one trial
    hb.on_routed(A, 7.0)
    assert hb.routable(7.1) == [B]  # the trial is in flight
    hb.on_success(A)
    assert hb.routable(7.2) == [A, B]


def test_failed_trial_reopens() -> None:
    hb = book()
    hb.on_failure(A, 0.0, "x")
    hb.on_failure(A, 0.0, "x")
    hb.on_routed(A, 5.0)
    hb.on_failure(A, 5.5, "x")
    assert hb.routable(6.0) == [B]
    assert hb.routable(10.5) == [A, B]


def test_probe_failure_and_draining() -> None:
    hb = book()
    hb.on_probe(A, False, 1.0, "503")
    assert hb.routable(1.0) == [B]
    hb.on_probe(A, True, 2.0)
    assert hb.routable(2.0) == [A, B]
    assert hb.set_draining(B, True)
    assert hb.routable(2.0) == [A]
    assert not hb.set_draining(ReplicaId("zzz"), True)
    assert hb.routable(2.0, among=[B, A]) == [A]
