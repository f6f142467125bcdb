"""The cost policy's hot-replica release (``hot_demand_ratio``): a replica whose time-decayed
uncached prefill demand exceeds that multiple of the fleet mean gets an overlap credit of at most 1,
so a sticky credit keeps contexts home unless their home is persistently overloaded; and the load
tracker's decayed demand it reads (docs/policies.md, Part 12)."""

from __future__ import annotations

import random

import pytest
from policy_cases import route, terms_of

from balancer.errors import ConfigError
from balancer.index.slots import TableLimits
from balancer.load.tracker import LoadConfig, LoadTracker, ReplicaLoad
from balancer.policy import PolicyWeights
from balancer.policy.cost import hot_replicas
from balancer.service.decisions import terms_by_replica
from balancer.types import ReplicaId
from loadtests.simulate.routing import SimRouter

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
STICKY = {"overlap_credit": 4.0, "duplication_weight": 0.0, "interference_weight": 0.0}
"""A credit that keeps a context home until its home is 4 × its size behind (the charges off, so
the costs below are the prefill term alone)."""


def home_behind(demand_a: float, demand_b: float) -> list[ReplicaLoad]:
    """A holds the request's 10-block context and has 30 blocks of prefill queued; B holds nothing
    and is idle. ``demand_*``: each one's recent uncached prefill demand in tokens."""
    return [
        ReplicaLoad(A, pending_prefill_reqs=2, pending_prefill_blocks=30.0, recent_prefill_tokens=demand_a),
        ReplicaLoad(B, recent_prefill_tokens=demand_b),
    ]


def test_off_by_default() -> None:
    assert PolicyWeights().hot_demand_ratio is None
    decision = route({A: 10, B: 0}, home_behind(9000.0, 1000.0), **STICKY)
    assert decision.replica == A  # 30 + 10 − 4·10 = 0 against 10: the sticky credit keeps it home
    assert terms_of(decision)[A].overlap_credit == 4.0


def test_a_replica_behind_for_a_moment_keeps_its_contexts() -> None:
    """Behind now (30 blocks queued) but not over the recent demand: the sticky credit stands."""
    decision = route({A: 10, B: 0}, home_behind(1200.0, 1000.0), hot_demand_ratio=1.5, **STICKY)
    assert decision.replica == A
    assert terms_of(decision)[A].overlap_credit == 4.0
    assert "hot" not in decision.reason


def test_a_persistently_hot_replica_gets_credit_1_and_its_context_is_copied() -> None:
    """A took 9,000 of the last 10,000 uncached tokens (1.8 × the mean of 5,000): credit 1 there,
    so A costs 30 + 10 − 10 = 30 against B's 10, as with the default credit."""
    decision = route({A: 10, B: 0}, home_behind(9000.0, 1000.0), hot_demand_ratio=1.5, **STICKY)
    terms = terms_of(decision)
    assert decision.replica == B
    assert terms[A].overlap_credit == 1.0 and terms[B].overlap_credit == 4.0
    assert terms[A].prefill_term == pytest.approx(30.0)
    assert terms[B].prefill_term == pytest.approx(10.0)
    assert "hot, credit ≤ 1: a (1.8× mean demand)" in decision.reason
    assert terms_by_replica(decision.terms)[A]["overlap_credit"] == 1.0  # the explanation carries it
    # the same demand under a ratio it does not exceed: home
    assert route({A: 10, B: 0}, home_behind(9000.0, 1000.0), hot_demand_ratio=2.0, **STICKY).replica == A


def test_the_cap_never_raises_a_credit_or_restores_a_withdrawn_one() -> None:
    loads = home_behind(9000.0, 1000.0)
    low = route({A: 10, B: 0}, loads, hot_demand_ratio=1.5, overlap_credit=0.5)
    assert terms_of(low)[A].overlap_credit == 0.5
    guarded = route({A: 10, B: 0}, loads, hot_demand_ratio=1.5, imbalance_threshold_blocks=5.0, **STICKY)
    assert terms_of(guarded)[A].overlap_credit == 0.0


def test_hot_replicas_need_a_fleet_and_some_demand() -> None:
    assert hot_replicas([ReplicaLoad(A, recent_prefill_tokens=5000.0)], 1.1) == {}
    assert hot_replicas([ReplicaLoad(A), ReplicaLoad(B)], 1.1) == {}
    loads = [
        ReplicaLoad(A, recent_prefill_tokens=600.0),
        ReplicaLoad(B, recent_prefill_tokens=200.0),
        ReplicaLoad(C),
    ]
    assert hot_replicas(loads, 2.0) == {A: pytest.approx(2.25)}  # mean 266.7
    assert hot_replicas(loads, 3.0) == {}


@pytest.mark.parametrize("value", [1.0, 0.5, 101.0, float("nan")])
def test_out_of_range_ratios_are_refused(value: float) -> None:
    with pytest.raises(ConfigError, match="hot_demand_ratio"):
        PolicyWeights(hot_demand_ratio=value)


def test_demand_adds_up_and_halves_every_half_life() -> None:
    tracker = LoadTracker(LoadConfig(demand_half_life_s=10.0))
    tracker.reserve("r1", A, 1000, 10, now=0.0)
    tracker.reserve("r2", A, 600, 10, now=10.0)  # 500 left of the first, plus 600
    assert tracker.recent_prefill_tokens(A, 10.0) == pytest.approx(1100.0)
    assert tracker.recent_prefill_tokens(A, 30.0) == pytest.approx(275.0)
    assert tracker.snapshot(30.0).of(A).recent_prefill_tokens == pytest.approx(275.0)
    tracker.release("r1", 31.0)
    tracker.release("r2", 31.0)  # released: no load in flight, but the demand stays and decays
    assert tracker.recent_prefill_tokens(A, 40.0) == pytest.approx(137.5)
    assert tracker.recent_prefill_tokens(B, 30.0) == 0.0
    tracker.forget(A)
    assert tracker.recent_prefill_tokens(A, 30.0) == 0.0


def test_demand_is_kept_for_at_most_max_replicas() -> None:
    tracker = LoadTracker(LoadConfig(max_replicas=2, demand_half_life_s=1.0))
    tracker.reserve("1", A, 100, 1, now=0.0)
    tracker.reserve("2", B, 100, 1, now=0.0)
    tracker.reserve("3", C, 100, 1, now=1.0)  # A and B still hold 50 tokens each: C is ignored
    assert tracker.recent_prefill_tokens(C, 1.0) == 0.0
    assert tracker.stats().ignored_demand_total == 1
    tracker.reserve("4", C, 100, 1, now=20.0)  # A and B decayed below one token: dropped for C
    assert tracker.recent_prefill_tokens(C, 20.0) == pytest.approx(100.0)
    assert tracker.stats().ignored_demand_total == 1


def test_bad_half_life_is_refused() -> None:
    with pytest.raises(ConfigError, match="demand_half_life_s"):
        LoadTracker(LoadConfig(demand_half_life_s=0.0))


def test_the_simulator_gives_the_rule_every_replica_and_the_demand() -> None:
    """Which replicas are hot depends on the mean over every eligible replica, so the simulator
    does not prune the candidates; its sharded tracker keeps each replica's demand."""
    names = [ReplicaId(f"r{i}") for i in range(6)]
    weights = PolicyWeights(overlap_credit=4.0, hot_demand_ratio=1.5)
    router = SimRouter(
        names, model="m", block_size=4, policy="cost", weights=weights, rng=random.Random(0),
        limits=TableLimits(), max_inflight_per_replica=50,
    )  # fmt: skip
    assert router.candidates([1, 2, 3, 4], 0.0) == names
    context = list(range(100, 140))
    plans = [
        router.route(f"q{n}", [*context, 1000 + n, 2000 + n, 3000 + n, 4000 + n], 4, None, n * 0.1)
        for n in range(12)
    ]
    home = plans[0].decision.replica
    assert router.tracker.load_of(home, 1.2).recent_prefill_tokens > 0
    hot = [p.decision for p in plans if "hot" in p.decision.reason]
    assert hot  # the home took all the demand: it is hot, and the others then take copies
    assert any(p.decision.replica != home for p in plans)
