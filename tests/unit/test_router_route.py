"""PoolRouter.route: candidates (health, the in-flight cap), plan and commitment as one lease."""

from __future__ import annotations

import pytest

from balancer.errors import NoReplicasAvailable, Overloaded
from balancer.events import Stored
from balancer.health.book import HealthBook
from balancer.index.hashing import pack_tokens
from balancer.policy.base import PolicyWeights
from balancer.policy.registry import make_policy
from balancer.routing.router import PoolRequest, PoolRouter, RouteLimits
from balancer.types import EngineHash, ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")
PROMPT = list(range(1000, 1000 + 130))  # 8 full blocks of 16


def stored(tokens: list[int], block_size: int = 16) -> Stored:
    count = len(tokens) // block_size
    return Stored(
        dp_rank=0,
        parent=None,
        engine_hashes=tuple(EngineHash(1 + i) for i in range(count)),
        tokens=pack_tokens(tokens[: count * block_size]),
        block_size=block_size,
    )


def pool(cap: int = 2, health: HealthBook | None = None) -> PoolRouter:
    if health is None:
        health = HealthBook()
        for replica in (A, B):
            health.add(replica, probe_ok=True)
    limits = RouteLimits(max_inflight_per_replica=cap, speculative_ttl_s=2.0, pending_ttl_s=10.0)
    router = PoolRouter("m", health=health, route_limits=limits)
    router.add_replica(A, 16, "plain")
    router.add_replica(B, 16, "plain")
    return router


def request(request_id: str = "r", exclude: frozenset[ReplicaId] = frozenset()) -> PoolRequest:
    return PoolRequest(PROMPT, make_policy("cost"), PolicyWeights(), request_id, exclude=exclude)


def test_route_commits_and_the_lease_releases_once() -> None:
    router = pool()
    router.space_of[B].table.apply(B, [stored(PROMPT)], now=0.0)
    lease = router.route(request(), now=1.0)
    assert lease.replica == B and lease.plan.cached_tokens == 8 * 16
    assert (router.in_flight(A), router.in_flight(B)) == (0, 1)
    assert router.tracker().snapshot(1.0).of(B).pending_prefill_seqs == 1
    lease.first_token(now=1.5)
    assert router.tracker().snapshot(1.5).of(B).active_decode_seqs == 1
    assert lease.release(now=2.0) and not lease.release(now=2.1)
    assert router.in_flight(B) == 0 and lease.released


def test_select_commits_nothing() -> None:
    router = pool()
    plan = router.select(request(), now=1.0)
    assert plan.decision.replica in (A, B)
    assert router.in_flight(A) == router.in_flight(B) == 0
    assert router.space_of[A].table.stats().speculative_entries == 0


def test_a_lease_adds_speculative_entries_that_the_next_request_finds() -> None:
    router = pool()
    first = router.route(request("one"), now=1.0)
    second = router.select(request("two"), now=1.1)
    assert second.decision.replica == first.replica
    assert second.cached_tokens == 8 * 16


def test_leases_of_a_reused_request_id_are_tracked_apart() -> None:
    router = pool(cap=8)
    leases = [router.route(request("same"), now=1.0) for _ in range(3)]
    assert len({lease.tracking_id for lease in leases}) == 3
    assert router.in_flight(A) + router.in_flight(B) == 3
    leases[0].release(now=2.0)
    assert router.in_flight(A) + router.in_flight(B) == 2


def test_the_in_flight_cap_excludes_a_full_replica_then_refuses() -> None:
    router = pool(cap=1)
    router.space_of[B].table.apply(B, [stored(PROMPT)], now=0.0)
    first = router.route(request("1"), now=1.0)
    assert first.replica == B
    assert router.candidates(now=1.0) == [A]
    assert router.has_free_slot(now=1.0)
    second = router.route(request("2"), now=1.0)  # B holds the prefix but is full
    assert second.replica == A
    assert not router.has_free_slot(now=1.0)
    with pytest.raises(Overloaded) as refused:
        router.route(request("3"), now=1.0)
    assert refused.value.retry_after_s == 1.0
    first.release(now=2.0)
    assert router.candidates(now=2.0) == [B]


def test_health_and_exclusion_decide_the_candidates() -> None:
    health = HealthBook()
    health.add(A, probe_ok=True)
    health.add(B, probe_ok=False)  # never probed live: not routable
    router = pool(health=health)
    assert router.routable(now=0.0) == [A]
    assert router.route(request(), now=0.0).replica == A
    with pytest.raises(NoReplicasAvailable):
        router.route(request(exclude=frozenset({A})), now=0.0)
    health.set_draining(A, True)
    assert router.has_free_slot(now=0.0)  # nothing routable: waiting for a slot would not help
    with pytest.raises(NoReplicasAvailable):
        router.candidates(now=0.0)


def test_routing_to_a_half_open_replica_is_its_one_trial() -> None:
    health = HealthBook()
    health.add(A, probe_ok=True)
    router = PoolRouter("m", health=health)
    router.add_replica(A, 16, "plain")
    for _ in range(health.config.failure_threshold):
        health.on_failure(A, now=0.0, error="boom")
    half_open_at = health.config.open_s + 0.1
    assert router.routable(now=half_open_at) == [A]
    router.route(request(), now=half_open_at)
    assert router.routable(now=half_open_at) == []  # the trial is in flight


def test_without_a_health_book_every_registered_replica_is_routable() -> None:
    router = PoolRouter("m")
    router.add_replica(A, 16, "plain")
    router.add_replica(B, 32, "plain")
    assert router.routable(now=0.0) == [A, B]
    router.remove_replica(B)
    assert router.candidates(now=0.0) == [A]


def test_an_n_request_counts_its_sequences_in_the_cap_and_the_baselines_load() -> None:
    """An ``n = 8`` request is 8 sequences in the engine's batch: with a cap of 8 it fills a replica
    (the next request goes elsewhere, then waits), and ``least_load`` sees 8 there, not 1."""
    router = pool(cap=8)
    eight = PoolRequest(PROMPT, make_policy("cost"), PolicyWeights(), "eight", sequences=8)
    lease = router.route(eight, now=1.0)
    full = lease.replica
    other = B if full == A else A
    assert router.in_flight(full) == 8 and router.in_flight_total(full) == 8
    assert router.tracker().snapshot(1.0).of(full).pending_prefill_seqs == 8
    assert router.candidates(1.0) == [other]
    lease.first_token(now=1.1)
    assert router.tracker().snapshot(1.1).of(full).active_decode_seqs == 8
    ones = [PoolRequest(PROMPT, make_policy("least_load"), PolicyWeights(), f"one-{i}") for i in range(7)]
    assert {router.route(one, now=1.2).replica for one in ones} == {other}  # 7 of 8 taken on the other
    assert router.tracker().snapshot(1.2).of(other).seq_load == 7
    last = PoolRequest(PROMPT, make_policy("least_load"), PolicyWeights(), "one-7", sequences=2)
    assert router.route(last, now=1.3).replica == other  # under the cap: it may go n - 1 over
    with pytest.raises(Overloaded, match="sequences in flight"):
        router.route(PoolRequest(PROMPT, make_policy("least_load"), PolicyWeights(), "more"), now=1.4)
    assert lease.release(now=1.5)
    assert router.in_flight(full) == 0 and router.candidates(1.5) == [full]
