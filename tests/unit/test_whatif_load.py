"""The what-if moves a changed decision's load with it, and evicts where the replay overfills a
replica's pool (balancer.service.replay_load, balancer.service.replay_cache).

A replica the replay sends more traffic to must look busier to the next decisions, for as long as
the real request held its load (docs/operations.md, "What-if")."""

from __future__ import annotations

import random
from functools import partial

from balancer.health.book import HealthBook
from balancer.index.marks import prefix_marks
from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.policy.base import PolicyWeights
from balancer.policy.registry import make_policy
from balancer.routing.router import Lease, PoolRequest, PoolRouter, RouteLimits
from balancer.service.decisions import DecisionLog
from balancer.service.replay_cache import ReplayCache
from balancer.service.replay_load import ReplayLoad
from balancer.service.whatif import replay
from balancer.types import BlockKey, Decision, Overlap, ReplicaId

R0, R1 = ReplicaId("r0"), ReplicaId("r1")


def decided(replica: ReplicaId, cached_tokens: int = 0) -> Decision:
    return Decision(replica, "cost", 0, 8, cached_tokens, ())


def test_a_moved_load_leaves_its_replica_for_the_new_one_for_the_recorded_spans() -> None:
    load = ReplayLoad()
    busy = LoadSnapshot(0.0, 16, {R0: ReplicaLoad(R0, 1, 128, 8.0)})  # the recorded request itself
    assert load.load(busy) is busy
    # recorded on r0 with 128 uncached tokens; the replay put it on r1, where it finds 64 cached
    moved = load.move(
        0.0,
        decided(R0),
        decided(R1, cached_tokens=64),
        prefill_tokens=128,
        decode_blocks=10,
        block_size=16,
        prefill_s=1.0,
        held_s=3.0,
    )
    assert moved and load.held == 1
    during = load.load(LoadSnapshot(0.5, 16, {R0: ReplicaLoad(R0, 1, 128, 8.0)}))
    assert during.of(R0).pending_prefill_seqs == 0 and during.of(R0).pending_prefill_tokens == 0
    assert during.of(R1).pending_prefill_seqs == 1 and during.of(R1).pending_prefill_tokens == 64
    assert during.of(R1).pending_prefill_blocks == 4.0
    decoding = load.load(
        LoadSnapshot(2.0, 16, {R0: ReplicaLoad(R0, active_decode_seqs=1, active_decode_blocks=10)})
    )
    assert decoding.of(R0).active_decode_blocks == 0 and decoding.of(R0).pending_prefill_seqs == 0
    assert decoding.of(R1).active_decode_seqs == 1 and decoding.of(R1).active_decode_blocks == 6
    after = LoadSnapshot(3.0, 16, {})
    assert load.load(after) is after and load.held == 0 and not load.changes


def test_an_unchanged_decision_moves_nothing_and_the_bound_is_counted() -> None:
    load = ReplayLoad(max_moves=1)
    same = dict(prefill_tokens=64, decode_blocks=6, block_size=16, prefill_s=1.0, held_s=2.0)
    assert not load.move(0.0, decided(R0), decided(R0), **same)  # type: ignore[arg-type]
    assert load.move(0.0, decided(R0), decided(R1), **same)  # type: ignore[arg-type]
    assert not load.move(0.1, decided(R0), decided(R1), **same)  # type: ignore[arg-type]
    assert load.unmodelled == 1 and load.held == 1
    # in flight at the end of the window: its load stays moved
    forever = ReplayLoad()
    forever.move(
        0.0,
        decided(R0),
        decided(R1),
        prefill_tokens=64,
        decode_blocks=6,
        block_size=16,
        prefill_s=None,
        held_s=None,
    )
    late = forever.load(LoadSnapshot(1e6, 16, {}))
    assert late.of(R1).pending_prefill_seqs == 1 and late.of(R0).pending_prefill_seqs == 0


def router() -> PoolRouter:
    health = HealthBook()
    for replica in (R0, R1):
        health.add(replica, probe_ok=True)
    # speculative entries outlive the run: the index holds what was routed (no engine events here)
    limits = RouteLimits(max_inflight_per_replica=10_000, speculative_ttl_s=1_000.0)
    pool = PoolRouter("m", health=health, route_limits=limits, rng=random.Random(0))
    for replica in (R0, R1):
        pool.add_replica(replica, 16, "plain")
    return pool


def test_a_moved_request_makes_its_new_replica_busier_for_the_next_decision() -> None:
    """W warms a 64-block context on its replica ("home"); X (the context + 20 blocks) prefills
    there; A (the context + 8 blocks) joins them; B, a new 64-block prompt, goes to the other
    replica, home being busier. With ``overlap_credit=0`` A goes to the other replica instead, with
    its whole prompt to prefill, and home is idler: B, arriving while A prefills, goes home. Read
    on the recorded load (before the load model), the replay sent B to the other replica too."""
    weights = PolicyWeights(root_weight=0.0)
    log, pool, policy = DecisionLog(100, 1 << 30), router(), make_policy("cost")
    context = list(range(10_000, 10_000 + 1024))

    def route(tokens: list[int], request_id: str, now: float) -> Lease:
        lease = pool.route(PoolRequest(tokens, policy, weights, request_id), now)
        plan = lease.plan
        assert plan.inputs is not None
        record = log.record(
            "m", plan.inputs, plan.decision, weights, plan.prompt_tokens, plan.cached_tokens, None, now
        )
        lease.on_phase = partial(log.on_phase, "m", record.id, plan.inputs.load.now)
        return lease

    w = route(context, "w", 0.0)
    w.first_token(0.01)
    w.release(0.02)
    home = w.replica
    other = R1 if home == R0 else R0
    x = route(context + list(range(1, 321)), "x", 0.5)
    a = route(context + list(range(500, 628)), "a", 1.0)
    b = route(list(range(90_000, 91_024)), "b", 1.2)
    assert (x.replica, a.replica, b.replica) == (home, home, other)
    a.first_token(5.0)
    a.release(9.0)
    records = log.ring("m").snapshot()
    assert records[2].prefill_s == 4.0 and records[2].held_s == 8.0
    assert records[1].held_s is None  # X is still in flight

    assert replay("m", records, policy, weights).changed == 0
    proposed = PolicyWeights(root_weight=0.0, overlap_credit=0.0)
    result = replay("m", records, policy, proposed, sample=10)
    moved = {entry["id"]: entry["after"]["replica"] for entry in result.sample}
    assert moved == {records[2].id: other, records[3].id: home}
    assert result.model["load_moved"] == 2 and result.tallies["in_flight"] == 2
    # had A ended before B arrived, B would have read home's load as recorded: still moved (A's
    # prefill left home), but with A's load gone from the other replica too
    a_done = log.ring("m").snapshot()
    log.ring("m").amend(records[2].id, 0.05, 0.1)
    early = replay("m", log.ring("m").snapshot(), policy, proposed, sample=10)
    assert {e["id"]: e["after"]["replica"] for e in early.sample}[records[2].id] == other
    assert a_done[2].held_s == 8.0


def keys(first: int, n: int) -> list[BlockKey]:
    return [BlockKey(first + i) for i in range(n)]


def test_a_replica_the_replay_overfills_evicts_its_least_recently_placed_prefixes() -> None:
    cache = ReplayCache()
    first, second = prefix_marks(keys(1, 40), 16, 16), prefix_marks(keys(1000, 40), 16, 16)
    empty = Overlap({R0: 0, R1: 0}, request_blocks=40)
    # both routed to r0; the replay puts both on r1, whose pool holds 60 blocks and held 0
    cache.overlap([R0, R1], empty, first)
    cache.place(R0, R1, first, capacity_blocks=60.0, held_blocks=0)
    assert cache.evicted == 0
    cache.overlap([R0, R1], empty, second)
    cache.place(R0, R1, second, capacity_blocks=60.0, held_blocks=0)
    assert cache.evicted > 0
    # the real run held both on r0 (80 blocks); the replay's r1 kept the second and what of the
    # first fits: its deepest blocks went first, its leading ones stay
    recorded = Overlap({R0: 40, R1: 0}, request_blocks=40)
    again_first = cache.overlap([R0, R1], recorded, first)
    again_second = cache.overlap([R0, R1], recorded, second)
    assert again_second.blocks[R1] == 40
    assert 0 < again_first.blocks[R1] <= 20


def test_a_replay_that_places_as_recorded_evicts_nothing_of_its_own() -> None:
    cache = ReplayCache()
    prompts = [prefix_marks(keys(1000 * i, 40), 16, 16) for i in range(1, 5)]
    empty = Overlap({R0: 0, R1: 0}, request_blocks=40)
    for marks in prompts:
        cache.overlap([R0, R1], empty, marks)
        # held beyond the pool (the index's count is stale): still nothing evicted as placed as recorded
        cache.place(R0, R0, marks, capacity_blocks=50.0, held_blocks=160)
    assert cache.evicted == 0
    warm = Overlap({R0: 40, R1: 0}, request_blocks=40)
    assert all(cache.overlap([R0, R1], warm, marks) == warm for marks in prompts)


def test_the_spans_find_their_record_in_any_ring_and_skip_an_evicted_one() -> None:
    """Ids are shared by every pool's ring (and step by the workers' count): a ring's ids need not
    follow each other, and the span still lands on its own record, never a neighbour's."""
    log = DecisionLog(3, 1 << 30, id_offset=1, id_step=2)  # worker 1 of 2: ids 2, 4, 6, ...
    pool = router()
    policy, weights = make_policy("cost"), PolicyWeights()
    ids: dict[str, list[int]] = {"a": [], "b": []}
    for k in range(7):
        name = "a" if k % 3 else "b"
        plan = pool.route(PoolRequest(list(range(k * 100, k * 100 + 64)), policy, weights, f"q{k}"), k).plan
        assert plan.inputs is not None
        record = log.record(name, plan.inputs, plan.decision, weights, 64, 0, None, float(k))
        ids[name].append(record.id)
    assert ids == {"a": [4, 6, 10, 12], "b": [2, 8, 14]}
    log.on_phase("a", 6, 1.0, 1.25, False)  # ring a holds 6, 10, 12 (4 evicted): not consecutive
    log.on_phase("a", 12, 5.0, 5.5, True)
    log.on_phase("a", 4, 0.0, 9.0, True)  # evicted: nothing happens
    log.on_phase("c", 4, 0.0, 9.0, True)  # no such pool
    spans = {r.id: (r.prefill_s, r.held_s) for r in log.ring("a").snapshot()}
    assert spans == {6: (0.25, None), 10: (None, None), 12: (None, 0.5)}
    log.on_phase("b", 14, 6.0, 6.5, True)
    assert [(r.id, r.held_s) for r in log.ring("b").snapshot()] == [(2, None), (8, None), (14, 0.5)]


def test_a_moved_request_of_n_sequences_moves_its_n_sequences() -> None:
    """A request of OpenAI ``n = 4`` counts 4 sequences in the live load (the cap, the baselines'
    ``seq_load``, the interference term) and decode blocks for its uncached prompt plus
    ``4 × max_tokens``: moved, all of it leaves its recorded replica for the replayed one."""
    load = ReplayLoad()
    # recorded on r0: 128 uncached tokens, then (128 + 4 × 64) / 16 = 24 decode blocks
    moved = load.move(
        0.0,
        decided(R0),
        decided(R1),
        prefill_tokens=128,
        decode_blocks=24,
        block_size=16,
        prefill_s=1.0,
        held_s=3.0,
        sequences=4,
    )
    assert moved and load.moved == 1 and load.moved_seqs == 4
    during = load.load(LoadSnapshot(0.5, 16, {R0: ReplicaLoad(R0, 4, 128, 8.0)}))
    assert during.of(R1).pending_prefill_seqs == 4 and during.of(R1).pending_prefill_tokens == 128
    assert during.of(R0).pending_prefill_seqs == 0 and during.of(R0).pending_prefill_tokens == 0
    assert during.of(R1).seq_load == 4 and during.of(R0).seq_load == 0
    decoding = load.load(
        LoadSnapshot(2.0, 16, {R0: ReplicaLoad(R0, active_decode_seqs=4, active_decode_blocks=24)})
    )
    assert decoding.of(R1).active_decode_seqs == 4 and decoding.of(R1).active_decode_blocks == 24
    assert decoding.of(R0).active_decode_seqs == 0 and decoding.of(R0).active_decode_blocks == 0
    after = LoadSnapshot(3.0, 16, {})
    assert load.load(after) is after and not load.changes


def test_the_replay_moves_the_recorded_n_of_each_decision() -> None:
    """W warms a context on "home"; X (the context + more) is in flight there; A, ``n = 4`` on the
    context, joins home; B, a new prompt, goes to the other replica. Replayed with ``least_load``,
    A goes to the other replica (home has X) and takes its 4 sequences there: B then finds home
    (1 sequence) less loaded than the other (4) and goes home. Moving one sequence per decision,
    the replay saw home at 4 and the other at 1 and kept B where it was."""
    weights = PolicyWeights(root_weight=0.0)
    log, pool, policy = DecisionLog(100, 1 << 30), router(), make_policy("cost")
    context = list(range(10_000, 10_000 + 1024))

    def route(tokens: list[int], request_id: str, now: float, n: int = 1) -> Lease:
        request = PoolRequest(tokens, policy, weights, request_id, max_tokens=64, sequences=n)
        lease = pool.route(request, now)
        plan = lease.plan
        assert plan.inputs is not None
        record = log.record(
            "m",
            plan.inputs,
            plan.decision,
            weights,
            plan.prompt_tokens,
            plan.cached_tokens,
            None,
            now,
            decode_blocks=plan.decode_blocks,
            sequences=plan.sequences,
        )
        lease.on_phase = partial(log.on_phase, "m", record.id, plan.inputs.load.now)
        return lease

    w = route(context, "w", 0.0)
    w.first_token(0.01)
    w.release(0.02)
    home = w.replica
    other = R1 if home == R0 else R0
    x = route(context + list(range(1, 321)), "x", 0.5)
    a = route(context + list(range(500, 628)), "a", 1.0, n=4)
    b = route(list(range(90_000, 91_024)), "b", 1.2)
    assert (x.replica, a.replica, b.replica) == (home, home, other)
    records = log.ring("m").snapshot()
    assert [r.sequences for r in records] == [1, 1, 4, 1]
    assert records[3].inputs.load.of(home).seq_load == 5  # X and A's 4 sequences, as recorded

    result = replay("m", records, make_policy("least_load"), weights, sample=10)
    moved = {entry["id"]: entry["after"]["replica"] for entry in result.sample}
    assert moved == {records[2].id: other, records[3].id: home}
    assert result.model["load_moved"] == 2 and result.model["load_moved_seqs"] == 5
