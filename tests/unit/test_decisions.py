"""The console's decision ring (bounds in count and bytes, eviction counts, queries) and the what-if
replay on decisions made by the real router and policies."""

from __future__ import annotations

import dataclasses
import gc
import math
import random
import tracemalloc
from enum import IntEnum

import pytest

from balancer.errors import Overloaded
from balancer.events import Stored
from balancer.health.book import HealthBook
from balancer.index.hashing import pack_tokens
from balancer.load.tracker import EngineStats
from balancer.policy.base import PolicyWeights
from balancer.policy.registry import POLICY_NAMES, make_policy
from balancer.routing.left_out import LEFT_OUT_REASONS, left_out_names
from balancer.routing.router import PoolRequest, PoolRouter, RouteLimits
from balancer.service.decisions import LEFT_OUT_BYTES, DecisionLog, DecisionRecord
from balancer.service.whatif import replay
from balancer.types import EngineHash, ReplicaId

REPLICAS = [ReplicaId(f"r{i}") for i in range(4)]


def stored(tokens: list[int], block_size: int = 16, first_hash: int = 1) -> Stored:
    count = len(tokens) // block_size
    return Stored(
        dp_rank=0,
        parent=None,
        engine_hashes=tuple(EngineHash(first_hash + i) for i in range(count)),
        tokens=pack_tokens(tokens[: count * block_size]),
        block_size=block_size,
    )


def router(seed: int = 0) -> PoolRouter:
    health = HealthBook()
    for replica in REPLICAS:
        health.add(replica, probe_ok=True)
    limits = RouteLimits(max_inflight_per_replica=10_000, speculative_ttl_s=2.0)
    pool = PoolRouter("m", health=health, route_limits=limits, rng=random.Random(seed))
    for replica in REPLICAS:
        pool.add_replica(replica, 16, "plain")
    # Four shared prefixes of 8 blocks, one per replica.
    for i, replica in enumerate(REPLICAS):
        pool.space_of[replica].table.apply(replica, [stored(prefix(i), first_hash=100 * i + 1)], now=0.0)
    return pool


def prefix(i: int) -> list[int]:
    return list(range(10_000 * (i + 1), 10_000 * (i + 1) + 128))


def drive(
    log: DecisionLog,
    n: int,
    policy: str = "cost",
    weights: PolicyWeights | None = None,
    *,
    release_every: int = 3,
    seed: int = 0,
) -> PoolRouter:
    """``n`` requests through a real router: shared prefixes, random suffixes, some released."""
    weights = weights or PolicyWeights()
    pool = router(seed)
    instance = make_policy(policy)
    rng = random.Random(seed)
    leases = []
    for k in range(n):
        now = 1.0 + k * 0.01
        tokens = prefix(rng.randrange(4))[: rng.choice([64, 128])] + [
            rng.randrange(50_000) for _ in range(64)
        ]
        lease = pool.route(PoolRequest(tokens, instance, weights, f"q{k}", session_key=f"s{k % 7}"), now)
        plan = lease.plan
        assert plan.inputs is not None
        log.record(
            "m", plan.inputs, plan.decision, weights, plan.prompt_tokens, plan.cached_tokens, None, now
        )
        leases.append(lease)
        if k % release_every == 0:
            leases.pop(0).release(now)
    return pool


def test_ring_is_bounded_in_count_and_counts_what_it_evicts() -> None:
    evicted: list[tuple[str, str, int]] = []
    log = DecisionLog(5, 1 << 30, on_evict=lambda p, r, n: evicted.append((p, r, n)))
    drive(log, 12)
    ring = log.ring("m")
    assert [r.id for r in ring.entries] == list(range(8, 13))
    assert ring.stats.entries == 5 and ring.stats.evicted_count == 7
    assert sum(n for _, reason, n in evicted if reason == "count") == 7
    assert ring.stats.bytes == sum(r.nbytes for r in ring.entries)


def test_ring_is_bounded_in_bytes() -> None:
    evicted: list[tuple[str, str, int]] = []
    probe = DecisionLog(100, 1 << 30)
    drive(probe, 10)
    sizes = [r.nbytes for r in probe.ring("m").entries]
    cap = sum(sizes[-3:])
    log = DecisionLog(100, cap, on_evict=lambda p, r, n: evicted.append((p, r, n)))
    drive(log, 10)
    ring = log.ring("m")
    assert ring.stats.bytes <= cap and [r.id for r in ring.entries] == [8, 9, 10]
    assert sum(n for _, reason, n in evicted if reason == "bytes") == 7
    assert ring.stats.evicted_bytes == 7 and ring.stats.evicted_count == 0


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() walks only what it made
def test_byte_estimate_covers_what_a_record_holds() -> None:
    """tracemalloc: the ring's estimate is at least what 500 records (4 replicas) really hold beyond
    what the router allocates anyway for the same decisions (2,000 until 2026-12-01: the held bytes
    per record were the same, 0.28 of the estimate, at 500, 1,000 and 2,000)."""
    records = 500
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        log = DecisionLog(10_000, 1 << 30)
        drive(log, records, release_every=1)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    estimate = log.ring("m").stats.bytes
    assert held / records < 3 * estimate / records, (held, estimate)
    assert estimate >= 0.6 * held, (held, estimate)


def test_query_filters_newest_first_and_find() -> None:
    log = DecisionLog(100, 1 << 30)
    drive(log, 20)
    records = log.query(limit=1000)
    assert [r.id for r in records] == list(range(20, 0, -1))
    some = records[3].replica
    assert all(r.replica == some for r in log.query(replica=some))
    assert [r.id for r in log.query(since_id=17)] == [20, 19, 18]
    assert len(log.query(limit=4)) == 4
    assert log.find(7) is not None and log.find(7).id == 7  # type: ignore[union-attr]
    assert log.find(0) is None and log.find(21) is None
    assert log.query(pool="other") == []


def test_workers_give_disjoint_ids() -> None:
    """Worker i of ``kvlb serve --workers N`` numbers its decisions i+1, i+1+N, …: an id asked of
    the wrong worker is not found there, never taken for another decision."""
    logs = [DecisionLog(100, 1 << 30, id_offset=i, id_step=3) for i in range(3)]
    for log in logs:
        drive(log, 4)
    ids = [[r.id for r in log.ring("m").entries] for log in logs]
    assert ids == [[1, 4, 7, 10], [2, 5, 8, 11], [3, 6, 9, 12]]
    assert logs[1].find(5) is not None and logs[1].find(4) is None
    assert [r.id for r in logs[2].query(since_id=6)] == [12, 9]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_unchanged_weights_reproduce_every_decision(policy: str) -> None:
    """Re-running the recorded policy with its own weights changes nothing, whatever the policy
    (ties and random draws included); round robin excepted, whose rotation restarts."""
    log = DecisionLog(1000, 1 << 30)
    drive(log, 300, policy)
    records = log.ring("m").snapshot()
    result = replay("m", records, make_policy(policy), PolicyWeights(), sample=5)
    if policy == "round_robin":
        return
    assert result.changed == 0, result.sample
    assert result.before == result.after and result.sample == []


def test_sampling_with_temperature_is_reproduced() -> None:
    weights = PolicyWeights(temperature=1.0)
    log = DecisionLog(1000, 1 << 30)
    drive(log, 300, weights=weights)
    result = replay("m", log.ring("m").snapshot(), make_policy("cost"), weights)
    assert result.changed == 0


def test_changed_weights_change_decisions_and_report_both_sides() -> None:
    log = DecisionLog(1000, 1 << 30)
    drive(log, 300, release_every=50)
    records = log.ring("m").snapshot()
    cold = replay("m", records, make_policy("cost"), PolicyWeights(overlap_credit=0.0), sample=4)
    assert cold.changed > 0
    assert cold.after["predicted_cached_tokens"] < cold.before["predicted_cached_tokens"]
    assert cold.after["hit_rate"] < cold.before["hit_rate"]
    out = cold.to_json()
    assert out["changed_share"] == cold.changed / 300
    assert abs(sum(r["delta_share"] for r in out["replicas"])) < 1e-9
    assert len(out["sample"]) == 4
    ids = [s["id"] for s in out["sample"]]
    assert ids == sorted(ids, reverse=True)
    for change in out["sample"]:
        assert change["before"]["replica"] != change["after"]["replica"]
        assert set(change["before"]["terms"]) == set(REPLICAS) == set(change["after"]["terms"])
    least = replay("m", records, make_policy("least_load"), PolicyWeights())
    assert least.policy == "least_load" and least.changed > 0
    assert any("the prefix matches follow the cache" in note for note in least.notes)
    assert any("another policy" in note for note in least.notes)


def test_the_other_config_note_counts_records_made_under_other_than_the_live_config() -> None:
    """Proposed weights are what a what-if is for: decisions made under the live weights are not
    "made under other weights"; only those made before a policy change in the window are."""
    log = DecisionLog(1000, 1 << 30)
    drive(log, 120, weights=PolicyWeights(overlap_credit=0.5))
    drive(log, 80)
    records = log.ring("m").snapshot()
    proposed = PolicyWeights(overlap_credit=0.0)
    live = ("cost", PolicyWeights())
    result = replay("m", records, make_policy("cost"), proposed, live=live)
    assert result.changed > 0
    other = [note for note in result.notes if "another policy or other weights" in note]
    assert other == [
        "120 of 200 decisions were made under another policy or other weights than the live ones (a "
        "policy change in the window, or an x-kvlb-weights override): their 'before' is not what the "
        "live policy decides"
    ]
    unchanged = replay("m", records[120:], make_policy("cost"), proposed, live=live)
    assert not any("another policy or other weights" in note for note in unchanged.notes)


def test_replay_commits_nothing() -> None:
    log = DecisionLog(1000, 1 << 30)
    pool = drive(log, 50, release_every=1)
    before = pool.tracker().snapshot(10.0)
    replay("m", log.ring("m").snapshot(), make_policy("cost"), PolicyWeights(overlap_credit=0.0))
    assert pool.tracker().snapshot(10.0) == before


def test_snapshot_copies_the_newest() -> None:
    log = DecisionLog(100, 1 << 30)
    drive(log, 10)
    ring = log.ring("m")
    newest: list[DecisionRecord] = ring.snapshot(3)
    assert [r.id for r in newest] == [8, 9, 10]
    assert ring.snapshot(0) == [] and len(ring.snapshot(1000)) == 10
    drive(log, 1)
    assert [r.id for r in newest] == [8, 9, 10]


class _Rank(IntEnum):
    """An ``int`` subclass: ``marshal`` refuses it, so a record holding one is kept as it is."""

    ONE = 1


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_packed_records_read_back_exactly(policy: str) -> None:
    """The ring keeps records packed (``marshal``): each one read back (``entries``, ``snapshot``,
    ``query``, ``find``) equals the record made at commitment, value for value and type for type
    (the ``repr`` tells ``1``, ``1.0`` and ``True`` apart), for decisions of every policy with
    scraped stats, exclusions, sampling probabilities, notes, sessions and odd tenants."""
    weights = PolicyWeights(temperature=0.5, kv_usage_ceiling=0.9, imbalance_threshold_blocks=3.0)
    pool = router(1)
    tracker = pool.tracker()
    for i, replica in enumerate(REPLICAS[:3]):  # r3 never scraped: its scraped fields stay None
        tracker.observe(
            replica, EngineStats(waiting_reqs=i, running_reqs=2, kv_usage=0.3 * i, capacity_tokens=4096), 0.5
        )
    instance, rng = make_policy(policy), random.Random(3)
    log = DecisionLog(1000, 1 << 30)
    made = []
    for k in range(60):
        now = 1.0 + k * 0.01
        tokens = prefix(rng.randrange(4))[: rng.choice([16, 64, 128])] + [rng.randrange(9) for _ in range(40)]
        session = None if k % 3 else f"s{k % 5}"
        lease = pool.route(PoolRequest(tokens, instance, weights, f"q{k}", session_key=session), now)
        plan = lease.plan
        assert plan.inputs is not None
        tenant = [None, "acme", "t\udcff\u00e9", ""][k % 4]
        made.append(
            log.record(
                "m", plan.inputs, plan.decision, weights, plan.prompt_tokens, plan.cached_tokens, tenant, now
            )
        )
        if k % 2:
            lease.release(now)
    ring = log.ring("m")
    assert all(isinstance(entry.packed, bytes) for entry in ring.entries)
    for read in ([e.record() for e in ring.entries], list(ring.snapshot()), log.query(limit=1000)[::-1]):
        assert read == made
        assert [repr(r) for r in read] == [repr(r) for r in made]
    assert all(log.find(r.id) == r for r in made)
    assert ring.snapshot()[10:13] == made[10:13] and ring.snapshot(2) == made[-2:]
    assert ring.snapshot()[-1].weights is weights  # shared, not copied
    odd = dataclasses.replace(made[0].decision, dp_rank=_Rank.ONE)
    kept = log.record("m", made[0].inputs, odd, weights, 1, 0, None, 9.0)
    assert ring.entries[-1].packed is kept and log.find(kept.id) is kept


def test_whatif_reproduces_decisions_made_with_the_ramps_memory_in_seconds() -> None:
    """With ``ramp_memory_s`` the ring keeps each decision's prior average, the time it was advanced
    and the share its decision saw: the replay with the recorded weights reproduces every decision,
    each average is its prior advanced over the recorded Δt by the held share, and another memory
    is noted as replayed on the history's averages."""
    weights = PolicyWeights(ramp_memory_s=0.3)
    log = DecisionLog(1000, 1 << 30)
    pool = drive(log, 300, weights=weights, release_every=2)
    records = log.ring("m").snapshot()
    priors = [
        (r.inputs.request.ramp_share, r.inputs.request.ramp_at_s, r.inputs.request.ramp_last_share)
        for r in records
    ]
    made = [(r.decision.ramp_share, r.inputs.load.now, r.decision.busy_share) for r in records]
    assert priors[0] == (None, None, None) and priors[1:] == made[:-1]  # each from its predecessor
    average = pool.ramp_average
    assert (average.share, average.at_s, average.last_share) == made[-1]
    assert len({share for share, _, _ in made}) > 10  # the average moved
    result = replay("m", records, make_policy("cost"), weights, sample=5)
    assert result.changed == 0, result.sample
    assert not any("another ramp_memory_s" in note for note in result.notes)
    for record in records[1:]:
        inputs = record.inputs
        again = make_policy("cost")(inputs.request, inputs.overlap, inputs.load, weights, random.Random(0))
        assert again.ramp_share == record.decision.ramp_share and again.reason == record.decision.reason
        prior, prior_at_s, held = priors[records.index(record)]
        assert prior is not None and prior_at_s is not None and held is not None
        alpha = 1.0 - math.exp(-(inputs.load.now - prior_at_s) / 0.3)
        assert record.decision.ramp_share == pytest.approx(prior + alpha * (held - prior))
    off = replay("m", records, make_policy("cost"), PolicyWeights(ramp_memory_s=None), sample=5)
    assert off.changed > 0
    other = "300 of 300 decisions were made with another ramp_memory_s"
    assert any(note.startswith(other) for note in off.notes)


def test_a_ring_recorded_under_the_previous_default_replays_under_both_defaults() -> None:
    """Decisions made with the ramp's memory off (the default before 2026-11-30) carry no average:
    the weights they were made with reproduce every one, and the new default (0.2 s) replays each
    from its own busy share, so nothing changes and a note says why."""
    previous = PolicyWeights(ramp_memory_s=None)
    log = DecisionLog(1000, 1 << 30)
    drive(log, 300, weights=previous, release_every=2)
    records = log.ring("m").snapshot()
    assert all(r.inputs.request.ramp_share is None and r.decision.ramp_share is None for r in records)
    assert replay("m", records, make_policy("cost"), previous, sample=5).changed == 0
    now = replay("m", records, make_policy("cost"), PolicyWeights(), sample=5)
    assert now.weights.ramp_memory_s == 0.2 and now.decisions == 300
    assert now.changed == 0, now.sample
    fresh = "300 of 300 decisions were recorded with the ramp's memory off"
    assert any(note.startswith(fresh) for note in now.notes)
    assert not any("another ramp_memory_s" in note for note in now.notes)


def test_a_record_keeps_why_each_replica_was_not_a_candidate() -> None:
    """The router's plan names the replicas it left out with a code per reason (drained, probes
    failing, breaker open, full, already tried), and the record keeps them packed, read back equal."""
    health = HealthBook()
    for replica in REPLICAS:
        health.add(replica, probe_ok=True)
    limits = RouteLimits(max_inflight_per_replica=1, speculative_ttl_s=2.0)
    pool = PoolRouter("m", health=health, route_limits=limits, rng=random.Random(0))
    extra = ReplicaId("r4")
    health.add(extra, probe_ok=True)
    for replica in [*REPLICAS, extra]:
        pool.add_replica(replica, 16, "plain")
    health.set_draining(REPLICAS[0], True)
    health.on_probe(REPLICAS[1], False, 1.0, "refused")
    for _ in range(health.config.failure_threshold):
        health.on_failure(REPLICAS[2], 1.0, "500")
    log = DecisionLog(100, 1 << 30)
    instance, weights = make_policy("cost"), PolicyWeights()
    first = pool.route(PoolRequest(list(range(64)), instance, weights, "q0"), 1.0)
    assert first.plan.left_out == (
        (REPLICAS[0], LEFT_OUT_REASONS.index("draining")),
        (REPLICAS[1], LEFT_OUT_REASONS.index("failing health probes")),
        (REPLICAS[2], LEFT_OUT_REASONS.index("breaker open")),
    )
    busy = first.replica  # its one slot taken: full for the next request
    other = REPLICAS[3] if busy == extra else extra
    request = PoolRequest(list(range(64)), instance, weights, "q1", exclude=frozenset({other}))
    with pytest.raises(Overloaded):
        pool.route(request, 1.0)
    plan = pool.select(PoolRequest(list(range(64)), instance, weights, "q2"), 1.0)
    assert plan.decision.replica == other
    assert dict(plan.left_out)[busy] == LEFT_OUT_REASONS.index("full")
    first.release(1.0)
    plan = pool.select(PoolRequest(list(range(64)), instance, weights, "q3", exclude=frozenset({busy})), 1.0)
    assert dict(plan.left_out)[busy] == LEFT_OUT_REASONS.index("already tried")
    assert plan.inputs is not None
    record = log.record("m", plan.inputs, plan.decision, weights, 64, 0, None, 1.0, left_out=plan.left_out)
    assert isinstance(log.ring("m").entries[-1].packed, bytes)
    assert log.find(record.id) == record
    assert left_out_names(record.left_out) == {
        "r0": "draining",
        "r1": "failing health probes",
        "r2": "breaker open",
        busy: "already tried",
    }
    bare = log.record("m", plan.inputs, plan.decision, weights, 64, 0, None, 1.0)
    assert record.nbytes == bare.nbytes + 4 * LEFT_OUT_BYTES
