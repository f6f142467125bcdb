"""PoolRouter.plan with the held-roots charge: the router reads each replica's held prompt roots
from the real ``PrefixTable`` (fed with ``Stored`` events) only while ``root_weight`` > 0, and a
first touch then goes to the replica homing fewer contexts (docs/policy-studies.md, Part 16)."""

from __future__ import annotations

import random

from balancer.events import Stored
from balancer.index.hashing import pack_tokens
from balancer.policy.base import PolicyWeights
from balancer.policy.registry import make_policy
from balancer.routing.router import PoolRouter, RoutePlan
from balancer.types import EngineHash, ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")
BLOCK = 16


def context(tenant: int) -> list[int]:
    """A tenant's 8-block prompt; no two tenants share a first block."""
    return [10_000 * (tenant + 1) + i for i in range(8 * BLOCK)]


def stored(tokens: list[int], first_hash: int) -> Stored:
    count = len(tokens) // BLOCK
    hashes = tuple(EngineHash(first_hash + i) for i in range(count))
    return Stored(0, None, hashes, pack_tokens(tokens[: count * BLOCK]), BLOCK)


def fleet() -> PoolRouter:
    """A homes three tenants' contexts, B one; A has the shorter backlog (B one 4-block prompt
    queued, reserved without index entries)."""
    router = PoolRouter("m")
    router.add_replica(A, BLOCK, "plain")
    router.add_replica(B, BLOCK, "plain")
    table = router.space_of[A].table
    for tenant in range(3):
        table.apply(A, [stored(context(tenant), 100 * (tenant + 1))], now=0.0)
    table.apply(B, [stored(context(3), 900)], now=0.0)
    router.tracker().reserve("queued", B, 4 * BLOCK, 1, 0.0)
    return router


def first_touch(router: PoolRouter, weights: PolicyWeights, seed: int = 0) -> RoutePlan:
    return router.plan(context(7), [A, B], make_policy("cost"), weights, random.Random(seed), 1.0)


def test_a_first_touch_goes_to_the_replica_holding_fewer_roots() -> None:
    plan = first_touch(fleet(), PolicyWeights(root_weight=1.0))
    assert plan.inputs is not None and plan.inputs.overlap.held_roots == {A: 3, B: 1}
    terms = {t.replica: t for t in plan.decision.terms}
    assert (terms[A].held_roots, terms[B].held_roots) == (3, 1)
    assert terms[A].root_term == 8.0  # min(cap 1, 1 · (3 − 1)) prompts of 8 blocks
    assert terms[B].root_term == 0.0
    assert plan.decision.replica == B


def test_without_the_charge_the_shorter_backlog_wins_and_no_roots_are_read() -> None:
    for seed in range(5):
        plan = first_touch(fleet(), PolicyWeights(root_weight=0.0), seed)
        assert plan.inputs is not None and plan.inputs.overlap.held_roots == {}
        assert all(t.root_term == 0.0 and t.held_roots is None for t in plan.decision.terms)
        assert plan.decision.replica == A


def test_a_routed_first_touch_counts_as_a_root_of_its_replica() -> None:
    """The committed plan's speculative entries make the new context one of B's roots at once."""
    router = fleet()
    weights = PolicyWeights(root_weight=1.0)
    plan = first_touch(router, weights)
    router.commit(plan, "first", 1.0, speculative_ttl_s=5.0)
    again = router.plan(context(8), [A, B], make_policy("cost"), weights, random.Random(0), 1.1)
    assert again.inputs is not None and again.inputs.overlap.held_roots == {A: 3, B: 2}
