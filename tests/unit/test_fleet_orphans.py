"""``Orphans``: the replicas a balancer forgot without retiring them, until each is due."""

from __future__ import annotations

import pytest

from balancer.fleet.orphans import Orphans
from balancer.types import ReplicaId

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")


def test_each_replica_comes_out_once_when_due() -> None:
    orphans: Orphans[str] = Orphans()
    orphans.add(A, "entry a", due=2.0)
    orphans.add(B, "entry b", due=1.0)
    assert orphans.take_due(0.5) == []
    assert orphans.take_due(1.0) == [(B, "entry b")]
    assert orphans.take_due(5.0) == [(A, "entry a")]
    assert orphans.take_due(9.0) == [] and len(orphans) == 0


def test_a_replica_found_again_is_not_retired_and_a_second_removal_waits_again() -> None:
    orphans: Orphans[str] = Orphans()
    orphans.add(A, "first", due=1.0)
    orphans.cancel(A)
    assert orphans.take_due(2.0) == []
    orphans.add(A, "first", due=1.0)
    orphans.add(A, "second", due=3.0)
    assert orphans.take_due(2.0) == [] and orphans.take_due(3.0) == [(A, "second")]


def test_the_oldest_are_forgotten_beyond_the_bound_and_counted() -> None:
    orphans: Orphans[int] = Orphans(max_count=2)
    assert orphans.add(A, 1, due=1.0) == 0
    assert orphans.add(B, 2, due=1.0) == 0
    assert orphans.add(C, 3, due=1.0) == 1  # a is forgotten
    assert orphans.take_due(1.0) == [(B, 2), (C, 3)]
    with pytest.raises(ValueError, match="max_count"):
        Orphans(max_count=0)
