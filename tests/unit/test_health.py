"""Circuit breaker and routable-set rules."""

from __future__ import annotations

from balancer.health.book import (
    MAX_KEPT_DRAIN_BYTES,
    MAX_KEPT_DRAINS,
    MAX_PENDING_DRAINS,
    PENDING_DRAIN_S,
    BreakerConfig,
    DrainNote,
    HealthBook,
    kept_text,
)
from balancer.types import ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")


def book() -> HealthBook:
    hb = HealthBook(BreakerConfig(failure_threshold=2, open_s=5.0))
    hb.add(A, probe_ok=True)
    hb.add(B, probe_ok=True)
    return hb


def test_new_replica_waits_for_probe() -> None:
    hb = HealthBook()
    hb.add(A)
    assert hb.routable(0.0) == []
    hb.on_probe(A, True, 0.0)
    assert hb.routable(0.0) == [A]


def test_breaker_opens_half_opens_and_closes() -> None:
    hb = book()
    hb.on_failure(A, 1.0, "connect")
    assert hb.routable(1.0) == [A, B]  # one failure is below the threshold
    hb.on_failure(A, 2.0, "connect")
    assert hb.routable(2.0) == [B]  # open
    assert hb.routable(6.9) == [B]
    assert hb.routable(7.0) == [A, B]  # half-open: one trial
    hb.on_routed(A, 7.0)
    assert hb.routable(7.1) == [B]  # the trial is in flight
    hb.on_success(A)
    assert hb.routable(7.2) == [A, B]


def test_failed_trial_reopens() -> None:
    hb = book()
    hb.on_failure(A, 0.0, "x")
    hb.on_failure(A, 0.0, "x")
    hb.on_routed(A, 5.0)
    hb.on_failure(A, 5.5, "x")
    assert hb.routable(6.0) == [B]
    assert hb.routable(10.5) == [A, B]


def test_probe_failure_and_draining() -> None:
    hb = book()
    hb.on_probe(A, False, 1.0, "503")
    assert hb.routable(1.0) == [B]
    hb.on_probe(A, True, 2.0)
    assert hb.routable(2.0) == [A, B]
    assert hb.set_draining(B, True)
    assert hb.routable(2.0) == [A]
    assert not hb.set_draining(ReplicaId("zzz"), True)
    assert hb.routable(2.0, among=[B, A]) == [A]


def test_timed_out_probes_take_a_replica_out_only_from_the_threshold_on() -> None:
    """One timeout (a stalled host times out every replica's probe at once) leaves the replica
    routable; the second in a row takes it out; a good probe puts it back and resets the count and
    the breaker. Every timeout still counts against the breaker."""
    hb = HealthBook(BreakerConfig(failure_threshold=3, probe_timeouts_to_drop=2))
    hb.add(A, probe_ok=True)
    hb.add(B, probe_ok=True)
    hb.on_probe(A, False, 1.0, "timed out", timed_out=True)
    assert hb.routable(1.0) == [A, B] and hb.replicas[A].consecutive_failures == 1
    hb.on_probe(A, True, 2.0)  # back: the count and the breaker start over
    assert hb.replicas[A].probe_timeouts == 0 and hb.replicas[A].consecutive_failures == 0
    hb.on_probe(A, False, 3.0, "timed out", timed_out=True)
    hb.on_probe(A, False, 4.0, "timed out", timed_out=True)
    assert hb.routable(4.0) == [B]
    hb.on_probe(A, True, 5.0)
    assert hb.routable(5.0) == [A, B]


def test_an_answer_other_than_200_or_a_refusal_takes_a_replica_out_at_once_after_a_timeout() -> None:
    hb = HealthBook(BreakerConfig(probe_timeouts_to_drop=3))
    hb.add(A, probe_ok=True)
    hb.on_probe(A, False, 1.0, "timed out", timed_out=True)
    assert hb.routable(1.0) == [A]
    hb.on_probe(A, False, 2.0, "ClientConnectorError")  # refused: not a timeout
    assert hb.routable(2.0) == [] and hb.replicas[A].probe_timeouts == 0
    hb.on_probe(A, True, 3.0)
    hb.on_probe(A, False, 4.0, "answered 503")
    assert hb.routable(4.0) == []


def test_a_threshold_of_one_drops_at_the_first_timeout() -> None:
    hb = HealthBook(BreakerConfig(probe_timeouts_to_drop=1))
    hb.add(A, probe_ok=True)
    hb.on_probe(A, False, 1.0, "timed out", timed_out=True)
    assert hb.routable(1.0) == []


def test_why_a_replica_is_unroutable_and_whether_only_drains_keep_it_out() -> None:
    hb = book()
    assert hb.unroutable_reason(A, 0.0) is None
    assert hb.unroutable_reason(ReplicaId("zzz"), 0.0) == "unknown"
    hb.set_draining(A, True)
    assert hb.unroutable_reason(A, 0.0) == "draining"
    assert hb.drained_only(0.0, [A, B])  # A would take traffic undrained
    hb.on_probe(B, False, 0.0, "refused")
    assert hb.unroutable_reason(B, 0.0) == "failing health probes"
    assert not hb.drained_only(0.0, [B])
    hb.on_probe(A, False, 1.0, "refused")  # a drained replica that is also down
    assert hb.unroutable_reason(A, 1.0) == "draining" and not hb.drained_only(1.0, [A, B])
    hb.on_probe(A, True, 2.0)
    hb.on_probe(B, True, 2.0)
    hb.on_failure(B, 2.0, "connect")
    hb.on_failure(B, 2.0, "connect")
    assert hb.unroutable_reason(B, 2.0) == "breaker open"
    hb.set_draining(B, True)
    assert not hb.drained_only(2.0, [B])  # its breaker keeps it out too
    assert hb.drained_only(7.0, [B])  # half-open, no trial yet: only the drain
    hb.set_draining(B, False)
    hb.on_routed(B, 7.0)
    assert hb.unroutable_reason(B, 7.1) == "breaker trial in flight"


def test_a_drain_keeps_who_when_and_why_until_undrained() -> None:
    hb = book()
    note = DrainNote("alice", "token:1234abcd@10.0.0.1", 1_700_000_000.5, "node maintenance")
    hb.set_draining(A, True, note)
    assert hb.replicas[A].drain == note
    assert DrainNote.from_json(note.to_json()) == note
    hb.set_draining(A, False, note)  # an undrain's note is for the log only
    assert hb.replicas[A].drain is None and not hb.replicas[A].draining


def test_a_drain_note_from_json_refuses_what_is_not_one() -> None:
    good = {"by": "a", "caller": "c", "at_wall_ts": 1, "reason": None}
    assert DrainNote.from_json(good) == DrainNote("a", "c", 1.0, None)
    for bad in ({}, [], "x", {**good, "at_wall_ts": True}, {**good, "by": 1}, {**good, "reason": 2}):
        assert DrainNote.from_json(bad) is None, bad


def test_an_engine_serving_another_model_is_out_of_routing_until_it_serves_the_pools() -> None:
    hb = book()
    assert hb.set_model_mismatch(A, "the engine serves ['other']")
    assert not hb.set_model_mismatch(A, "the engine serves ['other']")  # no change
    assert hb.routable(0.0) == [B]
    assert hb.unroutable_reason(A, 0.0) == "serves another model"
    hb.on_probe(A, True, 1.0)  # its probes pass: it stays out
    assert hb.routable(1.0) == [B]
    hb.set_draining(A, True)
    hb.set_draining(B, True)
    assert hb.drained_only(1.0, [B]) and not hb.drained_only(1.0, [A])  # A is out for its model too
    hb.set_draining(A, False)
    assert hb.set_model_mismatch(A, None)
    assert hb.routable(2.0) == [A] and hb.unroutable_reason(A, 2.0) is None


def test_an_engine_refusing_kvlbs_key_is_out_of_routing_until_it_accepts_it() -> None:
    hb = book()
    reason = "engine refuses kvlb's key (api_key_file /keys/a)"
    assert hb.set_key_refused(A, reason)
    assert not hb.set_key_refused(A, reason)  # no change
    hb.on_probe(A, True, 1.0)  # its probes pass (vLLM guards /v1/* only): it stays out
    assert hb.routable(1.0) == [B] and hb.unroutable_reason(A, 1.0) == reason
    hb.set_draining(A, True)
    assert not hb.drained_only(1.0, [A])  # out for its key too
    hb.set_draining(A, False)
    assert hb.set_key_refused(A, None)
    assert hb.routable(2.0) == [A, B] and hb.unroutable_reason(A, 2.0) is None


def test_a_kept_drain_applies_to_its_replica_when_it_comes_within_its_time_and_is_bounded() -> None:
    book = HealthBook()
    note = DrainNote(by="ops", caller="anonymous@127.0.0.1", at_wall_ts=1.0, reason="rollout")
    book.keep_drain(ReplicaId("late"), True, note, now=100.0)
    book.keep_drain(ReplicaId("stale"), True, note, now=100.0)
    book.keep_drain(ReplicaId("undone"), True, note, now=100.0)
    book.keep_drain(ReplicaId("undone"), False, None, now=101.0)  # an undrain forgets it
    book.add(ReplicaId("late"), probe_ok=True, now=100.0 + PENDING_DRAIN_S)
    book.add(ReplicaId("stale"), probe_ok=True, now=100.1 + PENDING_DRAIN_S)  # too late
    book.add(ReplicaId("undone"), probe_ok=True, now=102.0)
    assert book.replicas[ReplicaId("late")].draining and book.replicas[ReplicaId("late")].drain == note
    assert not book.replicas[ReplicaId("stale")].draining
    assert not book.replicas[ReplicaId("undone")].draining
    assert book.routable(200.0) == [ReplicaId("stale"), ReplicaId("undone")]
    for index in range(MAX_PENDING_DRAINS + 3):
        book.keep_drain(ReplicaId(f"r{index}"), True, None, now=300.0)
    assert len(book.pending_drains) == MAX_PENDING_DRAINS and book.pending_drains_dropped == 3
    assert ReplicaId("r0") not in book.pending_drains  # the oldest went first


def test_a_drain_outlives_its_replicas_removal_for_drain_keep_s_and_the_table_is_bounded() -> None:
    book = HealthBook(drain_keep_s=100.0)
    note = DrainNote(by="ops", caller="anonymous@127.0.0.1", at_wall_ts=1.0, reason="node repair")
    for name in ("web-0", "web-1", "web-2", "web-3"):
        book.add(ReplicaId(name), probe_ok=True, now=0.0)
        book.set_draining(ReplicaId(name), True, note)
    book.add(ReplicaId("plain"), probe_ok=True, now=0.0)
    for name in ("web-0", "web-1", "web-2", "web-3", "plain"):
        book.remove(ReplicaId(name), now=10.0, wall=1_764_000_000.0)
    assert set(book.kept_drains) == {"web-0", "web-1", "web-2", "web-3"}  # only the drained ones
    assert book.forget_kept(ReplicaId("web-3")) is not None  # an undrain of a replica not listed
    kept = book.add(ReplicaId("web-0"), probe_ok=True, now=110.0)  # within its time: drained
    assert kept is not None and kept.note == note
    record = book.replicas[ReplicaId("web-0")]
    assert record.draining and record.drain == note and record.kept_from_removal_wall_ts == 1_764_000_000.0
    assert kept_text(record.drain, 1_764_000_000.0) == (
        "drained (kept from before its removal at 2025-11-24T16:00:00Z by ops: node repair)"
    )
    assert book.add(ReplicaId("web-1"), probe_ok=True, now=110.1) is None  # too late: forgotten
    book.add(ReplicaId("web-3"), probe_ok=True, now=20.0)
    book.add(ReplicaId("plain"), probe_ok=True, now=20.0)
    assert book.routable(200.0) == [ReplicaId("web-1"), ReplicaId("web-3"), ReplicaId("plain")]
    assert book.kept_drains == {} and book.kept_drains_bytes == 0
    book.set_draining(ReplicaId("web-0"), False)
    assert book.replicas[ReplicaId("web-0")].kept_from_removal_wall_ts is None

    for index in range(MAX_KEPT_DRAINS + 3):  # the count bound: the oldest removal goes first
        book.add(ReplicaId(f"r{index}"), now=300.0)
        book.set_draining(ReplicaId(f"r{index}"), True, note)
        book.remove(ReplicaId(f"r{index}"), now=300.0, wall=2.0)
    assert len(book.kept_drains) == MAX_KEPT_DRAINS and book.kept_drains_dropped == 3
    assert ReplicaId("r0") not in book.kept_drains and ReplicaId("r3") in book.kept_drains
    big = DrainNote(by="ops", caller="c", at_wall_ts=1.0, reason="x" * 500)
    for index in range(MAX_KEPT_DRAINS):  # the byte bound
        book.add(ReplicaId(f"big-{index:04d}-" + "y" * 200), now=301.0)
        book.set_draining(ReplicaId(f"big-{index:04d}-" + "y" * 200), True, big)
        book.remove(ReplicaId(f"big-{index:04d}-" + "y" * 200), now=301.0, wall=2.0)
    assert book.kept_drains_bytes <= MAX_KEPT_DRAIN_BYTES < book.kept_drains_bytes + 1200
    assert book.kept_drains_bytes == sum(k.size_bytes for k in book.kept_drains.values())

    forgetful = HealthBook(drain_keep_s=0.0)  # 0: forgotten at the removal
    forgetful.add(ReplicaId("web-0"), probe_ok=True, now=0.0)
    forgetful.set_draining(ReplicaId("web-0"), True, note)
    assert forgetful.remove(ReplicaId("web-0"), now=1.0, wall=1.0) is None
    forgetful.add(ReplicaId("web-0"), probe_ok=True, now=1.0)
    assert forgetful.routable(2.0) == [ReplicaId("web-0")]


def test_trial_now_lets_an_open_breaker_try_at_once_and_only_an_open_one() -> None:
    book = HealthBook(BreakerConfig(failure_threshold=3, open_s=5.0))
    r = ReplicaId("r")
    book.add(r, probe_ok=True)
    assert not book.trial_now(r, now=0.0)  # closed: nothing to do
    for _ in range(3):
        book.on_failure(r, now=1.0, error="replica answered 401")
    assert book.breaker_state(r, 1.5) == "open" and r not in book.routable(1.5)
    assert book.trial_now(r, now=1.5)
    assert book.breaker_state(r, 1.5) == "half_open" and book.routable(1.5) == [r]
    book.on_routed(r, now=1.5)  # the one trial
    assert not book.trial_now(r, now=1.6) and book.routable(1.6) == []
    book.on_failure(r, now=1.7, error="replica answered 401")  # the trial failed: open for open_s again
    assert book.breaker_state(r, 6.6) == "open" and book.breaker_state(r, 6.7) == "half_open"
    assert not book.trial_now(ReplicaId("unknown"), now=2.0)
