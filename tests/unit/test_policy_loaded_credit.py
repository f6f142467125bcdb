"""The cost policy's load-dependent credit (``overlap_credit_loaded``, default 4 since
2026-11-29): the overlap credit moves from ``overlap_credit`` on a fleet with idle replicas to
``overlap_credit_loaded`` on one where every replica has prefill in flight."""

from __future__ import annotations

import pytest
from policy_cases import route, terms_of

from balancer.errors import ConfigError
from balancer.load.tracker import ReplicaLoad
from balancer.policy import PolicyWeights
from balancer.policy.cost import BUSY_FULL_SHARE, BUSY_START_SHARE, busy_share, credit_ramps, loaded_credit
from balancer.types import ReplicaId

A, B, C, D = ReplicaId("a"), ReplicaId("b"), ReplicaId("c"), ReplicaId("d")


def busy(replica: ReplicaId, blocks: float) -> ReplicaLoad:
    return ReplicaLoad(replica, pending_prefill_seqs=1, pending_prefill_blocks=blocks)


@pytest.mark.parametrize(
    ("share", "expected"),
    [
        (0.0, 1.0),  # idle fleet: overlap_credit
        (0.5, 1.0),
        (BUSY_START_SHARE, 1.0),  # the ramp's start
        ((BUSY_START_SHARE + BUSY_FULL_SHARE) / 2, 2.0),  # halfway
        (BUSY_FULL_SHARE, 3.0),  # every replica prefilling: overlap_credit_loaded
        (1.5, 3.0),  # clamped
        (-1.0, 1.0),
    ],
)
def test_ramp_and_its_endpoints(share: float, expected: float) -> None:
    assert loaded_credit(1.0, 3.0, share) == pytest.approx(expected)


def test_ramp_may_go_down_and_is_flat_when_equal() -> None:
    assert loaded_credit(2.0, 0.0, BUSY_FULL_SHARE) == 0.0
    assert loaded_credit(2.0, 0.0, BUSY_START_SHARE) == 2.0
    for share in (0.0, 0.8, 1.0):
        assert loaded_credit(1.5, 1.5, share) == 1.5


def test_busy_share_counts_replicas_with_prefill_in_flight() -> None:
    loads = [busy(A, 3.0), ReplicaLoad(B, active_decode_seqs=4), busy(C, 0.0), ReplicaLoad(D)]
    assert busy_share(loads) == (2, 0.5)  # a decoding replica is not prefilling; a fully cached prompt is
    assert busy_share([]) == (0, 0.0)


def test_weight_is_4_by_default_validated_and_nullable() -> None:
    assert PolicyWeights().overlap_credit_loaded == 4.0  # since 2026-11-29 (docs/policy-studies.md "Part 24")
    assert PolicyWeights(overlap_credit_loaded=4.0).overlap_credit_loaded == 4.0
    assert PolicyWeights().replace(overlap_credit_loaded=2).overlap_credit_loaded == 2.0
    assert PolicyWeights().replace(overlap_credit_loaded=None).overlap_credit_loaded is None
    for bad in (-0.5, 4.5):
        with pytest.raises(ConfigError, match="overlap_credit_loaded"):
            PolicyWeights(overlap_credit_loaded=bad)


# A holds 8 of the request's 10 blocks with 12 blocks of prefill queued; B holds nothing.
# Credit 1: A costs 12 + 10 − 8 = 14, B costs its own queue + 10. Credit 3: A costs 12 + 10 − 24 = −2.


@pytest.mark.parametrize("off", [None, 1.0])  # null, or equal to overlap_credit
def test_off_keeps_the_constant_credit_and_says_nothing(off: float | None) -> None:
    loads = [busy(A, 12.0), busy(B, 1.0)]  # every replica prefilling: the ramp would be at its top
    decision = route({A: 8, B: 0}, loads, overlap_credit_loaded=off)
    assert decision.replica == B  # credit 1: A costs 14, B 11
    assert {t.overlap_credit for t in decision.terms} == {1.0}
    assert "credit" not in decision.reason


def test_idle_fleet_spreads_as_overlap_credit() -> None:
    # one of two replicas prefilling: share 0.5, below the ramp, so credit 1 and B (10 < 14)
    decision = route(
        {A: 8, B: 0}, [busy(A, 12.0), ReplicaLoad(B)], overlap_credit_loaded=3.0, ramp_memory_s=None
    )  # the instant share (the ramp's memory is test_ramp_memory.py's)
    assert decision.replica == B
    terms = terms_of(decision)
    assert terms[A].overlap_credit == 1.0
    assert terms[A].prefill_term == pytest.approx(14.0)
    assert "credit 1 (1/2 replicas prefilling)" in decision.reason


def test_busy_fleet_keeps_affinity_as_overlap_credit_loaded() -> None:
    # both prefilling: share 1, credit 3; A costs −2 against B's 1 + 10
    loads = [busy(A, 12.0), busy(B, 1.0)]
    assert route({A: 8, B: 0}, loads, overlap_credit_loaded=None).replica == B  # credit 1: 14 against 11
    decision = route({A: 8, B: 0}, loads, overlap_credit_loaded=3.0, ramp_memory_s=None)
    assert decision.replica == A
    terms = terms_of(decision)
    assert terms[A].overlap_credit == terms[B].overlap_credit == 3.0
    assert terms[A].prefill_term == pytest.approx(-2.0)
    assert "credit 3 (2/2 replicas prefilling)" in decision.reason


def test_part_way_up_the_ramp() -> None:
    # 7 of 8 prefilling: share 0.875, halfway from 0.75 to 1, credit 2 with overlap_credit 1, loaded 3
    others = [busy(ReplicaId(f"r{i}"), 1.0) for i in range(5)]
    loads = [busy(A, 12.0), busy(B, 1.0), ReplicaLoad(C), *others]
    overlaps = {A: 8, B: 0, C: 0, **{x.replica: 0 for x in others}}
    decision = route(overlaps, loads, overlap_credit_loaded=3.0, ramp_memory_s=None)
    assert terms_of(decision)[A].overlap_credit == pytest.approx(2.0)
    assert "(7/8 replicas prefilling)" in decision.reason


def test_imbalance_guard_still_withdraws_the_credit() -> None:
    decision = route(
        {A: 8, B: 0}, [busy(A, 12.0), busy(B, 1.0)], overlap_credit_loaded=3.0, imbalance_threshold_blocks=5.0
    )
    terms = terms_of(decision)
    assert terms[A].overlap_credit == 0.0
    assert terms[B].overlap_credit == 3.0
    assert decision.replica == B


def test_credit_0_keeps_the_cache_ignored_at_any_load() -> None:
    decision = route(
        {A: 8, B: 0}, [busy(A, 12.0), busy(B, 1.0)], overlap_credit=0.0, overlap_credit_loaded=3.0
    )
    assert {t.overlap_credit for t in decision.terms} == {0.0}
    assert "credit" not in decision.reason
    assert not credit_ramps(PolicyWeights(overlap_credit=0.0, overlap_credit_loaded=3.0))
    assert not credit_ramps(PolicyWeights(overlap_credit_loaded=1.0))
    assert credit_ramps(PolicyWeights())  # on by default (credit 4 when every replica prefills)
    assert not credit_ramps(PolicyWeights(overlap_credit_loaded=None))  # the previous default
    assert credit_ramps(PolicyWeights(overlap_credit_loaded=3.0))
