"""The fleet's drained entries as a balancer mirrors them (pure: times passed in as ``now_s``)."""

from __future__ import annotations

from balancer import strict_json
from balancer.fleet.drained_entries import (
    KEPT_FROM,
    MARKER,
    REMOVED_AT,
    DrainedMirror,
    note_of,
    prune_due,
)
from balancer.health.book import DrainNote

NOTE = DrainNote(by="ops", caller="anonymous@127.0.0.1", at_wall_ts=1_796_000_000.0, reason="disk swap")


def removed(at: float) -> str:
    return strict_json.dumps({**NOTE.to_json(), REMOVED_AT: at})


def test_the_prune_compares_the_removal_with_the_one_clock_it_is_given() -> None:
    assert not prune_due(1_000.0, 1_000.0 + 60.0, 60.0)  # exactly the keep time: still kept
    assert prune_due(1_000.0, 1_060.001, 60.0)
    assert not prune_due(1_000.0, 990.0, 60.0)  # a stamp ahead of now (another clock) is kept


def test_the_mirror_indexes_removed_entries_and_follows_changes() -> None:
    mirror = DrainedMirror()
    drained = strict_json.dumps(NOTE.to_json())
    mirror.replace({MARKER: "1", "a": drained, "b": removed(1_000.0), "c": removed(1_100.0)}, "e1", 7)
    assert (mirror.epoch, mirror.version) == ("e1", 7)
    assert set(mirror.removed) == {"b", "c"}
    assert [kept.replica for kept in mirror.kept(listed={"c"})] == ["b"]
    assert [kept.replica for kept in mirror.kept(listed=set())] == ["c", "b"]  # newest removal first
    assert note_of(mirror.removed["b"].entry) == NOTE

    # b listed again elsewhere (its time cleared), c undrained, d removed: as the change log says
    relisted = strict_json.dumps({**NOTE.to_json(), KEPT_FROM: 1_000.0})
    mirror.apply({"b": relisted, "c": None, "d": removed(1_200.0)}, "e1", 9)
    assert mirror.version == 9 and set(mirror.entries) == {MARKER, "a", "b", "d"}
    assert set(mirror.removed) == {"d"}


def test_prune_candidates_are_due_not_listed_and_bounded() -> None:
    mirror = DrainedMirror()
    entries = {f"r{i}": removed(1_000.0 + i) for i in range(10)}
    mirror.replace({MARKER: "1", **entries}, "e", 1)
    now_s, keep_s = 1_000.0 + 4.5 + 60.0, 60.0  # r0..r4 are past the keep time
    due = mirror.prune_candidates({"r1"}, now_s, keep_s, scan=100, limit=100)
    assert [entry.replica for entry in due] == ["r0", "r2", "r3", "r4"]
    first_two = mirror.prune_candidates(set(), now_s, keep_s, scan=100, limit=2)
    assert [e.replica for e in first_two] == ["r0", "r1"]
    # a window of 3 moves on at each call
    later = now_s + 100
    windows = [
        [e.replica for e in mirror.prune_candidates(set(), later, keep_s, scan=3, limit=10)] for _ in range(4)
    ]
    assert windows == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6", "r7", "r8"], ["r9", "r0", "r1"]]
    assert mirror.prune_candidates(set(), 1_000.0 + 30.0, keep_s, scan=100, limit=100) == []  # none due
