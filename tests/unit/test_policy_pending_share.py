"""``pending_share_weight``: a follower of a request still prefilling its prefix shares that work.

The cost policy counts the overlap backed only by speculative entries as shared, not as backlog.
Once the engine reports the leader's blocks they are confirmed and stop counting, while the leader's
whole uncached prompt stays in the replica's router-tracked backlog until its first token. The
weight credits the overlap such requests are computing (``Overlap.prefilling_blocks``) as well.
Pure policy tests first, then the real router filling ``prefilling_blocks``.
"""

from __future__ import annotations

import random

import pytest

from balancer.errors import ConfigError
from balancer.events import Stored
from balancer.index.hashing import pack_tokens
from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.policy import CostPolicy, PolicyWeights, RouteRequest
from balancer.policy.registry import make_policy
from balancer.routing.router import PoolRouter, common_prefix_blocks
from balancer.types import BlockKey, CostTerms, Decision, EngineHash, Overlap, ReplicaId

HOME, AWAY = ReplicaId("home"), ReplicaId("away")
BLOCK = 16


def decide(overlap: Overlap, loads: list[ReplicaLoad], **weights: float) -> Decision:
    request = RouteRequest(
        candidates=(HOME, AWAY),
        request_blocks=overlap.request_blocks,
        prompt_tokens=overlap.request_blocks * BLOCK,
    )
    snapshot = LoadSnapshot(now=0.0, block_size_tokens=BLOCK, replicas={x.replica: x for x in loads})
    return CostPolicy()(request, overlap, snapshot, PolicyWeights(**weights), random.Random(0))


def terms(decision: Decision) -> dict[ReplicaId, CostTerms]:
    return {t.replica: t for t in decision.terms}


# A tenant's leader was routed home with a 40-block context and a 10-block question (50 uncached
# blocks); home also has 20 blocks of other prefill queued. The engine has reported the context's
# blocks (confirmed: not speculative) but the leader has no first token yet. The follower has the
# same context and its own 10-block question.
FOLLOWER = Overlap(blocks={HOME: 40, AWAY: 0}, request_blocks=50, prefilling_blocks={HOME: 40})
LOADS = [ReplicaLoad(HOME, pending_prefill_blocks=70.0), ReplicaLoad(AWAY, pending_prefill_blocks=0.0)]


def test_off_by_default_the_follower_pays_the_leaders_reported_prefill_as_backlog() -> None:
    decision = decide(FOLLOWER, LOADS, decode_weight=0.0, interference_weight=0.0)
    home = terms(decision)[HOME]
    assert home.shared_pending_blocks == 0.0
    assert home.prefill_term == pytest.approx(70 + 50 - 40)
    assert terms(decision)[AWAY].prefill_term == pytest.approx(50)
    assert decision.replica == AWAY  # 80 > 50: the follower leaves and copies the context


def test_with_the_weight_the_prefilling_overlap_is_shared_and_the_follower_stays_home() -> None:
    decision = decide(FOLLOWER, LOADS, decode_weight=0.0, interference_weight=0.0, pending_share_weight=1.0)
    home = terms(decision)[HOME]
    assert home.shared_pending_blocks == pytest.approx(40)
    # its wait: the backlog less the shared context (30), plus its own question (10)
    assert home.prefill_term == pytest.approx(70 - 40 + 50 - 40)
    assert decision.replica == HOME


def test_a_fractional_weight_discounts_the_shared_part() -> None:
    decision = decide(FOLLOWER, LOADS, decode_weight=0.0, interference_weight=0.0, pending_share_weight=0.5)
    assert terms(decision)[HOME].shared_pending_blocks == pytest.approx(20)
    assert terms(decision)[HOME].prefill_term == pytest.approx(70 - 20 + 10)


def test_shared_is_the_larger_of_speculative_and_prefilling_not_their_sum() -> None:
    both = Overlap(
        blocks={HOME: 40, AWAY: 0},
        request_blocks=50,
        speculative_blocks={HOME: 30},
        prefilling_blocks={HOME: 40},
    )
    assert terms(decide(both, LOADS))[HOME].shared_pending_blocks == pytest.approx(30)
    weighted = decide(both, LOADS, pending_share_weight=1.0)
    assert terms(weighted)[HOME].shared_pending_blocks == pytest.approx(40)
    half = decide(both, LOADS, pending_share_weight=0.5)
    assert terms(half)[HOME].shared_pending_blocks == pytest.approx(30)


def test_shared_never_exceeds_the_backlog_nor_survives_credit_zero() -> None:
    small = [ReplicaLoad(HOME, pending_prefill_blocks=15.0), ReplicaLoad(AWAY)]
    capped = decide(FOLLOWER, small, pending_share_weight=1.0)
    assert terms(capped)[HOME].shared_pending_blocks == pytest.approx(15)
    blind = decide(FOLLOWER, LOADS, pending_share_weight=1.0, overlap_credit=0.0)
    assert terms(blind)[HOME].shared_pending_blocks == 0.0


def test_weight_zero_ignores_prefilling_blocks_entirely() -> None:
    without = Overlap(blocks={HOME: 40, AWAY: 0}, request_blocks=50)
    loads = [
        ReplicaLoad(HOME, pending_prefill_blocks=70.0, active_decode_blocks=30, active_decode_seqs=3),
        ReplicaLoad(AWAY, pending_prefill_blocks=5.0, active_decode_blocks=10, active_decode_seqs=1),
    ]
    assert decide(FOLLOWER, loads).terms == decide(without, loads).terms


def test_the_weight_is_validated() -> None:
    assert PolicyWeights(pending_share_weight=1.0).pending_share_weight == 1.0
    with pytest.raises(ConfigError, match="pending_share_weight"):
        PolicyWeights(pending_share_weight=1.5)
    with pytest.raises(ConfigError, match="pending_share_weight"):
        PolicyWeights().replace(pending_share_weight=-0.1)


# --- the router fills Overlap.prefilling_blocks ----------------------------------------------

CONTEXT = list(range(5000, 5000 + 8 * BLOCK))  # 8 blocks shared by a tenant's requests
LEADER = CONTEXT + list(range(100, 100 + 2 * BLOCK + 3))  # + its own 2-block question
FOLLOWER_PROMPT = CONTEXT + list(range(900, 900 + 2 * BLOCK + 3))


def test_common_prefix_blocks_of_chained_keys() -> None:
    keys = [BlockKey(k) for k in (11, 12, 13, 14)]
    assert common_prefix_blocks(keys, keys, 10) == 4
    assert common_prefix_blocks(keys, [*keys[:2], BlockKey(99)], 10) == 2
    assert common_prefix_blocks(keys, keys, 3) == 3
    assert common_prefix_blocks(keys, [BlockKey(1)], 10) == 0
    assert common_prefix_blocks(keys, [], 10) == 0


def reported(tokens: list[int]) -> Stored:
    count = len(tokens) // BLOCK
    return Stored(
        dp_rank=0,
        parent=None,
        engine_hashes=tuple(EngineHash(1 + i) for i in range(count)),
        tokens=pack_tokens(tokens[: count * BLOCK]),
        block_size=BLOCK,
    )


def test_router_credits_a_leaders_reported_blocks_until_its_first_token() -> None:
    router = PoolRouter("m")
    router.add_replica(HOME, BLOCK, "plain")
    router.add_replica(AWAY, BLOCK, "plain")
    policy = make_policy("cost")
    off = PolicyWeights(decode_weight=0.0, interference_weight=0.0)
    on = off.replace(pending_share_weight=1.0)
    leader = router.plan(LEADER, [HOME], policy, off, random.Random(0), now=0.0)
    assert router.commit(leader, "leader", now=0.0, speculative_ttl_s=2.0, pending_ttl_s=30.0)
    # Before the engine reports anything the context is speculative: shared either way.
    early = router.plan(FOLLOWER_PROMPT, [HOME, AWAY], policy, off, random.Random(0), now=0.1)
    assert early.decision.replica == HOME
    assert terms(early.decision)[HOME].shared_pending_blocks == pytest.approx(8)
    # The engine reports the leader's prompt blocks while the leader still has no first token.
    router.space_of[HOME].table.apply(HOME, [reported(LEADER)], now=0.2)
    blind = router.plan(FOLLOWER_PROMPT, [HOME, AWAY], policy, off, random.Random(0), now=0.3)
    assert blind.inputs is not None and blind.inputs.overlap.speculative_blocks.get(HOME, 0) == 0
    assert blind.inputs.overlap.prefilling_blocks == {}  # not computed with the weight at 0
    assert terms(blind.decision)[HOME].shared_pending_blocks == 0.0
    assert blind.decision.replica == AWAY  # the leader's 10 blocks count as backlog: 10 + 2 > 10
    seen = router.plan(FOLLOWER_PROMPT, [HOME, AWAY], policy, on, random.Random(0), now=0.3)
    assert seen.inputs is not None and seen.inputs.overlap.prefilling_blocks == {HOME: 8}
    assert terms(seen.decision)[HOME].shared_pending_blocks == pytest.approx(8)
    assert seen.decision.replica == HOME  # 10 - 8 + 2 < 10
    # At its first token the leader's prefill is over: nothing is being computed any more.
    router.first_token("leader", now=0.4)
    after = router.plan(FOLLOWER_PROMPT, [HOME, AWAY], policy, on, random.Random(0), now=0.5)
    assert after.inputs is not None and after.inputs.overlap.prefilling_blocks == {}


def test_a_leader_that_found_the_context_cached_computes_none_of_it() -> None:
    router = PoolRouter("m")
    router.add_replica(HOME, BLOCK, "plain")
    router.add_replica(AWAY, BLOCK, "plain")
    router.space_of[HOME].table.apply(HOME, [reported(CONTEXT)], now=0.0)
    policy, on = make_policy("cost"), PolicyWeights(pending_share_weight=1.0)
    leader = router.plan(LEADER, [HOME], policy, on, random.Random(0), now=0.0)
    assert leader.cached_tokens == 8 * BLOCK
    router.commit(leader, "leader", now=0.0, speculative_ttl_s=2.0, pending_ttl_s=30.0)
    follower = router.plan(FOLLOWER_PROMPT, [HOME, AWAY], policy, on, random.Random(0), now=0.1)
    assert follower.inputs is not None and follower.inputs.overlap.prefilling_blocks == {}
