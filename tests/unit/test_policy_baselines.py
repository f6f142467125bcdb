"""Baseline policies: round robin, random, least load, power of two, session, SGLang threshold."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from balancer.errors import NoReplicasAvailable
from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.policy import (
    POLICY_NAMES,
    LeastLoad,
    Policy,
    PolicyWeights,
    PowerOfTwo,
    RandomChoice,
    RoundRobin,
    RouteRequest,
    Session,
    SglangThreshold,
    make_policy,
)
from balancer.policy.baselines import session_owner
from balancer.types import Decision, Overlap, ReplicaId

A, B, C, D = (ReplicaId(x) for x in "abcd")
BLOCK = 16


def call(
    policy: Policy,
    candidates: tuple[ReplicaId, ...],
    loads: list[ReplicaLoad] | None = None,
    overlaps: dict[ReplicaId, int] | None = None,
    request_blocks: int = 10,
    session_key: str | None = None,
    rng: random.Random | None = None,
    rotation: int = 0,
    **weights: Any,
) -> Decision:
    request = RouteRequest(
        candidates=candidates,
        request_blocks=request_blocks,
        prompt_tokens=request_blocks * BLOCK,
        session_key=session_key,
        rotation=rotation,
    )
    return policy(
        request,
        Overlap(blocks=overlaps or {}, request_blocks=request_blocks),
        LoadSnapshot(now=0.0, block_size_tokens=BLOCK, replicas={x.replica: x for x in loads or []}),
        PolicyWeights(**weights),
        rng if rng is not None else random.Random(0),
    )


def busy(replica: ReplicaId, in_flight: int = 0, waiting: int | None = None) -> ReplicaLoad:
    return ReplicaLoad(replica, active_decode_seqs=in_flight, waiting_reqs=waiting)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_explains_every_candidate(name: str) -> None:
    decision = call(make_policy(name), (A, B, C), overlaps={B: 4}, loads=[busy(A, 2)])
    assert decision.policy == name
    assert [t.replica for t in decision.terms] == [A, B, C]
    assert decision.replica in (A, B, C)
    assert decision.cached_tokens == decision.overlap_blocks * BLOCK
    assert {t.replica: t.overlap_blocks for t in decision.terms} == {A: 0, B: 4, C: 0}
    with pytest.raises(NoReplicasAvailable):
        call(make_policy(name), ())


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_decides_alike_when_asked_again(name: str) -> None:
    """Asking is side-effect free (a dry run moves nothing): the same inputs and an rng in the same
    state give the same decision, however often the policy was asked before."""
    policy = make_policy(name)
    first = [
        call(policy, (A, B, C), overlaps={B: 4}, session_key="k", rng=random.Random(3)) for _ in range(4)
    ]
    assert all(decision == first[0] for decision in first)


def test_round_robin_takes_the_routers_rotation_and_keeps_no_state() -> None:
    policy = RoundRobin()
    assert [call(policy, (A, B, C), rotation=k).replica for k in range(4)] == [A, B, C, A]
    assert [call(policy, (A, B, C)).replica for _ in range(3)] == [A, A, A]  # asking moves nothing
    assert call(policy, (A, B), rotation=5).replica == B  # wraps over the smaller set
    assert all(t.cost is None for t in call(policy, (A, B)).terms)


def test_random_is_seeded_uniform() -> None:
    policy = RandomChoice()
    rng = random.Random(5)
    picks = [call(policy, (A, B, C), rng=rng).replica for _ in range(3000)]
    rng_again = random.Random(5)
    assert picks[:20] == [call(policy, (A, B, C), rng=rng_again).replica for _ in range(20)]
    for replica in (A, B, C):
        assert Counter(picks)[replica] / 3000 == pytest.approx(1 / 3, abs=0.03)
    assert all(t.probability == pytest.approx(1 / 3) for t in call(policy, (A, B, C)).terms)


def test_least_load_counts_in_flight_plus_waiting() -> None:
    loads = [busy(A, in_flight=1, waiting=3), busy(B, in_flight=3), busy(C, in_flight=2, waiting=2)]
    decision = call(LeastLoad(), (A, B, C), loads)
    assert decision.replica == B
    assert {t.replica: t.cost for t in decision.terms} == {A: 4.0, B: 3.0, C: 4.0}


def test_least_load_breaks_ties_at_random() -> None:
    loads = [busy(A, 1), busy(B, 1), busy(C, 5)]
    picks = {call(LeastLoad(), (A, B, C), loads, rng=random.Random(s)).replica for s in range(30)}
    assert picks == {A, B}
    # the reason says so: an explanation of the same request may name the other one (SRE walk)
    assert call(LeastLoad(), (A, B, C), loads).reason == "fewest requests (a tie of 2: drawn at random)"
    assert call(LeastLoad(), (A, C), loads).reason == "fewest requests"


def test_power_of_two_picks_the_lighter_of_its_sample() -> None:
    loads = [busy(A, 5), busy(B, 1), busy(C, 3)]
    for seed in range(30):
        decision = call(PowerOfTwo(), (A, B, C), loads, rng=random.Random(seed))
        sampled = {t.replica: t.cost for t in decision.terms if t.excluded is None}
        assert len(sampled) == 2
        assert decision.replica == min(sampled, key=lambda r: sampled[r] or 0.0)
        unsampled = [t for t in decision.terms if t.excluded is not None]
        assert [t.excluded for t in unsampled] == ["not sampled"] and unsampled[0].cost is None
    # The most loaded replica can never win; the least loaded wins whenever sampled (2 of 3 draws).
    picks = Counter(call(PowerOfTwo(), (A, B, C), loads, rng=random.Random(s)).replica for s in range(300))
    assert picks[A] == 0
    assert picks[B] / 300 == pytest.approx(2 / 3, abs=0.08)


def test_power_of_two_with_two_candidates_compares_both() -> None:
    loads = [busy(A, 4), busy(B, 1)]
    assert {call(PowerOfTwo(), (A, B), loads, rng=random.Random(s)).replica for s in range(10)} == {B}


def test_session_is_sticky_and_spreads_keys() -> None:
    policy = Session()
    owners = Counter(call(policy, (A, B, C, D), session_key=f"user-{i}").replica for i in range(800))
    assert all(count / 800 == pytest.approx(1 / 4, abs=0.06) for count in owners.values())
    # Sticky regardless of load and of the rng.
    first = call(policy, (A, B, C, D), session_key="alice").replica
    loads = [busy(first, 100)]
    assert call(policy, (A, B, C, D), loads, session_key="alice", rng=random.Random(9)).replica == first


def test_session_removal_moves_only_the_removed_replicas_sessions() -> None:
    keys = [f"s{i}" for i in range(600)]
    before = {k: session_owner(k, [A, B, C, D]) for k in keys}
    after = {k: session_owner(k, [A, B, D]) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == C}
    grown = {k: session_owner(k, [A, B, C, D, ReplicaId("e")]) for k in keys}
    gained = [k for k in keys if grown[k] != before[k]]
    assert all(grown[k] == "e" for k in gained)
    assert len(gained) / len(keys) == pytest.approx(1 / 5, abs=0.06)


def test_session_without_key_falls_back_to_least_load() -> None:
    loads = [busy(A, 3), busy(B, 0), busy(C, 2)]
    for key in (None, ""):
        decision = call(Session(), (A, B, C), loads, session_key=key)
        assert decision.replica == B
        assert "no session key" in decision.reason


# --- sglang_threshold ------------------------------------------------------------------------


def test_sglang_imbalanced_goes_to_the_least_loaded_despite_the_cache() -> None:
    loads = [busy(A, 100), busy(B, 20), busy(C, 30)]
    decision = call(SglangThreshold(), (A, B, C), loads, overlaps={A: 10})
    assert decision.replica == B  # 100 - 20 > 64 and 100 > 1.5 · 20
    assert decision.reason.startswith("imbalanced")


def test_sglang_relative_threshold_keeps_a_busy_fleet_balanced() -> None:
    loads = [busy(A, 300), busy(B, 230)]  # diff 70 > 64 but 300 <= 1.5 · 230
    decision = call(SglangThreshold(), (A, B), loads, overlaps={A: 10})
    assert decision.replica == A
    assert "best match" in decision.reason


def test_sglang_best_match_above_threshold_ties_to_fewer_requests() -> None:
    loads = [busy(A, 5), busy(B, 2), busy(C, 0)]
    decision = call(SglangThreshold(), (A, B, C), loads, overlaps={A: 4, B: 4, C: 1})
    assert decision.replica == B  # match 0.4 > 0.3; A and B tie on overlap, B has fewer requests
    assert {t.replica: t.cost for t in decision.terms} == {A: 5.0, B: 2.0, C: 0.0}


def test_sglang_low_match_goes_to_the_least_loaded() -> None:
    loads = [busy(A, 5), busy(B, 2)]
    decision = call(SglangThreshold(), (A, B), loads, overlaps={A: 3})
    assert decision.replica == B  # match 0.3 is not > 0.3
    assert call(SglangThreshold(), (A, B), loads, overlaps={A: 1}, cache_threshold=0.0).replica == A
    assert call(SglangThreshold(), (A, B), loads, overlaps={}, cache_threshold=0.0).replica == B
    assert call(SglangThreshold(), (A, B), loads, overlaps={A: 0}, request_blocks=0).replica == B


def test_sglang_thresholds_are_tunable() -> None:
    loads = [busy(A, 30), busy(B, 10)]
    assert call(SglangThreshold(), (A, B), loads, overlaps={A: 10}).replica == A
    tight = call(SglangThreshold(), (A, B), loads, overlaps={A: 10}, balance_abs_threshold=8.0)
    assert tight.replica == B
