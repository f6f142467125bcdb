"""The simulator's oracle router: Belady caches, the load-bounded greedy plan, and its replay."""

from __future__ import annotations

import dataclasses
import random

import pytest

from loadtests.oracle import NEVER, prefix_reuse_bound
from loadtests.simulate import SimConfig, Simulation, workload_requests
from loadtests.simulate.block_cache import BlockCache
from loadtests.simulate.oracle import (
    BeladyCache,
    BeladySimulation,
    OracleLruSimulation,
    _Future,
    plan_oracle,
    simulate_oracle,
)

TENANTS = {
    "prompt_format": "tokens",
    "tenants": 16,
    "users_per_tenant": 3,
    "context_tokens": 1536,
    "question_tokens": 128,
    "max_tokens": 16,
}


def test_belady_cache_evicts_the_block_used_farthest_away_and_rereads_stale_uses() -> None:
    stream = [[1], [2], [3], [1], [3], [2]]
    future = _Future(stream)
    assert future.after(1, 0) == 3 and future.after(1, 3) == NEVER
    cache = BeladyCache(2, future)
    hits = [cache.serve(keys, position) for position, keys in enumerate(stream)]
    # MIN with 2 slots: at 2 it evicts block 2 (next use 5) and keeps 1 (3): hits at 3 and 4
    assert hits == [0, 0, 0, 1, 1, 0]
    assert cache.prefix_hits([2, 9]) == 1 and cache.prefix_hits([9, 2]) == 0


def _requests(seed: int, rate: float = 16.0) -> list:  # type: ignore[type-arg]
    return list(workload_requests("tenants", TENANTS, requests=240, rate_per_s=rate, seed=seed))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_plan_hits_at_least_as_much_as_kvlb_and_at_most_the_pooled_bound(seed: int) -> None:
    """16 contexts of 1.5k tokens, 3 users each, on 4 replicas of 4k tokens: the pools overflow."""
    config = SimConfig(replicas=4, kv_capacity_tokens=4096, seed=seed)
    requests = _requests(seed)
    plan, replay = simulate_oracle(config, requests)
    kvlb = Simulation(config, requests).run().summary
    kvlb_min = BeladySimulation(config, requests).run().summary  # kvlb's placement, MIN engines
    pooled = prefix_reuse_bound(
        [r.token_ids for r in requests], block_size=16, replicas=4, blocks_per_replica=4096 // 16
    )
    assert plan.hit_rate is not None and kvlb.hit_rate is not None and pooled.hit_rate is not None
    assert kvlb_min.hit_rate is not None and kvlb_min.hit_rate >= kvlb.hit_rate
    assert plan.hit_rate >= kvlb_min.hit_rate
    assert plan.hit_rate <= pooled.hit_rate + 1e-9
    assert len(plan.assignment) == len(requests) == replay.summary.requests
    assert replay.summary.ok == len(requests)
    # the replay serves concurrent requests (two first requests of a context both compute it)
    assert replay.summary.hit_rate is not None and replay.summary.hit_rate >= kvlb.hit_rate


def test_a_zero_load_bound_spreads_like_least_backlog_and_a_loose_one_keeps_affinity() -> None:
    requests = _requests(0, rate=50.0)
    common = {"replicas": 4, "blocks_per_replica": 256, "block_size": 16, "prefill_s_per_token": 1 / 12_000}
    tight = plan_oracle(requests, load_bound_s=0.0, **common)  # type: ignore[arg-type]
    loose = plan_oracle(requests, load_bound_s=100.0, **common)  # type: ignore[arg-type]
    assert (loose.hit_rate or 0) >= (tight.hit_rate or 0)
    assert len(set(tight.assignment)) == 4
    with pytest.raises(ValueError):
        plan_oracle(requests, load_bound_s=-1.0, **common)  # type: ignore[arg-type]


def test_the_replay_routes_every_request_where_the_plan_says() -> None:
    config = SimConfig(replicas=3, kv_capacity_tokens=4096)
    requests = _requests(3)[:80]
    plan, result = simulate_oracle(config, requests)
    names = [f"r{i:04d}" for i in range(3)]
    assert [r.replica for r in result.records] == [names[i] for i in plan.assignment]
    with pytest.raises(ValueError):
        simulate_oracle(dataclasses.replace(config, replica_model="step"), requests)
    random.Random(0)  # the plan itself draws nothing


def test_the_lru_replay_routes_as_planned_on_the_engines_own_lru_caches() -> None:
    """The diagnosis' "oracle on LRU engines": same assignment, plain LRU ``BlockCache`` engines
    (the pools overflow, so eviction decides), and it keeps no more than the MIN engines do."""
    config = SimConfig(replicas=4, kv_capacity_tokens=4096)
    requests = _requests(1)
    plan, min_replay = simulate_oracle(config, requests)
    simulation = OracleLruSimulation(config, requests, plan.assignment)
    assert all(type(m.cache) is BlockCache for m in simulation.models.values())
    lru = simulation.run()
    names = [f"r{i:04d}" for i in range(4)]
    assert [r.replica for r in lru.records] == [names[i] for i in plan.assignment]
    assert lru.summary.ok == len(requests)
    assert lru.summary.cached_tokens < min_replay.summary.cached_tokens


def test_simulate_oracle_replays_its_plan_on_lru_engines_when_asked() -> None:
    """``lru_engines=True`` (``kvlb capacity``'s ``oracle_lru``) replays the same plan on the engines'
    LRU caches: the same replicas as the MIN replay, the LRU replay's own hits, fewer than MIN's."""
    config = SimConfig(replicas=4, kv_capacity_tokens=4096)
    requests = _requests(1)
    plan, min_replay = simulate_oracle(config, requests)
    lru_plan, lru_replay = simulate_oracle(config, requests, lru_engines=True)
    assert lru_plan == plan
    assert [r.replica for r in lru_replay.records] == [r.replica for r in min_replay.records]
    direct = OracleLruSimulation(config, requests, plan.assignment).run()
    assert lru_replay.summary.cached_tokens == direct.summary.cached_tokens
    assert lru_replay.summary.cached_tokens < min_replay.summary.cached_tokens
