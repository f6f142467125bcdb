"""The cost policy's eviction-risk discount (``eviction_risk_weight``, off by default): the overlap
credited on a replica whose queued prefill may evict it before the engine admits the request."""

from __future__ import annotations

import pytest
from policy_cases import route, terms_of

from balancer.load.tracker import ReplicaLoad
from balancer.policy import PolicyWeights
from balancer.policy.cost import overlap_survival
from balancer.types import ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")
POOL = 100.0  # blocks


@pytest.mark.parametrize(
    ("ahead", "capacity", "pressure", "weight", "expected"),
    [
        (50.0, 100.0, 1.0, 0.0, 1.0),  # off
        (50.0, 100.0, 1.0, 1.0, 0.5),  # half the pool written before admission
        (50.0, 100.0, 0.5, 1.0, 0.75),  # a cache with some room evicts less
        (50.0, 100.0, 0.0, 1.0, 1.0),  # an empty cache evicts nothing
        (150.0, 100.0, 1.0, 1.0, 0.0),  # clamped: more than the pool queued
        (50.0, 100.0, 1.0, 4.0, 0.0),
        (50.0, None, 1.0, 1.0, 1.0),  # pool size unknown: no doubt
        (50.0, 100.0, None, 1.0, 1.0),  # pressure unknown
        (-3.0, 100.0, 1.0, 1.0, 1.0),  # never above 1
    ],
)
def test_overlap_survival(
    ahead: float, capacity: float | None, pressure: float | None, weight: float, expected: float
) -> None:
    assert overlap_survival(ahead, capacity, pressure, weight) == pytest.approx(expected)


def test_default_is_off_and_the_terms_say_so() -> None:
    assert PolicyWeights().eviction_risk_weight == 0.0
    loads = [
        ReplicaLoad(A, pending_prefill_blocks=60.0, capacity_blocks=POOL),
        ReplicaLoad(B, capacity_blocks=POOL),
    ]
    terms = terms_of(route({A: 10, B: 0}, loads, held={A: 95, B: 95}))
    assert terms[A].overlap_survival == 1.0
    assert terms[A].prefill_term == pytest.approx(60.0 + 10 - 10)


def test_a_hit_behind_a_queue_that_overwrites_the_cache_is_discounted() -> None:
    # A holds the whole 10-block prompt but 60 blocks of uncached prefill are queued there, on a
    # full 100-block cache: at weight 1 only 40% of the hit is credited (4 blocks), and A inserts
    # the other 6. B is idle and as full.
    loads = [
        ReplicaLoad(A, pending_prefill_blocks=60.0, capacity_blocks=POOL),
        ReplicaLoad(B, pending_prefill_blocks=50.0, capacity_blocks=POOL),
    ]
    held = {A: 95, B: 95}
    assert route({A: 10, B: 0}, loads, held=held).replica == A  # 60 + 0 < 50 + 10 + 10
    decision = route({A: 10, B: 0}, loads, held=held, eviction_risk_weight=1.0)
    terms = terms_of(decision)
    assert terms[A].overlap_survival == pytest.approx(0.4)
    assert terms[A].prefill_term == pytest.approx(60.0 + 10 - 4)
    assert terms[A].duplication_term == pytest.approx(6.0)
    assert terms[B].overlap_survival == pytest.approx(0.5)  # shown, but B has no overlap to discount
    assert decision.replica == B  # 66 + 6 = 72 > 50 + 10 + 10 = 70


def test_no_discount_while_the_cache_has_room() -> None:
    loads = [
        ReplicaLoad(A, pending_prefill_blocks=60.0, capacity_blocks=POOL),
        ReplicaLoad(B, pending_prefill_blocks=55.0, capacity_blocks=POOL),
    ]
    decision = route({A: 10, B: 0}, loads, held={A: 20, B: 20}, eviction_risk_weight=4.0)
    assert terms_of(decision)[A].overlap_survival == 1.0
    assert decision.replica == A


def test_the_weight_is_range_checked() -> None:
    from balancer.errors import ConfigError

    with pytest.raises(ConfigError, match="eviction_risk_weight must be in"):
        PolicyWeights(eviction_risk_weight=5.0)
