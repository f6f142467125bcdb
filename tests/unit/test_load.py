"""LoadTracker: reserve → first_token → release, cancel, idempotence, expiry, staleness, caps."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.errors import ConfigError
from balancer.load.tracker import (
    IDLE,
    EngineStats,
    LoadConfig,
    LoadCounts,
    LoadTracker,
    ReplicaLoad,
    combine,
)
from balancer.types import ReplicaId

A = ReplicaId("a")
B = ReplicaId("b")


def tracker(**config: float) -> LoadTracker:
    return LoadTracker(LoadConfig(**config))  # type: ignore[arg-type]


def test_lifecycle_moves_request_from_prefill_to_decode_then_away() -> None:
    t = tracker(block_size_tokens=16)
    assert t.reserve("r1", A, prefill_tokens=40, decode_blocks=5, now=0.0)

    load = t.snapshot(1.0).of(A)
    assert (load.pending_prefill_seqs, load.pending_prefill_tokens) == (1, 40)
    assert load.pending_prefill_blocks == pytest.approx(40 / 16)
    assert (load.active_decode_seqs, load.active_decode_blocks) == (0, 0)
    assert load.in_flight_seqs == 1

    assert t.first_token("r1", now=2.0)
    load = t.snapshot(2.0).of(A)
    assert (load.pending_prefill_seqs, load.pending_prefill_tokens, load.pending_prefill_blocks) == (0, 0, 0)
    assert (load.active_decode_seqs, load.active_decode_blocks) == (1, 5)

    assert t.release("r1", now=3.0)
    snap = t.snapshot(3.0)
    assert A not in snap.replicas
    assert snap.of(A) == ReplicaLoad(replica=A)
    stats = t.stats()
    assert (stats.reserved_total, stats.released_total, stats.tracked_requests) == (1, 1, 0)


def test_requests_add_up_per_replica() -> None:
    t = tracker(block_size_tokens=32)
    t.reserve("r1", A, 64, 3, now=0.0)
    t.reserve("r2", A, 32, 4, now=0.0)
    t.reserve("r3", B, 10, 1, now=0.0)
    t.first_token("r2", now=1.0)
    snap = t.snapshot(1.0)
    assert snap.block_size_tokens == 32
    assert snap.of(A).pending_prefill_tokens == 64
    assert snap.of(A).pending_prefill_blocks == pytest.approx(2.0)
    assert snap.of(A).active_decode_blocks == 4
    assert snap.of(B).pending_prefill_blocks == pytest.approx(10 / 32)


def test_cancel_during_prefill_removes_prefill_tokens() -> None:
    t = tracker()
    t.reserve("r1", A, 100, 7, now=0.0)
    t.reserve("r2", A, 50, 4, now=0.0)
    assert t.release("r1", now=0.5)
    load = t.snapshot(0.5).of(A)
    assert (load.pending_prefill_seqs, load.pending_prefill_tokens) == (1, 50)


def test_double_release_and_unknown_ids_are_harmless() -> None:
    t = tracker()
    t.reserve("r1", A, 10, 1, now=0.0)
    t.first_token("r1", now=0.1)
    assert t.release("r1", now=0.2)
    assert not t.release("r1", now=0.3)
    assert not t.release("never", now=0.3)
    assert not t.first_token("never", now=0.3)
    assert t.snapshot(0.3).replicas == {}
    assert t.stats().unknown_ids_total == 3
    assert t.stats().released_total == 1


def test_duplicate_reserve_keeps_the_first() -> None:
    t = tracker()
    assert t.reserve("r1", A, 10, 1, now=0.0)
    assert not t.reserve("r1", B, 99, 9, now=0.1)
    snap = t.snapshot(0.1)
    assert B not in snap.replicas
    assert snap.of(A).pending_prefill_tokens == 10
    assert t.stats().duplicate_reserves_total == 1


def test_second_first_token_does_not_double_count() -> None:
    t = tracker()
    t.reserve("r1", A, 10, 3, now=0.0)
    t.first_token("r1", now=0.1)
    assert t.first_token("r1", now=0.2)
    load = t.snapshot(0.2).of(A)
    assert (load.active_decode_seqs, load.active_decode_blocks) == (1, 3)


def test_negative_sizes_count_as_zero() -> None:
    t = tracker()
    t.reserve("r1", A, -5, -2, now=0.0)
    t.first_token("r1", now=0.0)
    load = t.snapshot(0.0).of(A)
    assert (load.pending_prefill_tokens, load.active_decode_seqs, load.active_decode_blocks) == (0, 1, 0)


def test_stale_reservations_expire_after_max_age() -> None:
    t = tracker(max_age_s=10.0)
    t.reserve("old", A, 16, 1, now=0.0)
    t.reserve("new", A, 32, 1, now=5.0)
    assert t.snapshot(9.9).of(A).pending_prefill_seqs == 2
    assert t.snapshot(10.0).of(A).pending_prefill_tokens == 32
    assert t.stats().expired_total == 1
    assert not t.release("old", now=10.0)
    assert t.release("new", now=10.0)


def test_first_token_refreshes_the_age() -> None:
    t = tracker(max_age_s=10.0)
    t.reserve("r1", A, 16, 2, now=0.0)
    t.reserve("r2", A, 16, 2, now=1.0)
    t.first_token("r1", now=8.0)
    load = t.snapshot(15.0).of(A)  # r2 (last touched at 1) expired, r1 (touched at 8) not
    assert (load.pending_prefill_seqs, load.active_decode_seqs) == (0, 1)
    assert t.expire(18.0) == 1
    assert t.snapshot(18.0).replicas == {}


def test_cap_drops_the_oldest_and_counts_it() -> None:
    t = tracker(max_tracked_requests=2)
    t.reserve("r1", A, 10, 1, now=0.0)
    t.reserve("r2", B, 20, 1, now=1.0)
    t.reserve("r3", B, 30, 1, now=2.0)
    snap = t.snapshot(2.0)
    assert A not in snap.replicas
    assert snap.of(B).pending_prefill_tokens == 50
    assert t.stats().overflow_total == 1
    assert t.stats().tracked_requests == 2
    assert not t.release("r1", now=3.0)


def test_scraped_stats_have_an_age_and_go_stale() -> None:
    t = tracker(stale_after_s=5.0)
    t.observe(A, EngineStats(running_reqs=3, waiting_reqs=2, kv_usage=0.5), now=10.0)
    fresh = t.snapshot(14.0).of(A)
    assert (fresh.running_reqs, fresh.waiting_reqs, fresh.kv_usage) == (3, 2, 0.5)
    assert fresh.stats_age_s == pytest.approx(4.0)
    assert fresh.seq_load == 2  # nothing in flight from this balancer + 2 waiting

    stale = t.snapshot(15.5).of(A)
    assert (stale.running_reqs, stale.waiting_reqs, stale.kv_usage) == (None, None, None)
    assert stale.stats_age_s == pytest.approx(5.5)
    assert stale.seq_load == 0


def test_pool_size_is_kept_once_reported_and_never_goes_stale() -> None:
    t = tracker(stale_after_s=5.0)  # 16-token blocks
    t.observe(A, EngineStats(kv_usage=0.5, capacity_tokens=32_768), now=0.0)
    assert t.snapshot(1.0).of(A).capacity_blocks == 2048
    t.observe(A, EngineStats(kv_usage=0.6), now=2.0)  # a scrape without it keeps the last value
    assert t.snapshot(100.0).of(A).capacity_blocks == 2048  # stale stats, same pool
    t.observe(A, EngineStats(capacity_tokens=0), now=3.0)  # nonsense is dropped, not stored
    assert t.snapshot(3.0).of(A).capacity_blocks == 2048
    assert t.forget(A) == 0
    t.observe(A, EngineStats(waiting_reqs=1), now=4.0)
    assert t.snapshot(4.0).of(A).capacity_blocks is None


def test_never_scraped_replica_reports_none() -> None:
    t = tracker()
    t.reserve("r1", A, 10, 1, now=0.0)
    load = t.snapshot(0.0).of(A)
    assert (load.waiting_reqs, load.running_reqs, load.kv_usage, load.stats_age_s) == (None,) * 4


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (EngineStats(running_reqs=-1, waiting_reqs=4, kv_usage=1.3), EngineStats(None, 4, 1.0)),
        (EngineStats(running_reqs=2, waiting_reqs=-3, kv_usage=-0.1), EngineStats(2, None, 0.0)),
        (EngineStats(kv_usage=math.nan), EngineStats()),
        (EngineStats(kv_usage=math.inf), EngineStats()),
    ],
)
def test_observe_sanitises_out_of_range_values(given: EngineStats, expected: EngineStats) -> None:
    t = tracker()
    t.observe(A, given, now=0.0)
    load = t.snapshot(0.0).of(A)
    assert EngineStats(load.running_reqs, load.waiting_reqs, load.kv_usage) == expected


def test_scraped_replicas_are_capped() -> None:
    t = tracker(max_replicas=1)
    assert t.observe(A, EngineStats(waiting_reqs=1), now=0.0)
    assert not t.observe(B, EngineStats(waiting_reqs=1), now=0.0)
    assert t.observe(A, EngineStats(waiting_reqs=2), now=1.0)  # an update, not a new replica
    assert t.stats().ignored_stats_total == 1
    assert B not in t.snapshot(1.0).replicas


def test_forget_drops_a_replica() -> None:
    t = tracker()
    t.reserve("r1", A, 10, 1, now=0.0)
    t.reserve("r2", B, 10, 1, now=0.0)
    t.observe(A, EngineStats(waiting_reqs=1), now=0.0)
    assert t.forget(A) == 1
    assert set(t.snapshot(0.0).replicas) == {B}
    assert not t.release("r1", now=0.0)


@pytest.mark.parametrize(
    "config",
    [
        {"block_size_tokens": 0},
        {"stale_after_s": 0.0},
        {"max_age_s": -1.0},
        {"max_age_s": math.nan},
        {"max_tracked_requests": 0},
        {"max_replicas": 0},
    ],
)
def test_bad_config_is_refused(config: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match=next(iter(config))):
        tracker(**config)


_ops = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "first_token", "release"]),
        st.integers(0, 7),  # request id
        st.sampled_from([A, B]),
        st.integers(0, 500),  # prefill tokens
        st.integers(0, 40),  # decode blocks
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_totals_always_match_the_live_requests(ops: list[tuple[str, int, ReplicaId, int, int]]) -> None:
    t = tracker(block_size_tokens=16)
    live: dict[str, tuple[ReplicaId, int, int, bool]] = {}
    for step, (op, rid, replica, prefill, decode) in enumerate(ops):
        request_id = f"r{rid}"
        if op == "reserve":
            assert t.reserve(request_id, replica, prefill, decode, now=step) == (request_id not in live)
            live.setdefault(request_id, (replica, prefill, decode, False))
        elif op == "first_token":
            assert t.first_token(request_id, now=step) == (request_id in live)
            if request_id in live:
                live[request_id] = (*live[request_id][:3], True)
        else:
            assert t.release(request_id, now=step) == (request_id in live)
            live.pop(request_id, None)
    snap = t.snapshot(len(ops))
    for replica in (A, B):
        mine = [v for v in live.values() if v[0] == replica]
        load = snap.of(replica)
        assert load.pending_prefill_tokens == sum(p for _, p, _, d in mine if not d)
        assert load.active_decode_blocks == sum(b for _, _, b, d in mine if d)
        assert load.in_flight_seqs == len(mine)
    for request_id in list(live):
        assert t.release(request_id, now=len(ops))
    assert t.snapshot(len(ops)).replicas == {}


def test_peer_counts_add_to_the_own_view_and_say_their_share() -> None:
    """``kvlb serve --workers N``: the other workers' committed load (``peers``) adds to this
    tracker's own, per replica; a replica known only from peers appears; negative peer counts are
    0; without peers the snapshot is this tracker's alone."""
    t = tracker(block_size_tokens=16)
    t.reserve("r1", A, prefill_tokens=160, decode_blocks=20, now=0.0)
    peers = {
        A: LoadCounts(prefill_seqs=2, prefill_tokens=320, decode_seqs=1, decode_blocks=30),
        B: LoadCounts(decode_seqs=3, decode_blocks=90),
    }
    snap = t.snapshot(1.0, peers)
    a, b = snap.of(A), snap.of(B)
    assert (a.pending_prefill_seqs, a.pending_prefill_tokens, a.pending_prefill_blocks) == (3, 480, 30.0)
    assert (a.active_decode_seqs, a.active_decode_blocks, a.in_flight_seqs, a.peer_seqs) == (1, 30, 4, 3)
    assert (b.in_flight_seqs, b.active_decode_blocks, b.peer_seqs) == (3, 90, 3)
    own = t.snapshot(1.0).of(A)
    assert (own.in_flight_seqs, own.peer_seqs, t.in_flight(A)) == (1, 0, 1)
    torn = t.snapshot(1.0, {A: LoadCounts(prefill_seqs=-5, prefill_tokens=-99)}).of(A)
    assert (torn.pending_prefill_seqs, torn.pending_prefill_tokens, torn.peer_seqs) == (1, 160, 0)
    assert combine(LoadCounts(1, 2, 3, 4), LoadCounts(10, 20, 30, 40)) == LoadCounts(11, 22, 33, 44)


def test_on_change_hands_out_the_own_totals_after_every_change() -> None:
    """The hook the shell publishes from sees each replica's own new totals: reserve, first token,
    release, expiry and forget (idle = all zero)."""
    seen: list[tuple[ReplicaId, LoadCounts]] = []
    t = tracker(block_size_tokens=16, max_age_s=10.0)
    t.on_change = lambda replica, counts: seen.append((replica, counts))
    t.reserve("r1", A, prefill_tokens=40, decode_blocks=5, now=0.0)
    t.reserve("r2", B, prefill_tokens=8, decode_blocks=1, now=0.0)
    t.first_token("r1", now=1.0)
    t.first_token("r1", now=1.5)  # no change: no call
    t.release("r1", now=2.0)
    t.snapshot(20.0)  # r2 expires
    t.reserve("r3", A, prefill_tokens=1, decode_blocks=1, now=20.0)
    t.forget(A)
    assert seen == [
        (A, LoadCounts(1, 40, 0, 0)),
        (B, LoadCounts(1, 8, 0, 0)),
        (A, LoadCounts(0, 0, 1, 5)),
        (A, IDLE),
        (B, IDLE),
        (A, LoadCounts(1, 1, 0, 0)),
        (A, IDLE),
    ]
    assert t.own(A) == IDLE and t.own(B) == IDLE
