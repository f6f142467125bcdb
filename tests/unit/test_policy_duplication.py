"""The cost policy's duplication charge: cache pressure from held blocks and pool size, the charge
per block a replica would insert into its cache, and where it is (not) applied."""

from __future__ import annotations

import pytest
from policy_cases import route, terms_of

from balancer.load.tracker import ReplicaLoad
from balancer.policy.cost import PRESSURE_FULL_FILL, PRESSURE_START_FILL, cache_pressure
from balancer.types import ReplicaId

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
POOL = 100.0  # blocks


@pytest.mark.parametrize(
    ("held", "capacity", "expected"),
    [
        (0, 100.0, 0.0),
        (25, 100.0, 0.0),  # at the start of the ramp
        (50, 100.0, 0.5),
        (75, 100.0, 1.0),  # full from three quarters
        (130, 100.0, 1.0),  # index ahead of the pool (stale events): clamped
        (10, None, None),
        (None, 100.0, None),
        (10, 0.0, None),
    ],
)
def test_cache_pressure_ramps_from_a_quarter_to_three_quarters_full(
    held: int | None, capacity: float | None, expected: float | None
) -> None:
    assert (PRESSURE_START_FILL, PRESSURE_FULL_FILL) == (0.25, 0.75)
    got = cache_pressure(held, capacity)
    assert got == (None if expected is None else pytest.approx(expected))


def test_a_full_replica_pays_for_copying_a_prefix_held_elsewhere() -> None:
    # A holds 8 of 10 blocks with 12 blocks of prefill queued; B is idle and holds none of it. Both
    # are full. Without the charge B wins (10 < 12 + 2); with it each pays for what it would insert
    # (A 2 blocks, B 10): 14 + 2 = 16 < 10 + 10.
    loads = [
        ReplicaLoad(A, pending_prefill_blocks=12.0, capacity_blocks=POOL),
        ReplicaLoad(B, capacity_blocks=POOL),
    ]
    held = {A: 95, B: 95}
    assert route({A: 8, B: 0}, loads, held=held, duplication_weight=0.0).replica == B
    decision = route({A: 8, B: 0}, loads, held=held)
    terms = terms_of(decision)
    assert decision.replica == A
    assert terms[B].duplication_term == pytest.approx(10.0)
    assert terms[B].cache_pressure == pytest.approx(1.0)
    assert terms[B].cost == pytest.approx(10.0 + 0.1 * 0 + 10.0)
    assert terms[A].duplication_term == pytest.approx(2.0)  # only its missing blocks


def test_a_replica_with_room_copies_for_free() -> None:
    loads = [ReplicaLoad(A, pending_prefill_blocks=12.0), ReplicaLoad(B, capacity_blocks=POOL)]
    decision = route({A: 8, B: 0}, loads, held={A: 95, B: 20})
    assert decision.replica == B
    assert terms_of(decision)[B].duplication_term == 0.0
    assert terms_of(decision)[B].cache_pressure == 0.0


def test_a_new_context_goes_to_the_cache_with_room_not_to_the_slightly_less_loaded_full_one() -> None:
    # Nobody holds the prompt. B has 3 blocks less queued but a full cache, where the 10 new
    # blocks would push out contexts its own requests reuse; C is half full.
    loads = [
        ReplicaLoad(B, pending_prefill_blocks=0.0, capacity_blocks=POOL),
        ReplicaLoad(C, pending_prefill_blocks=3.0, capacity_blocks=POOL),
    ]
    assert route({B: 0, C: 0}, loads, held={B: 90, C: 50}, duplication_weight=0.0).replica == B
    decision = route({B: 0, C: 0}, loads, held={B: 90, C: 50})
    terms = terms_of(decision)
    assert decision.replica == C
    assert terms[B].duplication_term == pytest.approx(10.0)
    assert terms[C].duplication_term == pytest.approx(0.5 * 10)


def test_charge_scales_with_pressure_weight_and_inserted_blocks() -> None:
    loads = [ReplicaLoad(r, capacity_blocks=POOL) for r in (A, B, C)]
    decision = route(
        {A: 8, B: 3, C: 0}, loads, held={A: 40, B: 50, C: 62}, duplication_weight=2.0, prefill_weight=0.5
    )
    terms = terms_of(decision)
    assert terms[A].duplication_term == pytest.approx(0.5 * 2.0 * 0.3 * (10 - 8))
    assert terms[B].duplication_term == pytest.approx(0.5 * 2.0 * 0.5 * (10 - 3))
    assert terms[C].duplication_term == pytest.approx(0.5 * 2.0 * 0.74 * 10)


def test_equally_full_replicas_keep_the_ranking_of_credit_two() -> None:
    # At equal pressure 1 the charge adds w_dup per missing block everywhere: a replica's cost is
    # then its load plus twice its missing blocks, as with overlap_credit 2 and no charge.
    loads = [
        ReplicaLoad(r, pending_prefill_blocks=float(q), capacity_blocks=POOL)
        for r, q in ((A, 14), (B, 0), (C, 5))
    ]
    held = {A: 90, B: 90, C: 90}
    overlaps = {A: 8, B: 0, C: 3}
    charged = terms_of(route(overlaps, loads, held=held))
    credit2 = terms_of(route(overlaps, loads, held=held, duplication_weight=0.0, overlap_credit=2.0))
    spread = {r: charged[r].cost - credit2[r].cost for r in (A, B, C)}
    assert spread[A] == pytest.approx(spread[B]) and spread[B] == pytest.approx(spread[C])


def test_unknown_pool_size_or_holdings_mean_no_charge() -> None:
    loads = [ReplicaLoad(A, pending_prefill_blocks=12.0), ReplicaLoad(B)]  # B never scraped
    decision = route({A: 8, B: 0}, loads, held={A: 95, B: 95})
    assert decision.replica == B
    assert terms_of(decision)[B].cache_pressure is None
    assert terms_of(decision)[B].duplication_term == 0.0


def test_a_holder_without_credit_pays_as_if_it_held_nothing() -> None:
    # The imbalance guard withdraws A's credit: the charge must not hand the affinity back.
    loads = [
        ReplicaLoad(A, pending_prefill_blocks=50.0, capacity_blocks=POOL),
        ReplicaLoad(B, capacity_blocks=POOL),
    ]
    decision = route({A: 8, B: 0}, loads, held={A: 95, B: 95}, imbalance_threshold_blocks=20.0)
    terms = terms_of(decision)
    assert decision.replica == B
    assert terms[A].duplication_term == pytest.approx(10.0)
    assert terms[B].duplication_term == pytest.approx(10.0)


def test_an_excluded_holder_still_shows_its_charge() -> None:
    loads = [ReplicaLoad(A, kv_usage=0.99, capacity_blocks=POOL), ReplicaLoad(B, capacity_blocks=POOL)]
    decision = route({A: 8, B: 0}, loads, held={A: 95, B: 95}, kv_usage_ceiling=0.95)
    terms = terms_of(decision)
    assert decision.replica == B
    assert terms[A].excluded is not None
    assert terms[A].duplication_term == pytest.approx(2.0)
    assert terms[B].duplication_term == pytest.approx(10.0)
