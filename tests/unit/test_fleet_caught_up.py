"""``loadtests.fleet.processes.caught_up``: when a kvlb's index has taken every event a flushed fleet
published."""

from __future__ import annotations

from typing import Any

from loadtests.fleet.processes import caught_up


def view(name: str, blocks: int = 0, queued: int = 0, seqs: tuple[int | None, ...] = (5,)) -> dict[str, Any]:
    sources = [{"dp_rank": rank, "last_seq": seq} for rank, seq in enumerate(seqs)]
    return {"id": name, "index": {"blocks": blocks}, "events": {"queued_batches": queued, "sources": sources}}


def test_caught_up_when_every_rank_took_the_last_batch_and_nothing_is_held() -> None:
    published = {"r0": [5], "r1": [7, 2]}
    assert caught_up([view("r0"), view("r1", seqs=(7, 3))], published)


def test_not_caught_up_while_a_rank_is_behind_or_unheard() -> None:
    published = {"r0": [5], "r1": [7, 2]}
    assert not caught_up([view("r0"), view("r1", seqs=(6, 2))], published)
    assert not caught_up([view("r0"), view("r1", seqs=(7, None))], published)
    assert not caught_up([view("r0"), view("r1", seqs=(7,))], published)  # rank 1 has no source yet


def test_not_caught_up_while_batches_wait_or_blocks_are_held() -> None:
    published = {"r0": [5]}
    assert not caught_up([view("r0", queued=1)], published)
    assert not caught_up([view("r0", blocks=12)], published)  # the flush's clear is not applied yet


def test_a_rank_that_published_nothing_and_replicas_without_events_wait_for_nothing() -> None:
    assert caught_up([view("r0", seqs=(None,))], {"r0": [-1]})
    assert caught_up([{"id": "t0", "index": {"blocks": 0}, "events": None}], {})
    no_sources = {"id": "r0", "index": {"blocks": 0}, "events": {"queued_batches": 0, "sources": []}}
    assert caught_up([no_sources], {"r0": [5]})  # a kvlb with its event sources off
