"""The what-if follows the cache its own decisions would have built (balancer.service.replay_cache).

A replay that moves a shared prefix to another replica must find that replica warm for the
prefix's next requests, as a real run with those weights would (docs/operations.md, "What-if")."""

from __future__ import annotations

import random

import pytest

from balancer.health.book import HealthBook
from balancer.index.marks import mark_positions, prefix_marks
from balancer.policy.base import PolicyWeights
from balancer.policy.registry import make_policy
from balancer.routing.router import PoolRequest, PoolRouter, RouteLimits
from balancer.service.decisions import DecisionLog
from balancer.service.replay_cache import ReplayCache
from balancer.service.whatif import replay
from balancer.types import BlockKey, Overlap, ReplicaId

REPLICAS = [ReplicaId(f"r{i}") for i in range(4)]
R0, R1 = REPLICAS[0], REPLICAS[1]


def keys(first: int, n: int) -> list[BlockKey]:
    return [BlockKey(first + i) for i in range(n)]


def test_mark_positions_are_every_prompts_own_and_bounded() -> None:
    assert mark_positions(0) == []
    assert mark_positions(5) == [1, 2, 3, 4, 5]
    long = mark_positions(8192)
    assert len(long) <= 16 + 8 * 9 + 1 and long[-1] == 8192
    # a prompt sharing a prefix with a longer one shares the longer one's marks up to it
    assert set(mark_positions(100)) - {100} <= set(mark_positions(1000))
    marks = prefix_marks(keys(1, 40), 32, 16)  # keys of 32-token blocks, reference blocks of 16
    assert marks[0] == (2, 1) and marks[-1] == (80, 40)


@pytest.mark.parametrize(("key_block", "reference_block"), [(16, 16), (32, 16), (16, 32)])
def test_prefix_marks_are_the_keys_at_mark_positions(key_block: int, reference_block: int) -> None:
    """The marks, cut from the lengths every prompt shares and picked in one pass, are the keys at
    ``mark_positions`` of every prompt length from 0 to 1,100 blocks (tuples and lists of keys)."""
    for blocks in range(1101):
        chain = keys(7_000_000 + blocks, blocks)
        want = tuple((p * key_block // reference_block, chain[p - 1]) for p in mark_positions(blocks))
        assert prefix_marks(chain, key_block, reference_block) == want
        assert prefix_marks(tuple(chain), key_block, reference_block) == want


def test_a_moved_prefix_warms_its_new_replica_and_leaves_the_old_one() -> None:
    cache = ReplayCache()
    marks = prefix_marks(keys(1000, 8), 16, 16)
    first = Overlap({r: 0 for r in REPLICAS}, request_blocks=8)
    assert cache.overlap(REPLICAS, first, marks) == first
    cache.place(R0, R1, marks)  # routed to r0, the replay put it on r1
    # the index saw it on r0 (where it was routed), not on r1
    second = Overlap({R0: 8, R1: 0, REPLICAS[2]: 0, REPLICAS[3]: 0}, request_blocks=8)
    replayed = cache.overlap(REPLICAS, second, marks)
    assert replayed.blocks == {R0: 0, R1: 8, REPLICAS[2]: 0, REPLICAS[3]: 0}


def test_unmoved_decisions_see_the_recorded_matches_evictions_and_warm_replicas_included() -> None:
    cache = ReplayCache()
    marks = prefix_marks(keys(1, 40), 16, 16)
    # r1 was warm before the window (the index held 30 blocks there): it stays warm in the replay
    warm = Overlap({R0: 0, R1: 30}, request_blocks=40)
    assert cache.overlap([R0, R1], warm, marks) == warm
    cache.place(R0, R0, marks)
    again = Overlap({R0: 40, R1: 30}, request_blocks=40)
    assert cache.overlap([R0, R1], again, marks) == again
    # the engine evicted the tail on r0 (the index says 17): the replay sees the same
    evicted = Overlap({R0: 17, R1: 30}, request_blocks=40)
    assert cache.overlap([R0, R1], evicted, marks) == evicted


def test_a_prefix_evicted_in_the_real_run_is_evicted_in_the_replay_too() -> None:
    cache = ReplayCache()
    marks = prefix_marks(keys(1, 8), 16, 16)
    cache.overlap([R0, R1], Overlap({R0: 0, R1: 0}, request_blocks=8), marks)
    cache.place(R0, R0, marks)
    gone = Overlap({R0: 0, R1: 0}, request_blocks=8)
    assert cache.overlap([R0, R1], gone, marks).blocks == {R0: 0, R1: 0}


def router(seed: int) -> PoolRouter:
    health = HealthBook()
    for replica in REPLICAS:
        health.add(replica, probe_ok=True)
    # speculative entries outlive the run: the index holds what was routed (no engine events here)
    limits = RouteLimits(max_inflight_per_replica=10_000, speculative_ttl_s=1_000.0)
    pool = PoolRouter("m", health=health, route_limits=limits, rng=random.Random(seed))
    for replica in REPLICAS:
        pool.add_replica(replica, 16, "plain")
    return pool


def run(weights: PolicyWeights, n: int = 400, seed: int = 0) -> DecisionLog:
    """A ``tenants``-like stream through a real router: 8 contexts of 64 blocks, each request one
    context plus a question of its own; a third of the requests finish as each arrives."""
    log = DecisionLog(10_000, 1 << 30)
    pool, policy, rng = router(seed), make_policy("cost"), random.Random(seed)
    contexts = [list(range(100_000 * (c + 1), 100_000 * (c + 1) + 1024)) for c in range(8)]
    leases = []
    for k in range(n):
        now = 1.0 + k * 0.05
        tokens = contexts[rng.randrange(8)] + [rng.randrange(50_000) for _ in range(128)]
        lease = pool.route(PoolRequest(tokens, policy, weights, f"q{k}"), now)
        plan = lease.plan
        assert plan.inputs is not None
        log.record(
            "m", plan.inputs, plan.decision, weights, plan.prompt_tokens, plan.cached_tokens, None, now
        )
        leases.append(lease)
        while len(leases) > 6:
            leases.pop(0).release(now)
    return log


def test_the_whatif_of_a_change_that_moves_prefixes_predicts_the_run_made_with_it() -> None:
    """The h-simwalk case: from a run with the default weights, predict ``overlap_credit=0``; a run
    of the same stream with that weight is the truth (its own hit rate as kvlb predicted it). The
    replay on the recorded matches said 0.513 for a measured 0.909 on the emulated fleet."""
    proposed = PolicyWeights(overlap_credit=0.0)
    base = run(PolicyWeights()).ring("m").snapshot()
    truth = run(proposed).ring("m").snapshot()
    cost = make_policy("cost")
    predicted = replay("m", base, cost, proposed).after["hit_rate"]
    measured = replay("m", truth, cost, proposed).before["hit_rate"]
    assert replay("m", truth, cost, proposed).changed == 0
    assert abs(predicted - measured) < 0.03, (predicted, measured)


def test_the_model_is_bounded_and_says_what_it_left_to_the_recorded_matches() -> None:
    cache = ReplayCache(max_marks=20)
    first, second = prefix_marks(keys(1, 8), 16, 16), prefix_marks(keys(100, 8), 16, 16)
    empty = Overlap({R0: 0, R1: 0}, request_blocks=8)
    cache.overlap([R0, R1], empty, first)
    cache.place(R0, R1, first)
    assert cache.marks_held == 16
    cache.overlap([R0, R1], empty, second)
    cache.place(R0, R1, second)
    assert cache.marks_held == 32 and cache.unmodelled == 0
    full = Overlap({R0: 8, R1: 0}, request_blocks=8)
    assert cache.overlap([R0, R1], full, first) is full
    cache.place(R0, R1, first)
    assert cache.marks_held == 32 and cache.unmodelled == 1


def test_a_replay_past_its_bound_counts_the_decisions_left_to_their_recorded_matches() -> None:
    """``replay``'s ``max_cache_marks`` (``console.whatif_max_cache_marks``) bounds its model: a
    small bound leaves the later decisions on their recorded matches, in ``tallies.unmodelled``."""
    records = run(PolicyWeights()).ring("m").snapshot()
    cost = make_policy("cost")
    free = replay("m", records, cost, PolicyWeights())
    assert free.tallies["unmodelled"] == 0
    bounded = replay("m", records, cost, PolicyWeights(), max_cache_marks=20)
    marked = len(records) - bounded.tallies["unmarked"]
    assert 0 < bounded.tallies["unmodelled"] < marked
    assert bounded.changed == 0  # the recorded matches reproduce the recorded decisions
