"""The block-cost policy, its guards and temperature; PolicyWeights validation; the registry."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.errors import ConfigError, NoReplicasAvailable
from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.policy import POLICIES, POLICY_NAMES, CostPolicy, PolicyWeights, RouteRequest, make_policy
from balancer.types import Decision, Overlap, ReplicaId

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
BLOCK = 16


def snapshot(*loads: ReplicaLoad) -> LoadSnapshot:
    return LoadSnapshot(now=0.0, block_size_tokens=BLOCK, replicas={x.replica: x for x in loads})


def route(
    overlaps: dict[ReplicaId, int],
    loads: list[ReplicaLoad] | None = None,
    request_blocks: int = 10,
    seed: int = 0,
    candidates: tuple[ReplicaId, ...] | None = None,
    **weights: Any,
) -> Decision:
    request = RouteRequest(
        candidates=candidates if candidates is not None else tuple(overlaps),
        request_blocks=request_blocks,
        prompt_tokens=request_blocks * BLOCK + 3,
    )
    return CostPolicy()(
        request,
        Overlap(blocks=overlaps, request_blocks=request_blocks),
        snapshot(*(loads or [])),
        PolicyWeights(**{"decode_weight": 1.0, **weights}),  # unit weights keep the arithmetic readable
        random.Random(seed),
    )


def terms_of(decision: Decision) -> dict[ReplicaId, Any]:
    return {t.replica: t for t in decision.terms}


def test_a_tie_says_it_was_drawn_at_random() -> None:
    """The SRE walk of 2026-12-01: ``explain`` named one of two replicas of equal cost and the
    request went to the other; the reason said "argmin" only."""
    plain = {"overlap_credit_loaded": None, "root_weight": 0.0}  # no ramp note in the reason
    assert route({A: 0, B: 0, C: 8}, **plain).reason == "argmin"  # C holds the prefix: no tie
    assert route({A: 0, B: 0}, **plain).reason == "argmin (a tie of 2: drawn at random)"
    assert {route({A: 0, B: 0}, seed=s).replica for s in range(30)} == {A, B}


def test_cache_affinity_wins_between_equal_loads() -> None:
    decision = route({A: 0, B: 8, C: 2})
    assert decision.replica == B
    assert decision.overlap_blocks == 8
    assert decision.cached_tokens == 8 * BLOCK
    assert terms_of(decision)[B].cost == pytest.approx(10 - 8)
    assert terms_of(decision)[A].cost == pytest.approx(10)


def test_load_outweighs_affinity() -> None:
    loads = [ReplicaLoad(B, active_decode_blocks=20)]
    assert route({A: 0, B: 8}, loads).replica == A  # A: 10, B: 2 + 20
    loads = [ReplicaLoad(B, active_decode_blocks=5)]
    assert route({A: 0, B: 8}, loads).replica == B  # A: 10, B: 2 + 5


def test_every_term_follows_the_formula() -> None:
    load = ReplicaLoad(
        A, pending_prefill_tokens=48, pending_prefill_blocks=3.0, active_decode_blocks=7, waiting_reqs=2
    )
    decision = route(
        {A: 4},
        [load],
        prefill_weight=2.0,
        overlap_credit=0.5,
        decode_weight=1.5,
        queue_weight=4.0,
    )
    t = terms_of(decision)[A]
    assert t.prefill_term == pytest.approx(2.0 * (3.0 + 10 - 0.5 * 4))
    assert t.decode_term == pytest.approx(1.5 * 7)
    assert t.queue_term == pytest.approx(4.0 * 2)
    assert t.cost == pytest.approx(t.prefill_term + t.decode_term + t.queue_term)
    assert (t.overlap_blocks, t.request_blocks, t.waiting_requests) == (4, 10, 2.0)
    assert t.probability is None and t.excluded is None


def test_zero_credit_ignores_the_cache() -> None:
    loads = [ReplicaLoad(B, active_decode_blocks=1)]
    assert route({A: 0, B: 10}, loads).replica == B
    assert route({A: 0, B: 10}, loads, overlap_credit=0.0).replica == A


def test_queue_weight_uses_scraped_waiting_and_ignores_unknown() -> None:
    loads = [ReplicaLoad(A, waiting_reqs=3), ReplicaLoad(B, waiting_reqs=None, active_decode_blocks=2)]
    assert route({A: 0, B: 0}, loads).replica == A  # queue ignored by default
    assert route({A: 0, B: 0}, loads, queue_weight=1.0).replica == B  # 3 > 2


def test_overlap_is_clamped_to_the_request() -> None:
    decision = route({A: 50, B: 0}, request_blocks=10)
    assert decision.overlap_blocks == 10
    assert terms_of(decision)[A].prefill_term == pytest.approx(0.0)


def test_dp_rank_and_cached_tokens_come_from_the_chosen_replica() -> None:
    request = RouteRequest(candidates=(A, B), request_blocks=6, prompt_tokens=100)
    overlap = Overlap(blocks={A: 1, B: 5}, best_rank={B: 3}, request_blocks=6)
    decision = CostPolicy()(request, overlap, snapshot(), PolicyWeights(), random.Random(0))
    assert (decision.replica, decision.dp_rank, decision.cached_tokens) == (B, 3, 5 * BLOCK)
    assert decision.policy == "cost"


def test_candidates_without_overlap_or_load_entries_still_count() -> None:
    decision = route({}, candidates=(A, B), seed=3)
    assert {t.replica for t in decision.terms} == {A, B}
    assert decision.overlap_blocks == 0


def test_no_candidates_raises() -> None:
    with pytest.raises(NoReplicasAvailable):
        route({}, candidates=())


# --- KV-usage ceiling ------------------------------------------------------------------------


def test_kv_ceiling_excludes_a_full_replica() -> None:
    loads = [ReplicaLoad(B, kv_usage=0.95), ReplicaLoad(A, kv_usage=0.5)]  # at the ceiling counts
    decision = route({A: 0, B: 10}, loads, kv_usage_ceiling=0.95)
    assert decision.replica == A
    assert terms_of(decision)[B].excluded == "kv_usage>=0.95"
    assert terms_of(decision)[A].excluded is None


def test_kv_ceiling_is_lifted_when_every_candidate_is_full() -> None:
    loads = [ReplicaLoad(A, kv_usage=0.99), ReplicaLoad(B, kv_usage=1.0)]
    decision = route({A: 0, B: 10}, loads, kv_usage_ceiling=0.95)
    assert decision.replica == B
    assert all(t.excluded is None for t in decision.terms)
    assert "guard lifted" in decision.reason


def test_kv_ceiling_ignores_unknown_usage_and_is_off_by_default() -> None:
    loads = [ReplicaLoad(A, kv_usage=None), ReplicaLoad(B, kv_usage=0.99)]
    assert route({A: 0, B: 10}, loads, kv_usage_ceiling=0.95).replica == A
    assert route({A: 0, B: 10}, loads).replica == B
    assert route({A: 0, B: 10}, loads, kv_usage_ceiling=None).replica == B
    assert route({A: 0, B: 10}, loads, kv_usage_ceiling=1.0).replica == B


# --- duplication penalty (overlap_credit > 1) -----------------------------------------------


def test_credit_above_one_keeps_a_prefix_home_against_a_larger_backlog() -> None:
    # A holds 8 of 10 blocks with 12 blocks of prefill queued; B is idle and holds nothing.
    # Credit 1: A costs 12 + 10 - 8 = 14 > B's 10. Credit 2: A costs 12 + 10 - 16 = 6 < 10.
    loads = [ReplicaLoad(A, pending_prefill_blocks=12.0), ReplicaLoad(B)]
    assert route({A: 8, B: 0}, loads).replica == B
    decision = route({A: 8, B: 0}, loads, overlap_credit=2.0)
    assert decision.replica == A
    assert terms_of(decision)[A].prefill_term == pytest.approx(6.0)


def test_credit_above_one_does_not_inflate_the_shared_pending_discount() -> None:
    # all of A's overlap is speculative (a leader still prefilling 20 blocks): shared is capped at
    # the speculative blocks themselves, not credit x them
    loads = [ReplicaLoad(A, pending_prefill_blocks=20.0), ReplicaLoad(B)]
    request = RouteRequest(candidates=(A, B), request_blocks=10, prompt_tokens=10 * BLOCK + 3)
    overlap = Overlap(blocks={A: 8, B: 0}, request_blocks=10, speculative_blocks={A: 8})
    snapshot = LoadSnapshot(now=0.0, block_size_tokens=BLOCK, replicas={x.replica: x for x in loads})
    decision = CostPolicy()(request, overlap, snapshot, PolicyWeights(overlap_credit=2.0), random.Random(0))
    assert terms_of(decision)[A].shared_pending_blocks == pytest.approx(8.0)


# --- imbalance guard -------------------------------------------------------------------------


@pytest.mark.parametrize("floor", [0, 100])
def test_imbalance_guard_withdraws_credit_only_from_the_overloaded_replica(floor: int) -> None:
    loads = [
        ReplicaLoad(A, active_decode_blocks=floor + 60),  # holds most of the prompt but far behind
        ReplicaLoad(B, active_decode_blocks=floor),
        ReplicaLoad(C, active_decode_blocks=floor + 3),  # holds a little, lightly loaded
    ]
    overlaps = {A: 90, B: 0, C: 5}
    assert route(overlaps, loads, request_blocks=100).replica == A  # A: 60 + 10, B: 100, C: 3 + 95 (+ floor)
    guarded = route(overlaps, loads, request_blocks=100, imbalance_threshold_blocks=50.0)
    by_replica = terms_of(guarded)
    assert by_replica[A].prefill_term == pytest.approx(100)  # credit withdrawn
    assert by_replica[C].prefill_term == pytest.approx(95)  # C keeps its affinity
    assert guarded.replica == C  # C: 95 + 3 < B: 100 (both + floor)
    assert "no overlap credit for a" in guarded.reason


@pytest.mark.parametrize("floor", [0, 100])
def test_imbalance_guard_is_quiet_within_the_threshold(floor: int) -> None:
    loads = [ReplicaLoad(A, active_decode_blocks=floor + 40), ReplicaLoad(B, active_decode_blocks=floor)]
    decision = route({A: 50, B: 0}, loads, request_blocks=100, imbalance_threshold_blocks=50.0)
    assert decision.replica == A  # 40 + 50 < 100
    assert "imbalance" not in decision.reason


# --- choice: ties and temperature -------------------------------------------------------------


def test_ties_are_broken_at_random_and_reproducibly() -> None:
    chosen = {
        route({A: 0, B: 0, C: 5}, [ReplicaLoad(C, active_decode_blocks=5)], seed=s).replica for s in range(40)
    }
    assert chosen == {A, B, C}
    assert [route({A: 0, B: 0}, seed=7).replica for _ in range(5)] == [
        route({A: 0, B: 0}, seed=7).replica
    ] * 5


def test_temperature_reports_probabilities_that_sum_to_one() -> None:
    loads = [ReplicaLoad(C, kv_usage=0.99)]
    decision = route({A: 0, B: 10, C: 10}, loads, temperature=0.5, kv_usage_ceiling=0.95)
    by_replica = terms_of(decision)
    assert by_replica[C].probability == 0.0
    assert by_replica[A].probability is not None and by_replica[B].probability is not None
    assert by_replica[A].probability + by_replica[B].probability == pytest.approx(1.0)
    # costs 10 and 0 normalise to z = 1 and 0: p(B) = 1 / (1 + e^(-1/0.5))
    assert by_replica[B].probability == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert decision.reason.startswith("softmax")


def test_temperature_sampling_is_seeded_and_follows_the_softmax() -> None:
    policy, weights = CostPolicy(), PolicyWeights(temperature=1.0)
    request = RouteRequest(candidates=(A, B), request_blocks=10, prompt_tokens=160)
    overlap = Overlap(blocks={A: 0, B: 10}, request_blocks=10)

    def draws(seed: int, n: int) -> list[ReplicaId]:
        rng = random.Random(seed)
        return [policy(request, overlap, snapshot(), weights, rng).replica for _ in range(n)]

    assert draws(11, 50) == draws(11, 50)
    counts = Counter(draws(1234, 4000))
    expected_b = 1 / (1 + math.exp(-1.0))  # ≈ 0.731
    assert counts[B] / 4000 == pytest.approx(expected_b, abs=0.03)


def test_high_temperature_is_nearly_uniform_and_equal_costs_are_uniform() -> None:
    request = RouteRequest(candidates=(A, B, C), request_blocks=10, prompt_tokens=160)
    hot = CostPolicy()(
        request,
        Overlap(blocks={A: 10}, request_blocks=10),
        snapshot(),
        PolicyWeights(temperature=1e6),
        random.Random(0),
    )
    assert all(t.probability == pytest.approx(1 / 3, abs=1e-5) for t in hot.terms)
    equal = route({A: 0, B: 0, C: 0}, temperature=0.1)
    assert all(t.probability == pytest.approx(1 / 3) for t in equal.terms)


# --- properties ------------------------------------------------------------------------------

_replica_input = st.tuples(
    st.integers(0, 20),  # overlap blocks
    st.floats(0, 200, allow_nan=False),  # pending prefill blocks
    st.integers(0, 500),  # active decode blocks
    st.one_of(st.none(), st.integers(0, 30)),  # waiting
    st.one_of(st.none(), st.floats(0, 1)),  # kv usage
)


@settings(max_examples=200, deadline=None)
@given(
    replicas=st.lists(_replica_input, min_size=1, max_size=6),
    temperature=st.sampled_from([0.0, 0.3, 2.0]),
    imbalance=st.one_of(st.none(), st.floats(1, 100)),
    seed=st.integers(0, 2**32),
)
def test_never_picks_an_excluded_replica_and_argmin_is_minimal(
    replicas: list[tuple[int, float, int, int | None, float | None]],
    temperature: float,
    imbalance: float | None,
    seed: int,
) -> None:
    names = [ReplicaId(f"r{i}") for i in range(len(replicas))]
    loads = [
        ReplicaLoad(name, pending_prefill_blocks=p, active_decode_blocks=d, waiting_reqs=w, kv_usage=k)
        for name, (_, p, d, w, k) in zip(names, replicas, strict=True)
    ]
    overlaps = {name: r[0] for name, r in zip(names, replicas, strict=True)}
    decision = route(
        overlaps,
        loads,
        request_blocks=20,
        seed=seed,
        temperature=temperature,
        imbalance_threshold_blocks=imbalance,
        queue_weight=2.0,
    )
    chosen = terms_of(decision)[decision.replica]
    eligible = [t for t in decision.terms if t.excluded is None]
    assert eligible, "the KV guard never excludes every candidate"
    assert chosen.excluded is None
    if temperature == 0:
        assert chosen.cost is not None
        assert chosen.cost <= min(t.cost for t in eligible if t.cost is not None) + 1e-6
    else:
        assert sum(t.probability or 0.0 for t in decision.terms) == pytest.approx(1.0)


# --- weights -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prefill_weight", -1.0),
        ("overlap_credit", 4.5),
        ("overlap_credit", -0.1),
        ("decode_weight", math.nan),
        ("queue_weight", math.inf),
        ("temperature", -0.1),
        ("kv_usage_ceiling", 0.0),
        ("kv_usage_ceiling", 1.01),
        ("imbalance_threshold_blocks", 0.0),
        ("cache_threshold", 2.0),
        ("balance_abs_threshold", -1.0),
        ("balance_rel_threshold", 0.5),
        ("duplication_weight", 4.5),
        ("duplication_weight", -0.1),
        ("decode_weight", True),
        ("decode_weight", "1"),
        ("temperature", None),
    ],
)
def test_bad_weights_are_refused_with_the_field_name(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        PolicyWeights(**{field: value})
    with pytest.raises(ConfigError, match=field):
        PolicyWeights().replace(**{field: value})


def test_replace_validates_coerces_and_keeps_the_original() -> None:
    weights = PolicyWeights()
    changed = weights.replace(temperature=1, kv_usage_ceiling=None)
    assert changed.temperature == 1.0 and isinstance(changed.temperature, float)
    assert changed.kv_usage_ceiling is None
    assert weights.temperature == 0.0 and weights.kv_usage_ceiling is None
    with pytest.raises(ConfigError, match="unknown policy weight"):
        weights.replace(temprature=1.0)


def test_dict_round_trip_and_partial_updates() -> None:
    weights = PolicyWeights(decode_weight=0.5, imbalance_threshold_blocks=128.0)
    assert PolicyWeights.from_dict(weights.to_dict()) == weights
    partial = PolicyWeights.from_dict({"queue_weight": 4}, base=weights)
    assert (partial.queue_weight, partial.decode_weight) == (4.0, 0.5)
    assert PolicyWeights.from_dict({}) == PolicyWeights()
    with pytest.raises(ConfigError):
        PolicyWeights.from_dict({"nope": 1})


def test_defaults_follow_dynamo_except_decode_and_duplication_weights() -> None:
    weights = PolicyWeights()
    assert (weights.overlap_credit, weights.prefill_weight, weights.temperature) == (1.0, 1.0, 0.0)
    assert weights.decode_weight == 0.1  # chosen by the simulator sweep in docs/policies.md
    assert weights.duplication_weight == 1.0  # kvlb's own term, ibid.


def test_registry_builds_fresh_named_instances() -> None:
    assert set(POLICIES) == set(POLICY_NAMES)
    for name in POLICY_NAMES:
        first, second = make_policy(name), POLICIES[name]()
        assert first.name == second.name == name
        assert first is not second
    with pytest.raises(ConfigError, match="unknown policy"):
        make_policy("fastest")
