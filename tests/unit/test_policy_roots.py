"""The cost policy's held-roots charge (``root_weight``, 1 by default since 2026-11-29): a replica
holding none of the prompt pays ``w_prefill · min(root_cap_prompts, root_weight · (roots_r − fewest)) ·
request_blocks`` for the prompt roots its caches hold beyond the fewest an eligible candidate holds
(docs/policy-studies.md, Parts 15 and 16)."""

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

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
BLOCKS = 400
"""A tenant's context in blocks (6,400 tokens of 16)."""
route = partial(route_cost, request_blocks=BLOCKS)


def first_touch() -> list[ReplicaLoad]:
    """A context no replica holds: A has the shortest prefill queue (10 blocks less than B)."""
    return [
        ReplicaLoad(A, pending_prefill_blocks=100.0),
        ReplicaLoad(B, pending_prefill_blocks=110.0),
        ReplicaLoad(C, pending_prefill_blocks=300.0),
    ]


ROOTS = {A: 5, B: 3, C: 3}
"""A homes two contexts more than B and C."""


def test_on_by_default_and_weight_0_leaves_decisions_and_terms_as_without_roots() -> None:
    weights = PolicyWeights()
    assert (weights.root_weight, weights.root_cap_prompts) == (1.0, 1.0)
    assert route({A: 0, B: 0, C: 0}, first_touch(), roots=ROOTS).replica == B  # the default charges A
    with_roots = route({A: 0, B: 0, C: 0}, first_touch(), roots=ROOTS, root_weight=0.0)
    without = route({A: 0, B: 0, C: 0}, first_touch(), root_weight=0.0)
    assert with_roots == without  # decision, reason and every term
    assert with_roots.replica == A
    assert all(t.root_term == 0.0 and t.held_roots is None for t in with_roots.terms)


def test_a_first_touch_goes_to_a_replica_homing_fewer_contexts() -> None:
    decision = route({A: 0, B: 0, C: 0}, first_touch(), roots=ROOTS, root_weight=1.0)
    terms = terms_of(decision)
    # A: min(cap 1, 1 · (5 − 3)) prompts = 400 blocks; B and C hold the fewest roots: no charge
    assert terms[A].root_term == pytest.approx(400.0)
    assert (terms[B].root_term, terms[C].root_term) == (0.0, 0.0)
    assert terms[A].cost == pytest.approx(100.0 + 400 + 400)  # pending + prefill + charge
    assert decision.replica == B
    assert [terms[r].held_roots for r in (A, B, C)] == [5, 3, 3]
    explained = terms_by_replica(decision.terms)  # /admin/explain and the console's feed
    assert explained[A]["root_term"] == pytest.approx(400.0) and explained[A]["held_roots"] == 5


def test_only_replicas_without_the_prompt_pay() -> None:
    """A holds the tenant's context: its follower is not charged for A's roots."""
    decision = route({A: 300, B: 0, C: 0}, first_touch(), roots=ROOTS, root_weight=1.0)
    terms = terms_of(decision)
    assert terms[A].root_term == 0.0 and terms[A].held_roots == 5
    assert decision.replica == A


def test_the_fewest_is_taken_over_eligible_replicas_only() -> None:
    """C is excluded by the KV guard: its 0 roots are not the floor (B's 3 are), so B pays nothing,
    A pays for 2, and C (computed anyway for the explanation) is never charged below 0."""
    loads = first_touch()
    loads[2] = ReplicaLoad(C, pending_prefill_blocks=300.0, kv_usage=0.99)
    decision = route(
        {A: 0, B: 0, C: 0}, loads, roots={A: 5, B: 3, C: 0}, root_weight=0.25, kv_usage_ceiling=0.95
    )
    terms = terms_of(decision)
    assert terms[C].excluded is not None and terms[C].root_term == 0.0
    assert terms[B].root_term == 0.0
    assert terms[A].root_term == pytest.approx(0.25 * 2 * BLOCKS)
    assert decision.replica == B


@pytest.mark.parametrize(
    ("weight", "cap", "prefill_weight", "charged_prompts"),
    [
        (1.0, 1.0, 1.0, 1.0),  # 1 · 2 roots, capped at one prompt
        (1.0, 8.0, 1.0, 2.0),  # uncapped: 2 prompts
        (0.25, 1.0, 1.0, 0.5),  # under the cap
        (1.0, 0.5, 2.0, 0.5),  # the cap in prompts, then × w_prefill
        (4.0, 0.0, 1.0, 0.0),  # cap 0: off
    ],
)
def test_the_charge_is_capped_in_prompts(
    weight: float, cap: float, prefill_weight: float, charged_prompts: float
) -> None:
    decision = route(
        {A: 0, B: 0, C: 0},
        first_touch(),
        roots=ROOTS,
        root_weight=weight,
        root_cap_prompts=cap,
        prefill_weight=prefill_weight,
    )
    assert terms_of(decision)[A].root_term == pytest.approx(prefill_weight * charged_prompts * BLOCKS)


def test_a_replica_whose_roots_are_unknown_is_not_charged() -> None:
    """The index said nothing for A: no charge, and the floor is over B and C."""
    decision = route({A: 0, B: 0, C: 0}, first_touch(), roots={B: 3, C: 4}, root_weight=1.0)
    terms = terms_of(decision)
    assert terms[A].root_term == 0.0 and terms[A].held_roots is None
    assert terms[C].root_term == pytest.approx(BLOCKS)  # min(1, 1 · (4 − 3)) prompts
    assert decision.replica == A
    nobody = route({A: 0, B: 0, C: 0}, first_touch(), root_weight=1.0)  # no counts at all
    assert nobody == route({A: 0, B: 0, C: 0}, first_touch())


@pytest.mark.parametrize(
    ("field", "value"), [("root_weight", 4.5), ("root_weight", -0.1), ("root_cap_prompts", 8.5)]
)
def test_out_of_range_values_are_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"policy.{field} must be in"):
        PolicyWeights(**{field: value})
