"""The cost policy's interference charge: ``w_prefill · w_int · decoding_r · inserted_r``, the price
of prefill that runs in the forward steps of a replica's decoding requests (docs/policy-studies.md,
Part 7)."""

from __future__ import annotations

from functools import partial

import pytest
from policy_cases import route as route_cost
from policy_cases import terms_of

from balancer.errors import ConfigError
from balancer.load.tracker import ReplicaLoad
from balancer.policy import PolicyWeights
from balancer.service.decisions import terms_by_replica
from balancer.types import ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")
route = partial(route_cost, request_blocks=40)


def session_home(decoding: int) -> list[ReplicaLoad]:
    """A holds 30 of the 40 blocks (a chat session's history) with 45 blocks of prefill queued;
    B holds none and has no prefill queued. Both have ``decoding`` requests decoding."""
    return [
        ReplicaLoad(A, pending_prefill_blocks=45.0, active_decode_seqs=decoding),
        ReplicaLoad(B, active_decode_seqs=decoding),
    ]


def test_without_it_a_short_queue_at_home_sends_the_session_away() -> None:
    # A: 45 + 40 − 30 = 55; B: 0 + 40 = 40. Credit 1 moves the session for a 45-block queue.
    assert PolicyWeights().interference_weight == 0.04  # the default (docs/policy-studies.md, Part 7)
    decision = route({A: 30, B: 0}, session_home(decoding=100), interference_weight=0.0)
    assert decision.replica == B
    assert all(t.interference_term == 0.0 for t in decision.terms)


def test_a_busy_decode_batch_keeps_the_session_home() -> None:
    # w 0.04, 100 decoding on each: A pays 0.04·100·10 = 40 more (55 + 40 = 95),
    # B 0.04·100·40 = 160 more (40 + 160 = 200): the copy is priced at 5 blocks per block.
    decision = route({A: 30, B: 0}, session_home(decoding=100), interference_weight=0.04)
    terms = terms_of(decision)
    assert decision.replica == A
    assert terms[A].interference_term == pytest.approx(40.0)
    assert terms[B].interference_term == pytest.approx(160.0)
    assert terms[A].cost == pytest.approx(55.0 + 40.0)
    assert terms[B].cost == pytest.approx(40.0 + 160.0)
    assert terms_by_replica(decision.terms)[B]["interference_term"] == pytest.approx(160.0)


def test_an_idle_fleet_is_priced_as_without_the_charge() -> None:
    # No decode batch anywhere: the charge is 0 and credit 1's choice stands.
    decision = route({A: 30, B: 0}, session_home(decoding=0), interference_weight=0.04)
    assert decision.replica == B
    assert all(t.interference_term == 0.0 for t in decision.terms)


def test_new_work_goes_where_fewer_requests_decode() -> None:
    # Nobody holds the prompt; equal prefill queues; B decodes 10 requests, A 50.
    loads = [ReplicaLoad(A, active_decode_seqs=50), ReplicaLoad(B, active_decode_seqs=10)]
    decision = route({A: 0, B: 0}, loads, interference_weight=0.01)
    terms = terms_of(decision)
    assert decision.replica == B
    assert terms[A].interference_term == pytest.approx(0.01 * 50 * 40)
    assert terms[B].interference_term == pytest.approx(0.01 * 10 * 40)


def test_scaled_by_prefill_weight_and_counts_every_block_without_credit() -> None:
    # The imbalance guard withdraws A's credit: A would insert all 40 blocks.
    loads = [ReplicaLoad(A, pending_prefill_blocks=500.0, active_decode_seqs=5), ReplicaLoad(B)]
    decision = route(
        {A: 30, B: 0}, loads, interference_weight=0.1, prefill_weight=0.5, imbalance_threshold_blocks=100.0
    )
    assert terms_of(decision)[A].interference_term == pytest.approx(0.5 * 0.1 * 5 * 40)


@pytest.mark.parametrize("value", [-0.01, 1.5])
def test_range_is_checked(value: float) -> None:
    with pytest.raises(ConfigError, match="interference_weight"):
        PolicyWeights(interference_weight=value)
