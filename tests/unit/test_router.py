"""PoolRouter: hashing per key space, merged overlap, commitment kept apart from selection."""

from __future__ import annotations

import random

import pytest

from balancer.events import Stored
from balancer.index.hashing import pack_tokens
from balancer.load.tracker import EngineStats
from balancer.policy.base import PolicyWeights
from balancer.policy.registry import make_policy
from balancer.routing.router import MAX_DECODE_TOKENS, PoolRouter
from balancer.types import EngineHash, ReplicaId

A, B, T = ReplicaId("a"), ReplicaId("b"), ReplicaId("t")
PROMPT = list(range(1000, 1000 + 130))  # 8 full blocks of 16, 4 of 32 (trtllm: prompt[:-1])


def stored(tokens: list[int], block_size: int, first_hash: int = 1) -> Stored:
    count = len(tokens) // block_size
    return Stored(
        dp_rank=0,
        parent=None,
        engine_hashes=tuple(EngineHash(first_hash + i) for i in range(count)),
        tokens=pack_tokens(tokens[: count * block_size]),
        block_size=block_size,
    )


def pool() -> PoolRouter:
    router = PoolRouter("m")
    router.add_replica(A, 16, "plain")
    router.add_replica(B, 16, "plain")
    return router


def test_hot_prefix_goes_to_holder_and_plan_has_no_side_effects() -> None:
    router = pool()
    router.space_of[B].table.apply(B, [stored(PROMPT, 16)], now=0.0)
    policy, weights = make_policy("cost"), PolicyWeights()
    plan = router.plan(PROMPT, [A, B], policy, weights, random.Random(1), now=1.0)
    assert plan.decision.replica == B
    assert plan.cached_tokens == 8 * 16
    assert plan.decision.overlap_blocks == 8
    assert len(plan.keys) == 8
    assert router.tracker().snapshot(1.0).of(B).pending_prefill_tokens == 0  # plan reserved nothing


def test_plan_gives_the_policy_each_replicas_holdings_for_its_cache_pressure() -> None:
    router = pool()
    router.space_of[B].table.apply(B, [stored(PROMPT, 16)], now=0.0)  # 8 blocks held
    router.tracker().observe(B, EngineStats(capacity_tokens=20 * 16), now=0.0)  # a pool of 20
    plan = router.plan(PROMPT, [A, B], make_policy("cost"), PolicyWeights(), random.Random(1), now=1.0)
    terms = {t.replica: t for t in plan.decision.terms}
    assert terms[B].cache_pressure == pytest.approx(0.3)  # fill 0.4 on the 0.25..0.75 ramp
    assert terms[A].cache_pressure is None  # pool size never scraped
    assert terms[A].duplication_term == 0.0


def test_commit_reserves_and_speculates_then_release() -> None:
    router = pool()
    policy, weights = make_policy("cost"), PolicyWeights()
    first = router.plan(PROMPT, [A, B], policy, weights, random.Random(3), now=0.0)
    assert first.cached_tokens == 0
    assert router.commit(first, "r1", now=0.0, speculative_ttl_s=2.0)
    assert not router.commit(first, "r1", now=0.0, speculative_ttl_s=2.0)  # same id twice
    chosen = first.decision.replica
    load = router.tracker().snapshot(0.0).of(chosen)
    assert load.pending_prefill_tokens == len(PROMPT)
    # Before any event, the speculative entries pull the same prefix to the same replica...
    follow = router.plan(PROMPT, [A, B], policy, weights, random.Random(4), now=0.5)
    assert follow.decision.replica == chosen
    assert follow.cached_tokens == 8 * 16
    # ...until they expire.
    router.release("r1", now=0.6)
    late = router.plan(PROMPT, [A, B], policy, weights, random.Random(4), now=5.0)
    assert late.cached_tokens == 0
    assert router.tracker().snapshot(5.0).of(chosen).pending_prefill_tokens == 0


def test_mixed_key_spaces_merge_in_reference_blocks() -> None:
    router = pool()
    space = router.add_replica(T, 32, "trtllm")
    assert router.reference_block_size == 16
    space.table.apply(T, [stored(PROMPT[:-2], 32)], now=0.0)  # 4 blocks of 32 over prompt[:-1]
    router.space_of[A].table.apply(A, [stored(PROMPT[:48], 16)], now=0.0)  # 3 blocks of 16
    weights = PolicyWeights()
    plan = router.plan(PROMPT, [A, B, T], make_policy("cost"), weights, random.Random(0), now=1.0)
    terms = {t.replica: t for t in plan.decision.terms}
    assert terms[T].overlap_blocks == 8  # 4 × 32 tokens = 8 reference blocks
    assert terms[A].overlap_blocks == 3
    assert terms[B].overlap_blocks == 0
    assert plan.decision.replica == T
    assert plan.cached_tokens == 128


def test_remove_replica_drops_blocks_and_load() -> None:
    router = pool()
    router.space_of[A].table.apply(A, [stored(PROMPT, 16)], now=0.0)
    plan = router.plan(PROMPT, [A, B], make_policy("cost"), PolicyWeights(), random.Random(0), 0.0)
    router.commit(plan, "x", 0.0, 0.0)
    router.remove_replica(A)
    assert A not in router.space_of
    after = router.plan(PROMPT, [B], make_policy("cost"), PolicyWeights(), random.Random(0), 1.0)
    assert after.decision.replica == B and after.cached_tokens == 0


def test_same_prefix_burst_before_any_event_does_not_scatter() -> None:
    router = PoolRouter("m")
    replicas = [ReplicaId(f"r{i}") for i in range(4)]
    for replica in replicas:
        router.add_replica(replica, 16, "plain")
    policy, weights, rng = make_policy("cost"), PolicyWeights(), random.Random(11)
    chosen = []
    for i in range(6):
        plan = router.plan(PROMPT, replicas, policy, weights, rng, now=0.01 * i)
        router.commit(plan, f"burst-{i}", now=0.01 * i, speculative_ttl_s=2.0)
        chosen.append(plan.decision.replica)
        if i:
            terms = {t.replica: t for t in plan.decision.terms}
            assert terms[chosen[0]].shared_pending_blocks > 0  # explained in the cost terms
    assert len(set(chosen)) == 1, chosen
    # An unrelated prompt still sees that replica's queued prefill as load and goes elsewhere.
    other = [t + 50_000 for t in PROMPT]
    plan = router.plan(other, replicas, policy, weights, rng, now=0.1)
    assert plan.decision.replica != chosen[0]


def test_speculation_is_held_until_the_first_token_then_shortened() -> None:
    router = pool()
    policy, weights = make_policy("cost"), PolicyWeights()
    plan = router.plan(PROMPT, [A, B], policy, weights, random.Random(2), now=0.0)
    router.commit(plan, "slow", now=0.0, speculative_ttl_s=2.0, pending_ttl_s=30.0)
    chosen = plan.decision.replica
    # Queued for 5 s without a first token: the engine cannot have reported the blocks yet.
    assert router.plan(PROMPT, [A, B], policy, weights, random.Random(2), now=5.0).cached_tokens == 128
    router.first_token("slow", now=6.0)
    held = router.plan(PROMPT, [A, B], policy, weights, random.Random(2), now=7.9)
    assert held.decision.replica == chosen and held.cached_tokens == 128
    assert router.plan(PROMPT, [A, B], policy, weights, random.Random(2), now=8.1).cached_tokens == 0


def test_release_without_first_token_shortens_speculation() -> None:
    router = pool()
    policy, weights = make_policy("cost"), PolicyWeights()
    plan = router.plan(PROMPT, [A, B], policy, weights, random.Random(2), now=0.0)
    router.commit(plan, "cancelled", now=0.0, speculative_ttl_s=2.0, pending_ttl_s=30.0)
    router.release("cancelled", now=1.0)
    assert router.plan(PROMPT, [A, B], policy, weights, random.Random(2), now=3.1).cached_tokens == 0


def test_decode_load_counts_private_blocks_only() -> None:
    router = pool()
    router.space_of[A].table.apply(A, [stored(PROMPT, 16)], now=0.0)
    plan = router.plan(
        PROMPT, [A], make_policy("cost"), PolicyWeights(), random.Random(0), 0.0, max_tokens=30
    )
    assert plan.cached_tokens == 128
    assert plan.decode_blocks == -(-(len(PROMPT) - 128 + 30) // 16)  # uncached prompt + output only


def test_decode_load_counts_each_of_n_sequences_and_steers_the_next_request() -> None:
    policy, weights = make_policy("cost"), PolicyWeights()
    router = pool()
    one = router.plan(PROMPT, [A], policy, weights, random.Random(0), 0.0, max_tokens=64)
    eight = router.plan(PROMPT, [A], policy, weights, random.Random(0), 0.0, max_tokens=64, sequences=8)
    assert one.decode_blocks == -(-(len(PROMPT) + 64) // 16) and one.sequences == 1
    assert eight.decode_blocks == -(-(len(PROMPT) + 8 * 64) // 16) and eight.sequences == 8
    huge = router.plan(PROMPT, [A], policy, weights, random.Random(0), 0.0, max_tokens=2**62, sequences=2**20)
    assert huge.decode_blocks == -(-(len(PROMPT) + MAX_DECODE_TOKENS) // 16)  # bounded

    def next_choice(sequences_on_a: int) -> tuple[ReplicaId, int]:
        """Where a new prompt goes while A decodes a request of ``n = sequences_on_a`` (64 tokens
        each) and B one of n = 1 with 256 tokens: 13 blocks against 25 for n = 1, 41 for n = 8."""
        router = pool()
        on_a = router.plan(
            PROMPT, [A], policy, weights, random.Random(0), 0.0, max_tokens=64, sequences=sequences_on_a
        )
        on_b = router.plan(PROMPT, [B], policy, weights, random.Random(0), 0.0, max_tokens=256)
        for request_id, plan in (("on-a", on_a), ("on-b", on_b)):
            router.commit(plan, request_id, now=0.0, speculative_ttl_s=2.0, pending_ttl_s=30.0)
            router.first_token(request_id, now=0.1)
        other = list(range(5000, 5000 + 130))  # cached nowhere
        plan = router.plan(other, [A, B], policy, weights, random.Random(0), 0.2, max_tokens=64)
        terms = {t.replica: t for t in plan.decision.terms}
        return plan.decision.replica, int(terms[A].active_decode_blocks)  # the decision says why

    assert next_choice(1) == (A, one.decode_blocks)
    assert next_choice(8) == (B, eight.decode_blocks)
