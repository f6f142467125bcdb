"""The per-replica load table of ``kvlb serve --workers N``: rows, slots, overflow, a dead worker's
row, whole rows under a concurrent writer in another process, two routers sharing one table, and the
in-flight caps (``limits.max_inflight_per_replica``, ``limits.max_inflight``,
``limits.max_inflight_per_tenant``) read from every row; the tenant slots (take, free, overflow, a
dead worker's row, whole reads under a concurrent writer, a torn read given up on)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from random import Random

import pytest
from unstalled import Unstalled

from balancer.errors import ConfigError, Overloaded
from balancer.load.share import (
    LAYOUT,
    LoadShare,
    LoadTable,
    replica_key,
    row_bytes,
    table_bytes,
)
from balancer.load.share_row import TENANT_SEQ_WORD, WORD
from balancer.load.tenant_share import DICT_AFTER, PROMPT_TOKENS_FIELD, _find
from balancer.load.tracker import LoadCounts, LoadSnapshot
from balancer.policy.base import PolicyWeights, RouteRequest
from balancer.policy.registry import make_policy
from balancer.routing.router import PoolRequest, PoolRouter, RouteLimits
from balancer.service.admission import (
    DEFAULT_TENANT_KEY,
    OVERFLOW_TENANT_KEY,
    RECHECK_S,
    TENANT_INFLIGHT,
    TENANT_PROMPT_TOKENS,
    Admission,
    AdmissionLimits,
    AdmissionRefused,
    tenant_key,
)
from balancer.types import Decision, Overlap, ReplicaId

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")


@pytest.fixture
def table() -> Iterator[LoadTable]:
    made = LoadTable(workers=3, slots=2, tenant_slots=2)
    try:
        yield made
    finally:
        made.close()


def attach(table: LoadTable, index: int, **hooks: object) -> LoadShare:
    return LoadShare(table.name, index, table.workers, table.slots, table.tenant_slots, track=True, **hooks)  # type: ignore[arg-type]


def test_each_worker_reads_the_others_rows_summed_never_its_own(table: LoadTable) -> None:
    w0, w1, w2 = (attach(table, i) for i in range(3))
    w0.publisher("m")(A, LoadCounts(1, 100, 2, 20))
    w1.publisher("m")(A, LoadCounts(0, 0, 1, 7))
    w1.publisher("other")(A, LoadCounts(5, 5, 5, 5))  # another pool's replica "a": another key
    assert w2.reader("m")([A, B]) == {A: LoadCounts(1, 100, 3, 27)}
    assert w0.reader("m")([A, B]) == {A: LoadCounts(0, 0, 1, 7)}
    assert w2.reader("other")([A]) == {A: LoadCounts(5, 5, 5, 5)}
    w0.publisher("m")(A, LoadCounts())  # idle: the slot is freed
    assert w2.reader("m")([A]) == {A: LoadCounts(0, 0, 1, 7)}
    for share in (w0, w1, w2):
        share.close()


def test_slots_are_freed_when_idle_and_overflow_is_counted_once_per_episode(table: LoadTable) -> None:
    overflows: list[int] = []
    w0 = attach(table, 0, on_overflow=lambda: overflows.append(1))
    w1 = attach(table, 1)
    publish = w0.publisher("m")
    publish(A, LoadCounts(1, 10, 0, 0))
    publish(B, LoadCounts(1, 20, 0, 0))
    publish(C, LoadCounts(1, 30, 0, 0))  # two slots: C is not shared
    publish(C, LoadCounts(2, 60, 0, 0))
    assert w1.reader("m")([A, B, C]) == {A: LoadCounts(1, 10, 0, 0), B: LoadCounts(1, 20, 0, 0)}
    assert (w0.overflow_total, len(overflows)) == (1, 1)
    publish(A, LoadCounts())  # A's slot goes free; C's next change takes it, with its full totals
    publish(C, LoadCounts(2, 61, 0, 0))
    assert w1.reader("m")([A, B, C]) == {B: LoadCounts(1, 20, 0, 0), C: LoadCounts(2, 61, 0, 0)}
    w0.close()
    w1.close()


def test_a_dead_workers_row_is_zeroed_by_the_supervisor_and_a_new_worker_starts_empty(
    table: LoadTable,
) -> None:
    w0, w1 = attach(table, 0), attach(table, 1)
    w0.publisher("m")(A, LoadCounts(3, 300, 0, 0))
    assert w1.reader("m")([A]) == {A: LoadCounts(3, 300, 0, 0)}
    table.zero_row(0)  # worker 0 exited
    assert w1.reader("m")([A]) == {}
    w0.publisher("m")(B, LoadCounts(1, 1, 0, 0))
    restarted = attach(table, 0)  # its restart empties the row again
    assert w1.reader("m")([A, B]) == {}
    for share in (restarted, w1, w0):  # w0 last: its close empties row 0 once more
        share.close()


def test_size_and_keys() -> None:
    assert row_bytes(1024) == 40 + 40 * 1024
    assert row_bytes(1024, 64) == 40 + 40 * 1024 + 32 * 64
    assert table_bytes(3, 1024, 64) == 3 * row_bytes(1024, 64) + 24
    assert replica_key("m", "a") == replica_key("m", "a") != replica_key("n", "a")
    assert 0 < replica_key("m", "a") < 2**63
    with LoadTableFor(2, 4) as small, pytest.raises(ValueError, match="smaller"):
        LoadShare(small.name, 0, 2, 8, track=True)
    with LoadTableFor(2, 4) as small, pytest.raises(ValueError, match="smaller"):
        LoadShare(small.name, 0, 2, 4, 1, track=True)  # no room for a tenant slot
    keys = {tenant_key("a"), tenant_key("b"), tenant_key(""), DEFAULT_TENANT_KEY, OVERFLOW_TENANT_KEY}
    assert len(keys) == 5 and all(0 < key < 2**63 for key in keys)
    assert tenant_key("a") == tenant_key("a") != replica_key("", "a")


class LoadTableFor:
    def __init__(self, workers: int, slots: int, tenant_slots: int = 0) -> None:
        self.table = LoadTable(workers, slots, tenant_slots)

    def __enter__(self) -> LoadTable:
        return self.table

    def __exit__(self, *exc: object) -> None:
        self.table.close()


WRITER = textwrap.dedent(
    """
    import sys, time
    from balancer.load.share import LoadShare
    from balancer.load.tracker import LoadCounts
    share = LoadShare(sys.argv[1], 0, 2, 4)
    publish = share.publisher("m")
    print("ready", flush=True)
    n, stop = 0, time.monotonic() + float(sys.argv[2])
    while time.monotonic() < stop:
        n += 1
        publish("a", LoadCounts(n, 100 * n, n, 7 * n))
        share.publish_admitted(n)
    publish("a", LoadCounts(9, 900, 9, 63))
    print(n, flush=True)
    """
)


def test_rows_read_whole_while_another_process_writes() -> None:
    """The seqlock: every read of a row another process rewrites as fast as it can is one whole
    write (its four fields belong together), and the writer's last write is what stays."""
    with LoadTableFor(2, 4) as table:
        reader = LoadShare(table.name, 1, 2, 4, track=True)
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, table.name, "1.0"], stdout=subprocess.PIPE, text=True
        )
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        reads = 0
        while writer.poll() is None:
            counts = reader.reader("m")([A]).get(A)
            if counts is not None:
                n = counts.prefill_seqs
                assert counts == LoadCounts(n, 100 * n, n, 7 * n)
                reads += 1
        writes = int(writer.stdout.read().split()[0])
        assert writer.wait() == 0 and writes > 100 and reads > 100
        assert reader.reader("m")([A]) == {A: LoadCounts(9, 900, 9, 63)}
        reader.close()


def test_the_header_words_never_pass_through_a_lower_value_while_another_process_writes() -> None:
    """``seq`` and ``admitted`` only grow while the writer counts up: each store is one 8-byte
    store. (``struct.pack_into`` zeroes a field before writing it, so ``seq`` read 0, an even value,
    in about one read in five, and a seqlock reader could take a half-written row as whole.)"""
    with LoadTableFor(2, 4) as table:
        reader = LoadShare(table.name, 1, 2, 4, track=True)
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, table.name, "1.0"], stdout=subprocess.PIPE, text=True
        )
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        attached = shared_memory.SharedMemory(name=table.name)  # the layout: row 0's seq is word 0
        assert attached.buf is not None
        words = attached.buf.cast("q")
        seq = admitted = reads = 0
        while writer.poll() is None:
            seq_now, admitted_now = words[0], reader.peer_admitted()
            assert seq_now >= seq and admitted_now >= admitted
            seq, admitted, reads = seq_now, admitted_now, reads + 1
        writes = int(writer.stdout.read().split()[0])
        assert writer.wait() == 0 and writes > 100 and reads > 100
        assert words[0] % 2 == 0 and reader.peer_admitted() == writes
        words.release()
        attached.close()
        reader.close()


def router(share: LoadShare, cap: int = 256) -> PoolRouter:
    made = PoolRouter("m", route_limits=RouteLimits(max_inflight_per_replica=cap))
    made.add_replica(A, 16, "plain")
    made.add_replica(B, 16, "plain")
    made.tracker().on_change = share.publisher("m")
    made.peer_load = share.reader("m")
    return made


def test_a_request_routed_by_one_worker_weighs_in_the_others_policy(table: LoadTable) -> None:
    """Two routers (two workers) on one table: the second sends a new prompt away from the replica
    the first just loaded with a long prefill, and its snapshot says whose load that is."""
    w0, w1 = attach(table, 0), attach(table, 1)
    first, second = router(w0), router(w1)
    prompt = list(range(5000, 5000 + 4096))
    lease = first.route(PoolRequest(prompt, make_policy("cost"), PolicyWeights(), "r0"), now=1.0)
    loaded = lease.replica
    other = B if loaded == A else A
    plan = second.select(
        PoolRequest(list(range(9000, 9000 + 4096)), make_policy("cost"), PolicyWeights(), "r1"), 1.1
    )
    assert plan.decision.replica == other
    assert plan.inputs is not None
    seen = plan.inputs.load.of(loaded)
    assert (seen.pending_prefill_seqs, seen.pending_prefill_tokens, seen.peer_seqs) == (1, 4096, 1)
    assert second.in_flight(loaded) == 0  # its own part (``/metrics``)
    assert second.in_flight_total(loaded) == 1  # what the per-replica cap reads
    lease.release(now=1.2)
    assert second.load_snapshot(1.3).of(loaded).in_flight_seqs == 0
    w0.close()
    w1.close()


def ask(index: int) -> PoolRequest:
    return PoolRequest(
        list(range(100 * index, 100 * index + 64)), make_policy("round_robin"), PolicyWeights(), f"r{index}"
    )


def test_the_per_replica_cap_counts_every_workers_requests(table: LoadTable) -> None:
    """Cap 1, two replicas, two workers: a replica one worker loaded is no candidate of the other,
    both full refuse with Overloaded (429 with Retry-After) on either worker, and a release on one
    worker frees the slot for the other."""
    w0, w1 = attach(table, 0), attach(table, 1)
    first, second = router(w0, cap=1), router(w1, cap=1)
    lease = first.route(ask(0), now=1.0)
    other = B if lease.replica == A else A
    assert second.candidates(now=1.1) == [other]
    assert second.in_flight_total(lease.replica) == 1 and second.in_flight(lease.replica) == 0
    taken = second.route(ask(1), now=1.2)
    assert taken.replica == other
    for worker in (first, second):
        assert not worker.has_free_slot(now=1.3)
        with pytest.raises(Overloaded) as refused:
            worker.route(ask(2), now=1.3)
        assert refused.value.retry_after_s >= 1
    lease.release(now=1.4)
    assert second.has_free_slot(now=1.5)
    assert second.route(ask(3), now=1.5).replica == lease.replica
    assert (first.in_flight_total(A), first.in_flight_total(B)) == (1, 1)
    w0.close()
    w1.close()


class PrefersA:
    """A policy (the protocol, no kvlb class replaced) that runs ``meanwhile`` once while it decides,
    as another worker's request would run between this worker's cap check and its commitment, and
    then chooses A when A is a candidate."""

    name = "prefers_a"

    def __init__(self, meanwhile: Callable[[], object]) -> None:
        self.meanwhile: Callable[[], object] | None = meanwhile

    def __call__(
        self, request: RouteRequest, overlap: Overlap, load: LoadSnapshot, weights: PolicyWeights, rng: Random
    ) -> Decision:
        if self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()
        replica = A if A in request.candidates else request.candidates[0]
        return Decision(replica, self.name, 0, request.request_blocks, 0, ())


def test_a_replica_filled_by_another_worker_while_this_one_plans_is_not_taken(table: LoadTable) -> None:
    """Cap 1: while worker 1 decides for A (A was free when it took its candidates), worker 0 routes
    to A; worker 1 reads A's count again before committing and goes to B instead, and with B full
    too it refuses (Overloaded), never putting a second request on A."""
    w0, w1 = attach(table, 0), attach(table, 1)
    first, second = router(w0, cap=1), router(w1, cap=1)
    leases = []
    policy = PrefersA(
        lambda: leases.append(
            first.route(PoolRequest([1] * 64, PrefersA(lambda: None), PolicyWeights(), "x"), 1.0)
        )
    )
    lease = second.route(PoolRequest([2] * 64, policy, PolicyWeights(), "y"), now=1.0)
    assert [held.replica for held in leases] == [A] and lease.replica == B
    assert (second.in_flight_total(A), second.in_flight_total(B)) == (1, 1)
    lease.release(now=1.1)
    racing = PrefersA(
        lambda: leases.append(
            first.route(PoolRequest([3] * 64, PrefersA(lambda: None), PolicyWeights(), "z"), 1.2)
        )
    )
    with pytest.raises(Overloaded):
        second.route(PoolRequest([4] * 64, racing, PolicyWeights(), "w"), now=1.2)
    assert [held.replica for held in leases] == [A, B]
    assert (first.in_flight_total(A), first.in_flight_total(B)) == (1, 1)
    w0.close()
    w1.close()


def gate(share: LoadShare, max_inflight: int, queued: int, timeout_s: float) -> Admission:
    made = Admission(AdmissionLimits(max_inflight, queued, timeout_s))
    made.on_change = share.publish_admitted
    made.peers = share.peer_admitted
    return made


async def test_max_inflight_counts_every_workers_admitted_requests(table: LoadTable) -> None:
    """``max_inflight`` 2 over two workers' admissions on one table: the second worker queues while
    the first holds both slots, is refused at once when its queue is full (429) and after the
    timeout (503), and takes a slot the first frees (seen by polling, no wake-up across processes)."""
    w0, w1 = attach(table, 0), attach(table, 1)
    first, second = gate(w0, 2, 1, 1.0), gate(w1, 2, 1, 1.0)
    await first.enter(first.deadline())
    await first.enter(first.deadline())
    assert (w1.peer_admitted(), w0.peer_admitted()) == (2, 0)
    waiting = asyncio.create_task(second.enter(second.deadline()))
    await asyncio.sleep(0.1)
    assert not waiting.done() and second.inflight == 0 and second.queued == 1
    with pytest.raises(AdmissionRefused) as full:
        await second.enter(second.deadline())
    assert (full.value.status, full.value.reason) == (429, "queue_full")
    first.leave()
    async with asyncio.timeout(1.0):
        await waiting
    assert (second.inflight, w0.peer_admitted(), w1.peer_admitted()) == (1, 1, 1)
    with pytest.raises(AdmissionRefused) as late:  # 1 + 1 admitted: the first worker is full too
        await first.enter(asyncio.get_running_loop().time() + 0.1)
    assert (late.value.status, late.value.reason) == (503, "queue_timeout")
    second.leave()
    first.leave()
    assert w0.peer_admitted() == w1.peer_admitted() == 0
    w0.close()
    w1.close()


KA, KB, KC = tenant_key("a"), tenant_key("b"), tenant_key("c")


def test_each_worker_reads_the_others_tenant_counts_summed_never_its_own(table: LoadTable) -> None:
    w0, w1, w2 = (attach(table, i) for i in range(3))
    w0.publish_tenant(KA, 3)
    w1.publish_tenant(KA, 2)
    w1.publish_tenant(KB, 1)
    assert [w2.peer_tenant_admitted(key) for key in (KA, KB, KC)] == [5, 1, 0]
    assert (w0.peer_tenant_admitted(KA), w1.peer_tenant_admitted(KA)) == (2, 3)
    w0.publish_tenant(KA, 4)  # a change of a tenant holding its slot
    assert w2.peer_tenant_admitted(KA) == 6
    w0.publish_tenant(KA, 0)  # nothing in flight: the slot is freed
    assert w2.peer_tenant_admitted(KA) == 2
    w1.publish_tenant(KA, 0)
    w1.publish_tenant(KB, 0)
    assert (w2.peer_tenant_admitted(KA), w2.peer_tenant_admitted(KB)) == (0, 0)
    w0.publish_tenant(KC, 0)  # a tenant idle here takes no slot
    assert w0._tenants.slots.slot_of == {} and w1._tenants.slots.slot_of == {}
    for share in (w0, w1, w2):
        share.close()


def test_tenant_slots_are_freed_when_idle_and_overflow_is_counted_once_per_episode(
    table: LoadTable,
) -> None:
    overflows: list[int] = []
    w0 = attach(table, 0, on_tenant_overflow=lambda: overflows.append(1))
    w1 = attach(table, 1)
    w0.publish_tenant(KA, 1)
    w0.publish_tenant(KB, 2)
    w0.publish_tenant(KC, 3)  # two tenant slots: C is not shared
    w0.publish_tenant(KC, 4)
    assert [w1.peer_tenant_admitted(key) for key in (KA, KB, KC)] == [1, 2, 0]
    assert (w0.tenant_overflow_total, len(overflows), w0.overflow_total) == (1, 1, 0)
    w0.publish_tenant(KA, 0)  # A's slot goes free; C's next change takes it, with its full count
    w0.publish_tenant(KC, 5)
    assert [w1.peer_tenant_admitted(key) for key in (KA, KB, KC)] == [0, 2, 5]
    w0.publish_tenant(KC, 0)
    w0.publish_tenant(KB, 0)
    w0.publish_tenant(KA, 1)  # after an idle spell a tenant may overflow again, counted again
    w0.publish_tenant(KB, 1)
    w0.publish_tenant(KC, 1)
    assert (w0.tenant_overflow_total, len(overflows)) == (2, 2)
    w0.close()
    w1.close()


def test_the_tenant_slots_leave_the_replica_slots_and_the_admitted_count_alone(table: LoadTable) -> None:
    """The two sections of a row have their own seqlocks: a tenant change does not make the other
    workers read the replica slots again, and the reverse."""
    w0, w1 = attach(table, 0), attach(table, 1)
    w0.publisher("m")(A, LoadCounts(1, 10, 0, 0))
    w0.publish_admitted(3)
    w0.publish_tenant(KA, 3)
    before = w1.peer_totals()
    w0.publish_tenant(KA, 2)
    assert w1.peer_totals() is before and w1.peer_admitted() == 3
    w0.publisher("m")(A, LoadCounts(2, 20, 0, 0))
    assert w1.peer_tenant_admitted(KA) == 2 and w1.reader("m")([A]) == {A: LoadCounts(2, 20, 0, 0)}
    w0.close()
    w1.close()


def test_a_dead_workers_tenant_counts_are_zeroed_and_a_new_worker_starts_empty(table: LoadTable) -> None:
    w0, w1 = attach(table, 0), attach(table, 1)
    w0.publish_tenant(KA, 2)
    w0.publish_tenant(DEFAULT_TENANT_KEY, 1)
    assert (w1.peer_tenant_admitted(KA), w1.peer_tenant_admitted(DEFAULT_TENANT_KEY)) == (2, 1)
    table.zero_row(0)  # worker 0 exited
    assert (w1.peer_tenant_admitted(KA), w1.peer_tenant_admitted(DEFAULT_TENANT_KEY)) == (0, 0)
    w0.publish_tenant(KB, 1)
    restarted = attach(table, 0)
    assert w1.peer_tenant_admitted(KB) == 0
    restarted.publish_tenant(KB, 1)
    assert w1.peer_tenant_admitted(KB) == 1
    for share in (restarted, w1, w0):
        share.close()


def test_a_restarted_workers_tenant_counts_are_never_taken_for_a_read_of_the_dead_ones(
    table: LoadTable,
) -> None:
    """A reader keeps a peer's tenant slots as last read while that row's ``tenant_seq`` stays the
    same, so the seqlock word must only grow, through the supervisor's zeroing and the restarted
    worker's own: were it reset, the restarted worker's first change would bring it back to the
    value of the dead one's first change and the reader would answer with the dead worker's counts."""
    w0, w1 = attach(table, 0), attach(table, 1)
    w0.publish_tenant(KA, 3)
    assert w1.peer_tenant_admitted(KA) == 3  # the reader keeps this read
    table.zero_row(0)  # worker 0 exited
    restarted = attach(table, 0)
    restarted.publish_tenant(KA, 5)  # its first change, as the dead worker's was
    assert w1.peer_tenant_admitted(KA) == 5
    for share in (restarted, w1, w0):
        share.close()


def test_a_tenant_row_caught_mid_update_is_given_up_on_and_its_last_whole_read_used(table: LoadTable) -> None:
    """A writer that stopped between its two seqlock stores (odd ``tenant_seq``): the reader tries
    :data:`READ_ATTEMPTS` times, counts a torn read and answers with that row's last whole read."""
    torn: list[int] = []
    w0, w1 = attach(table, 0), attach(table, 1, on_torn=lambda: torn.append(1))
    w0.publish_tenant(KA, 2)
    assert w1.peer_tenant_admitted(KA) == 2
    attached = shared_memory.SharedMemory(name=table.name)
    assert attached.buf is not None
    words = attached.buf.cast("q")
    words[TENANT_SEQ_WORD] += 1  # row 0: the writer is "mid-update"
    words[(40 + 2 * 40) // 8 + 1] = 7  # its slot 0's count, half-written
    assert w1.peer_tenant_admitted(KA) == 2 and (w1.torn_reads_total, len(torn)) == (1, 1)
    words[TENANT_SEQ_WORD] += 1  # the update done
    assert w1.peer_tenant_admitted(KA) == 7 and w1.torn_reads_total == 1
    words.release()
    attached.close()
    w0.close()
    w1.close()


TENANT_WRITER = textwrap.dedent(
    """
    import sys, time
    from balancer.load.share import LoadShare
    share = LoadShare(sys.argv[1], 0, 2, 1, 1)
    a, b = int(sys.argv[3]), int(sys.argv[4])
    print("ready", flush=True)
    n, stop = 0, time.monotonic() + float(sys.argv[2])
    while time.monotonic() < stop:
        n += 1
        share.publish_tenant(a, 2 * n + 1)  # a's counts are odd, b's even, in the same one slot
        share.publish_tenant(a, 0)
        share.publish_tenant(b, 2 * n)
        share.publish_tenant(b, 0)
    share.publish_tenant(a, 9)
    print(n, flush=True)
    """
)


def test_tenant_slots_read_whole_while_another_process_writes() -> None:
    """The tenant seqlock: two tenants take turns in one slot of a row another process rewrites as
    fast as it can; a read never gives one tenant the other's count (a's are odd, b's even)."""
    with LoadTableFor(2, 1, 1) as table:
        reader = LoadShare(table.name, 1, 2, 1, 1, track=True)
        writer = subprocess.Popen(
            [sys.executable, "-c", TENANT_WRITER, table.name, "1.0", str(KA), str(KB)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        reads = {KA: 0, KB: 0}
        while writer.poll() is None:
            for key, parity in ((KA, 1), (KB, 0)):
                n = reader.peer_tenant_admitted(key)
                if n:
                    assert n % 2 == parity, (key, n)
                    reads[key] += 1
        writes = int(writer.stdout.read().split()[0])
        assert writer.wait() == 0 and writes > 100 and min(reads.values()) > 10, (writes, reads)
        assert (reader.peer_tenant_admitted(KA), reader.peer_tenant_admitted(KB)) == (9, 0)
        reader.close()


def tenant_gate(share: LoadShare, max_inflight: int, per_tenant: int, timeout_s: float) -> Admission:
    made = Admission(AdmissionLimits(max_inflight, 8, timeout_s, max_inflight_per_tenant=per_tenant))
    made.on_change = share.publish_admitted
    made.peers = share.peer_admitted
    made.on_tenant_change = share.publish_tenant
    made.tenant_peers = share.peer_tenant_admitted
    return made


async def test_max_inflight_per_tenant_counts_every_workers_requests_of_the_tenant(table: LoadTable) -> None:
    """Per-tenant cap 2 over two workers' admissions on one table: the second worker's request of
    tenant A waits while the first holds A's two slots (B's goes in at once), and takes the slot
    the first frees (seen at a recheck); the default tenant is one tenant across workers too."""
    w0, w1 = attach(table, 0), attach(table, 1)
    first, second = tenant_gate(w0, 8, 2, 1.0), tenant_gate(w1, 8, 2, 1.0)
    a0, a1 = first.tenant("a"), second.tenant("a")
    assert first.try_enter(0, a0) and first.try_enter(0, a0)
    assert w1.peer_tenant_admitted(KA) == 2
    waiting = asyncio.create_task(second.enter(second.deadline(), 0, a1))
    await asyncio.sleep(0.1)
    assert not waiting.done() and second.queued == 1
    assert second.try_enter(0, second.tenant("b"))  # another tenant goes on meanwhile
    first.leave(0, a0)
    async with asyncio.timeout(1.0):
        await waiting
    assert (a0.inflight, a1.inflight) == (1, 1)
    assert (w0.peer_tenant_admitted(KA), w1.peer_tenant_admitted(KA)) == (1, 1)
    with pytest.raises(AdmissionRefused) as late:  # 1 + 1 of A: the first worker is at A's cap too
        await first.enter(asyncio.get_running_loop().time() + 0.1, 0, a0)
    assert (late.value.status, late.value.limit) == (503, TENANT_INFLIGHT)
    assert first.try_enter() and first.try_enter() and second.try_enter() is False  # default: cap 2
    for gate, tenant in ((second, a1), (second, second.tenant("b")), (first, a0)):
        gate.leave(0, tenant)
    first.leave()
    first.leave()
    assert [w.peer_tenant_admitted(key) for w in (w0, w1) for key in (KA, KB, DEFAULT_TENANT_KEY)] == [0] * 6
    w0.close()
    w1.close()


def test_a_key_is_found_only_at_a_slots_start_and_counts_below_zero_read_as_zero() -> None:
    key = 0x0102_0304_0506_0708
    packed = WORD.pack(key)
    straddling = WORD.unpack(b"\0\0\0\0" + packed[:4])[0], WORD.unpack(packed[4:] + b"\0\0\0\0")[0]
    raw = b"".join(WORD.pack(word) for word in (*straddling, 0, 0, key, 5, 7, 9, KB, -3, -4, -5))
    assert raw.find(packed) == 4  # the key's bytes first show up across the first slot's two words
    assert (_find(raw, key), _find(raw, KB), _find(raw, KA), _find(b"", key)) == (5, 0, 0, 0)
    tokens = (_find(raw, key, PROMPT_TOKENS_FIELD), _find(raw, KB, PROMPT_TOKENS_FIELD), _find(raw, key, 3))
    assert tokens == (7, 0, 9)


def test_a_read_asked_about_often_is_looked_up_in_a_dict_with_the_same_answers(table: LoadTable) -> None:
    w0, w1 = attach(table, 0), attach(table, 1)
    w0.publish_tenant(KA, 3)
    w0.publish_tenant(KB, 1)
    answers = [(w1.peer_tenant_admitted(KA), w1.peer_tenant_admitted(KC)) for _ in range(DICT_AFTER)]
    assert set(answers) == {(3, 0)} and w1._tenants.reads[0].counts == {KA: (3, 0, 0), KB: (1, 0, 0)}
    w0.publish_tenant(KA, 2)  # a new read: searched again, no dict yet
    assert w1.peer_tenant_admitted(KA) == 2 and w1._tenants.reads[0].counts is None
    w0.close()
    w1.close()


def test_a_worker_of_another_layout_refuses_to_map_the_table_and_says_why() -> None:
    """The table ends with its layout: a worker expecting another one (same size, other split of
    replica and tenant slots; or a table of a release that wrote no layout: zeros) refuses it with
    both layouts named, instead of reading the rows wrongly."""
    with LoadTableFor(2, 4, 5) as made:  # 40 + 4 x 40 + 5 x 32 = 360 bytes a row
        with pytest.raises(ConfigError, match="has layout 0x6b766c6200000002 with 4 replica slots and 5"):
            LoadShare(made.name, 0, 2, 8, 0, track=True)  # 40 + 8 x 40 = 360 bytes a row too
        LoadShare(made.name, 0, 2, 4, 5, track=True).close()  # its own layout maps
    old = shared_memory.SharedMemory(create=True, size=table_bytes(2, 3, 5))  # all zeros
    try:
        with pytest.raises(ConfigError, match=r"has layout 0x0 .* restart the whole service"):
            LoadShare(old.name, 0, 2, 3, 5, track=True)
    finally:
        old.close()
        old.unlink()
    assert int.from_bytes(b"kvlb", "big") == LAYOUT >> 32


def test_the_prompt_tokens_of_a_tenant_are_shared_and_keep_its_slot_until_both_counts_are_zero(
    table: LoadTable,
) -> None:
    w0, w1, w2 = (attach(table, i) for i in range(3))
    w0.publish_tenant(KA, 1)
    w0.publish_tenant_tokens(KA, 500)
    w1.publish_tenant_tokens(KA, 300)  # a slot taken by tokens alone
    assert (w2.peer_tenant_prompt_tokens(KA), w2.peer_tenant_admitted(KA)) == (800, 1)
    assert (w0.peer_tenant_prompt_tokens(KA), w1.peer_tenant_prompt_tokens(KA)) == (300, 500)
    w0.publish_tenant(KA, 0)  # no request of A here, but its tokens still held: the slot stays
    assert (w2.peer_tenant_prompt_tokens(KA), w2.peer_tenant_admitted(KA)) == (800, 0)
    w0.publish_tenant_tokens(KA, 0)  # both zero: freed, and B takes the freed slot with zeroed tokens
    w0.publish_tenant(KB, 2)
    assert (w2.peer_tenant_prompt_tokens(KA), w2.peer_tenant_prompt_tokens(KB)) == (300, 0)
    assert w2.peer_tenant_admitted(KB) == 2
    for _ in range(DICT_AFTER):  # the same answers from the read made into a dict
        assert (w2.peer_tenant_prompt_tokens(KA), w2.peer_tenant_admitted(KB)) == (300, 2)
    w1.publish_tenant_tokens(KA, 0)
    w0.publish_tenant(KB, 0)
    assert [w2.peer_tenant_prompt_tokens(key) for key in (KA, KB)] == [0, 0]
    assert w0.tenant_overflow_total == w1.tenant_overflow_total == 0
    for share in (w0, w1, w2):
        share.close()


def token_gate(share: LoadShare, cap: int, timeout_s: float) -> Admission:
    made = Admission(AdmissionLimits(64, 8, timeout_s, max_inflight_prompt_tokens_per_tenant=cap))
    made.on_tenant_tokens = share.publish_tenant_tokens
    made.tenant_token_peers = share.peer_tenant_prompt_tokens
    return made


async def test_max_inflight_prompt_tokens_per_tenant_counts_every_workers_prompts_of_the_tenant(
    table: LoadTable,
) -> None:
    """Allowance 1,000 prompt tokens over two workers' admissions on one table: with 800 of tenant A
    held on the first worker, the second worker's 300 of A wait (B's go at once) until the first
    gives its tokens back (seen at a recheck, within a few ``RECHECK_S``); one that cannot fit before
    its deadline is a 429 naming the tenant's tokens on both workers."""
    w0, w1 = attach(table, 0), attach(table, 1)
    first, second = token_gate(w0, 1000, 1.0), token_gate(w1, 1000, 1.0)
    loop = asyncio.get_running_loop()
    a0, a1 = first.tenant("a"), second.tenant("a")
    assert not await first.take_prompt_tokens(a0, 800, loop.time() + 1)
    assert w1.peer_tenant_prompt_tokens(KA) == 800
    waiting = asyncio.create_task(second.take_prompt_tokens(a1, 300, loop.time() + 1))
    await asyncio.sleep(0.15)
    assert not waiting.done() and a1.prompt_tokens == 0
    assert not await second.take_prompt_tokens(second.tenant("b"), 900, loop.time() + 1)  # B goes on
    freed = Unstalled()  # a loaded machine's stall of this process is not the gate's wait
    first.give_back_prompt_tokens(a0, 800)
    async with asyncio.timeout(1.0):
        assert await waiting  # it waited
    assert freed.seconds() < 3 * RECHECK_S
    assert (w0.peer_tenant_prompt_tokens(KA), w1.peer_tenant_prompt_tokens(KA)) == (300, 0)
    with pytest.raises(AdmissionRefused) as late:  # 300 of A on the second worker: 800 more do not fit
        await first.take_prompt_tokens(a0, 800, loop.time() + 0.15)
    assert (late.value.status, late.value.limit) == (429, TENANT_PROMPT_TOKENS)
    assert "this tenant has 300 prompt tokens in flight" in late.value.message
    assert not await first.take_prompt_tokens(a0, 700, loop.time() + 1)  # 700 + 300 fit exactly
    first.give_back_prompt_tokens(a0, 700)
    second.give_back_prompt_tokens(a1, 300)
    second.give_back_prompt_tokens(second.tenant("b"), 900)
    assert [w.peer_tenant_prompt_tokens(key) for w in (w0, w1) for key in (KA, KB)] == [0] * 4
    w0.close()
    w1.close()
