"""The cost policy's admission charge: ``w_prefill · w_adm · shortfall_r`` on replicas holding none
of the prompt, ``shortfall_r`` = the KV blocks ``r`` would have to free before admitting the request
(docs/policy-studies.md, Part 9)."""

from __future__ import annotations

from functools import partial

import pytest
from policy_cases import route as route_cost
from policy_cases import terms_of

from balancer.errors import ConfigError
from balancer.load.tracker import ReplicaLoad
from balancer.policy import PolicyWeights
from balancer.policy.cost import admission_shortfall_blocks
from balancer.service.decisions import terms_by_replica
from balancer.types import ReplicaId

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
route = partial(route_cost, request_blocks=450)
POOL = 2048.0


def new_context() -> list[ReplicaLoad]:
    """A tenant's 450-block prompt that no replica holds. A has the shorter prefill queue (600
    blocks) but its running requests lock 95% of its pool (the stalled replica of Part 9); B has
    800 blocks queued and 35% locked."""
    return [
        ReplicaLoad(A, pending_prefill_blocks=600.0, kv_usage=0.95, capacity_blocks=POOL),
        ReplicaLoad(B, pending_prefill_blocks=800.0, kv_usage=0.35, capacity_blocks=POOL),
    ]


def test_shortfall_is_locked_plus_queued_plus_inserted_over_the_pool() -> None:
    load = ReplicaLoad(A, pending_prefill_blocks=600.0, kv_usage=0.95, capacity_blocks=POOL)
    assert admission_shortfall_blocks(load, 450.0) == pytest.approx(0.95 * 2048 + 600 + 450 - 2048)
    roomy = ReplicaLoad(B, pending_prefill_blocks=800.0, kv_usage=0.35, capacity_blocks=POOL)
    assert admission_shortfall_blocks(roomy, 450.0) == 0.0  # 717 + 800 + 450 < 2048
    assert admission_shortfall_blocks(load, None) == 0.0  # holds part of the prompt
    assert admission_shortfall_blocks(ReplicaLoad(A, pending_prefill_blocks=600.0), 450.0) == 0.0


def test_off_by_default_so_a_new_context_goes_to_the_shorter_queue() -> None:
    assert PolicyWeights().admission_weight == 0.0
    decision = route({A: 0, B: 0}, new_context())
    assert decision.replica == A
    assert all(t.admission_term == 0.0 for t in decision.terms)


def test_it_sends_a_new_context_away_from_a_replica_stalled_on_kv() -> None:
    decision = route({A: 0, B: 0}, new_context(), admission_weight=1.0)
    terms = terms_of(decision)
    assert terms[A].admission_term == pytest.approx(0.95 * 2048 + 600 + 450 - 2048)  # 947.6
    assert terms[B].admission_term == 0.0
    assert decision.replica == B
    # the explanation carries it
    assert terms_by_replica(decision.terms)[A]["admission_term"] == pytest.approx(947.6)


def test_a_replica_holding_the_prompt_is_not_charged() -> None:
    # A holds the 375-block context: its followers stay, however much of its pool is locked
    decision = route({A: 375, B: 0}, new_context(), admission_weight=1.0)
    terms = terms_of(decision)
    assert terms[A].admission_term == 0.0
    assert decision.replica == A


def test_scales_with_the_weight_and_the_prefill_weight() -> None:
    loads = [*new_context(), ReplicaLoad(C, pending_prefill_blocks=0.0, kv_usage=1.0, capacity_blocks=POOL)]
    decision = route({A: 0, B: 0, C: 0}, loads, admission_weight=0.5, prefill_weight=2.0)
    terms = terms_of(decision)
    assert terms[A].admission_term == pytest.approx(2.0 * 0.5 * (0.95 * 2048 + 600 + 450 - 2048))
    assert terms[C].admission_term == pytest.approx(2.0 * 0.5 * 450)
    assert terms[A].cost == pytest.approx(
        terms[A].prefill_term
        + terms[A].duplication_term
        + terms[A].interference_term
        + terms[A].admission_term
        + terms[A].decode_term
        + terms[A].queue_term
    )


@pytest.mark.parametrize("value", [-0.1, 4.5, float("nan")])
def test_out_of_range_is_rejected(value: float) -> None:
    with pytest.raises(ConfigError, match="admission_weight"):
        PolicyWeights(admission_weight=value)
