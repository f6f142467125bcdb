"""The credit ramp's memory in seconds (``ramp_memory_s``, 0.2 s by default since 2026-11-30, off
before): the weight, the pure average in time, the credit reading it, planning that stores nothing
and commitment that stores the average, its time and the held share, the instant share's decisions
with the weight off (the previous default), and the simulator agreeing with the service's router
decision by decision."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from balancer.errors import ConfigError
from balancer.events import Stored
from balancer.health.book import HealthBook
from balancer.index.hashing import pack_tokens
from balancer.index.slots import TableLimits
from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.policy import CostPolicy, PolicyWeights, RouteRequest
from balancer.policy.cost import ShareAverage, loaded_credit, time_averaged_share
from balancer.policy.registry import make_policy
from balancer.routing.router import PoolRequest, PoolRouter, RouteLimits
from balancer.types import Decision, EngineHash, Overlap, ReplicaId
from loadtests.simulate.routing import SimRouter

A, B, C, D = ReplicaId("a"), ReplicaId("b"), ReplicaId("c"), ReplicaId("d")
BLOCK = 16


def _busy(replica: ReplicaId, blocks: float = 4.0) -> ReplicaLoad:
    return ReplicaLoad(replica, pending_prefill_seqs=1, pending_prefill_blocks=blocks)


def _decide(
    prior: float | None,
    loads: list[ReplicaLoad],
    *,
    prior_at_s: float | None = None,
    prior_last: float | None = None,
    now_s: float = 0.0,
    **weights: float | None,
) -> Decision:
    request = RouteRequest(
        candidates=(A, B, C, D),
        request_blocks=10,
        prompt_tokens=10 * BLOCK,
        ramp_share=prior,
        ramp_at_s=prior_at_s,
        ramp_last_share=prior_last,
    )
    overlap = Overlap(blocks={A: 8}, request_blocks=10)
    snapshot = LoadSnapshot(now=now_s, block_size_tokens=BLOCK, replicas={x.replica: x for x in loads})
    return CostPolicy()(request, overlap, snapshot, PolicyWeights(**weights), random.Random(0))  # type: ignore[arg-type]


def _pool(seed: int) -> PoolRouter:
    health = HealthBook()
    for replica in (A, B, C, D):
        health.add(replica, probe_ok=True)
    limits = RouteLimits(max_inflight_per_replica=10_000)
    pool = PoolRouter("m", health=health, route_limits=limits, rng=random.Random(seed))
    for n, replica in enumerate((A, B, C, D)):
        pool.add_replica(replica, BLOCK, "plain")
        tokens = list(range(1000 * (n + 1), 1000 * (n + 1) + 8 * BLOCK))
        hashes = tuple(EngineHash(100 * n + i) for i in range(8))
        pool.space_of[replica].table.apply(
            replica, [Stored(0, None, hashes, pack_tokens(tokens), BLOCK)], 0.0
        )
    return pool


def _tokens(rng: random.Random) -> list[int]:
    n = rng.randrange(4)
    return [
        *range(1000 * (n + 1), 1000 * (n + 1) + rng.choice([4, 8]) * BLOCK),
        *rng.sample(range(50_000), 48),
    ]


def _stream(pool: PoolRouter, weights: PolicyWeights, seed: int, n: int = 300) -> list[Decision]:
    policy, rng, leases, decisions = make_policy("cost"), random.Random(seed), [], []
    for k in range(n):
        now = 1.0 + 0.01 * k
        lease = pool.route(PoolRequest(_tokens(rng), policy, weights, f"q{k}", max_tokens=32), now)
        decisions.append(lease.plan.decision)
        leases.append(lease)
        if rng.random() < 0.6:
            leases[rng.randrange(len(leases))].first_token(now)
        if rng.random() < 0.5:
            leases.pop(rng.randrange(len(leases))).release(now)
    return decisions


def _sim(prune: bool, weights: PolicyWeights) -> SimRouter:
    names = [ReplicaId(f"r{i:02d}") for i in range(12)]
    router = SimRouter(
        names, model="m", block_size=4, policy="cost", weights=weights, rng=random.Random(5),
        limits=TableLimits(), max_inflight_per_replica=6, prune=prune, prune_k=2,
    )  # fmt: skip
    for n, replica in enumerate(names):
        tokens = list(range(1000 * (n % 4 + 1), 1000 * (n % 4 + 1) + 4 * (n % 5 + 1)))
        hashes = tuple(EngineHash(100 * n + i) for i in range(n % 5 + 1))
        router.apply(replica, [Stored(0, None, hashes, pack_tokens(tokens), 4)], 0.0)
    return router


def test_the_simulator_averages_as_the_service_does() -> None:
    """The simulator's pruned router counts the busy share over the fleet and advances the same
    average (:class:`ShareAverage`, in model seconds) at each committed decision; unpruned, the
    policy ramps on its own and the service's :class:`PoolRouter` keeps the average. The same
    stream gives the same averages and the same choices."""
    weights = PolicyWeights(ramp_memory_s=0.05)
    pruned, full = _sim(True, weights), _sim(False, weights)
    rng = random.Random(9)
    live: list[tuple[str, ReplicaId]] = []
    ramped = 0
    for k in range(400):
        now = 1.0 + 0.01 * k
        tokens = [
            *range(1000 * (k % 4 + 1), 1000 * (k % 4 + 1) + rng.choice([4, 12, 20])),
            *rng.sample(range(9000), 9),
        ]
        max_tokens = rng.randrange(1, 64)
        a = pruned.route(f"q{k}", tokens, max_tokens, None, now)
        b = full.route(f"q{k}", tokens, max_tokens, None, now)
        assert a.decision.replica == b.decision.replica, k
        assert pruned.ramp_average.share == full.router.ramp_average.share == b.decision.ramp_share
        ramped += pruned.plan_weights(pruned.ramp_average).overlap_credit > 1.0
        live.append((f"q{k}", a.decision.replica))
        if rng.random() < 0.7:
            rid, replica = live[rng.randrange(len(live))]
            pruned.first_token(rid, replica, now)
            full.first_token(rid, replica, now)
        if rng.random() < 0.55 or len(live) > 40:
            rid, replica = live.pop(rng.randrange(len(live)))
            pruned.release(rid, replica, now)
            full.release(rid, replica, now)
    assert full.router.ramp_average.share is not None
    assert ramped > 20  # the average was on the ramp
    assert pruned.counters.pruned > 100


def test_the_memory_in_seconds_is_on_by_default_validated_and_nullable() -> None:
    assert PolicyWeights().ramp_memory_s == 0.2  # docs/policy-studies.md "Part 33"
    assert PolicyWeights.from_dict({"ramp_memory_s": None}).ramp_memory_s is None  # the previous one
    assert PolicyWeights.from_dict({"ramp_memory_s": 0.3}).ramp_memory_s == 0.3
    on = PolicyWeights(ramp_memory_s=0.3)
    assert PolicyWeights.from_dict({"ramp_memory_s": None}, base=on).ramp_memory_s is None
    assert PolicyWeights.from_dict(on.to_dict()) == on
    for good in (0.0, 0.05, 1.0, 60.0):
        assert PolicyWeights(ramp_memory_s=good).ramp_memory_s == good
    for bad in (-0.1, 60.5, float("inf"), float("nan"), True, "0.3"):
        with pytest.raises(ConfigError, match="ramp_memory_s"):
            PolicyWeights().replace(ramp_memory_s=bad)
    with pytest.raises(ConfigError, match=r"unknown policy weight.*ramp_memory_decisions"):
        PolicyWeights.from_dict({"ramp_memory_decisions": 10})  # the memory in decisions is gone


def test_the_average_in_time_holds_the_previous_share_over_the_elapsed_seconds() -> None:
    tau = 0.3
    first = ShareAverage().advanced_to(0.7, 5.0, tau)  # the first decision: its own share
    assert first == ShareAverage(0.7, 5.0, 0.7)
    second = first.advanced_to(0.2, 5.3, tau)  # holds 0.7 (the first's share) over 0.3 s: no move
    assert second.share == pytest.approx(0.7) and (second.at_s, second.last_share) == (5.3, 0.2)
    third = second.advanced_to(1.0, 5.3 + tau, tau)  # holds 0.2 over τ: α = 1 − e^−1
    assert third.share == pytest.approx(0.7 + (1.0 - math.exp(-1.0)) * (0.2 - 0.7))
    assert third.last_share == 1.0
    assert time_averaged_share(0.5, 1.0, 1.0, 1.0, tau) == 0.5  # Δt = 0: a burst moves nothing
    assert time_averaged_share(0.5, 1.0, 1.0, 0.4, tau) == 0.5  # a negative Δt counts as 0
    assert time_averaged_share(0.5, 1.0, 1.0, 1.0 + 40 * tau, tau) == pytest.approx(1.0)  # forgotten
    for off in (0.0, -1.0):
        assert time_averaged_share(0.5, 1.0, 0.2, 1.1, off) == 0.2  # no memory: the held share
    # the same held share over two steps of Δt is one step of 2·Δt (the memory is in time, not steps)
    start = ShareAverage(0.25, 2.0, 1.0)
    twice = start.advanced_to(1.0, 2.1, tau).advanced_to(1.0, 2.2, tau)
    once = start.advanced_to(1.0, 2.2, tau)
    assert twice.share == pytest.approx(once.share) and twice.at_s == once.at_s == 2.2
    assert start == ShareAverage(0.25, 2.0, 1.0)  # a value: advancing returns a new one


def test_the_credit_reads_the_average_in_time_and_the_note_names_tau() -> None:
    every = [_busy(A, 12.0), _busy(B), _busy(C), _busy(D)]  # 4/4 prefilling: instant credit 4
    instant = _decide(0.5, every, prior_at_s=1.0, prior_last=1.0, now_s=1.3, ramp_memory_s=None)
    assert instant.ramp_share is instant.busy_share is None
    assert "credit 4 (4/4 replicas prefilling)" in instant.reason
    later = _decide(0.5, every, prior_at_s=1.0, prior_last=1.0, now_s=1.3, ramp_memory_s=0.3)
    expected = 0.5 + (1.0 - math.exp(-1.0)) * 0.5  # 0.816: on the ramp
    assert later.ramp_share == pytest.approx(expected) and later.busy_share == 1.0
    assert later.ramp_share is not None
    credit = loaded_credit(1.0, 4.0, later.ramp_share)  # the credit reads the average, not 4/4
    assert {t.overlap_credit for t in later.terms} == {credit} and 1.0 < credit < 4.0
    assert f"credit {credit:.3g} (4/4 replicas prefilling, averaged 0.82 over 0.3 s)" in later.reason
    held = _decide(0.5, every, prior_at_s=1.0, prior_last=0.5, now_s=1.3, ramp_memory_s=0.3)
    assert held.ramp_share == 0.5  # the previous decision saw 0.5: this one's 4/4 enters next time
    burst = _decide(0.5, every, prior_at_s=1.3, prior_last=1.0, now_s=1.3, ramp_memory_s=0.3)
    assert burst.ramp_share == 0.5 and {t.overlap_credit for t in burst.terms} == {1.0}  # Δt = 0
    first = _decide(None, every, now_s=1.3, ramp_memory_s=0.3)
    assert first.ramp_share == 1.0 and "averaged 1.00 over 0.3 s" in first.reason
    for off in (None, 0.0):
        assert _decide(0.5, every, prior_at_s=1.0, prior_last=1.0, now_s=1.3, ramp_memory_s=off) == instant


def test_planning_stores_nothing_and_commitment_stores_the_average_and_its_time() -> None:
    pool = _pool(0)
    weights = PolicyWeights(ramp_memory_s=0.3)
    policy = make_policy("cost")
    rng = random.Random(1)
    for k in range(30):
        now = 1.0 + 0.05 * k
        before = pool.ramp_average
        request = PoolRequest(_tokens(rng), policy, weights, f"q{k}")
        plan = pool.select(request, now)
        again = pool.select(request, now)
        assert pool.ramp_average is before  # two plans, nothing stored
        assert plan.decision.ramp_share == again.decision.ramp_share is not None
        assert plan.inputs is not None
        given = plan.inputs.request
        assert (given.ramp_share, given.ramp_at_s, given.ramp_last_share) == (
            before.share,
            before.at_s,
            before.last_share,
        )
        pool.lease(plan, f"q{k}", now)
        assert pool.ramp_average == ShareAverage(plan.decision.ramp_share, now, plan.decision.busy_share)
    assert 0.0 < (pool.ramp_average.share or 0.0) < 1.0


def test_a_memory_in_seconds_much_shorter_than_the_gaps_holds_the_previous_decisions_share() -> None:
    """On a seeded stream through the real router (a decision every 10 ms): τ ``None`` and 0 decide
    exactly alike (the instant share, the default before 2026-11-30); with τ = 1 µs each decision's
    credit reads the share the previous decision saw (α = 1 − e^−10⁴); τ = 0.3 s and the default
    0.2 s change some choices."""
    for seed in range(3):
        instant = _stream(_pool(seed), PolicyWeights(ramp_memory_s=None), seed)
        assert _stream(_pool(seed), PolicyWeights(ramp_memory_s=0.0), seed) == instant
        assert all(d.ramp_share is d.busy_share is None for d in instant)
        default = _stream(_pool(seed), PolicyWeights(), seed)
        assert default == _stream(_pool(seed), PolicyWeights(ramp_memory_s=0.2), seed)
        assert [d.replica for d in default] != [d.replica for d in instant]
        tiny = _stream(_pool(seed), PolicyWeights(ramp_memory_s=1e-6), seed)
        assert tiny[0].ramp_share == tiny[0].busy_share is not None
        for before, after in itertools.pairwise(tiny):
            assert after.ramp_share == pytest.approx(before.busy_share)
        assert any(d.ramp_share != d.busy_share for d in tiny)  # the held share is not the instant one
        remembered = _stream(_pool(seed), PolicyWeights(ramp_memory_s=0.3), seed)
        assert [d.replica for d in remembered] != [d.replica for d in instant]
