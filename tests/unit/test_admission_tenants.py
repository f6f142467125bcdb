"""Tenant isolation at admission: waiters admitted round-robin across tenants, each tenant's caps on
slots and queue places, the bounded tenant table and its overflow tenant, the byte budget's order
across tenants, every way out giving everything back, and (``kvlb serve --workers N``) the other
workers' requests counted against each tenant's cap through plain functions. Drives
:class:`balancer.service.admission.Admission` on the event loop (no I/O)."""

from __future__ import annotations

import asyncio

import pytest
from unstalled import Unstalled

from balancer.service.admission import (
    DEFAULT_TENANT_KEY,
    MAX_BYTES,
    OVERFLOW_TENANT_KEY,
    RECHECK_S,
    TENANT_CHARS,
    TENANT_INFLIGHT,
    TENANT_QUEUE,
    Admission,
    AdmissionLimits,
    AdmissionRefused,
    tenant_key,
)


def admission(
    inflight: int = 1,
    queued: int = 16,
    timeout_s: float = 5.0,
    budget: int = 2**40,
    per_tenant: int | None = None,
    queued_per_tenant: int | None = None,
    tenants: int = 1024,
) -> Admission:
    return Admission(
        AdmissionLimits(
            inflight,
            queued,
            timeout_s,
            budget,
            max_inflight_per_tenant=per_tenant or inflight,
            max_queued_per_tenant=queued if queued_per_tenant is None else queued_per_tenant,
            max_tenants=tenants,
        )
    )


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_waiters_are_admitted_round_robin_across_tenants_each_tenants_in_order() -> None:
    gate = admission(inflight=8)
    z = gate.tenant("z")
    for _ in range(8):
        assert gate.try_enter(0, z)
    order: list[str] = []

    async def request(name: str) -> None:
        await gate.enter(gate.deadline(), 0, gate.tenant(name[0]))
        order.append(name)

    tasks = [asyncio.create_task(request(f"a{i}")) for i in range(1, 6)]
    await settle()
    tasks += [asyncio.create_task(request("b1")), asyncio.create_task(request("c1"))]
    await settle()
    assert gate.queued == 7 and not gate.try_enter(0, gate.tenant("b"))
    for _ in range(7):
        gate.leave(0, z)
    await asyncio.gather(*tasks)
    # A came first with 5 waiters; B's and C's single ones get their turns right after A's first.
    assert order == ["a1", "b1", "c1", "a2", "a3", "a4", "a5"]
    for name in "aaaaabcz":
        gate.leave(0, gate.tenant(name))
    assert (gate.inflight, gate.queued, gate.tenants, gate.body_bytes) == (0, 0, 0, 0)


async def test_a_tenant_that_held_every_slot_takes_its_turn_after_the_tenants_waiting() -> None:
    """A tenant's turn comes again at the back of the ring once it is below its cap: with the caps at
    the global ones, the tenant holding the only slot lets the others' waiters go first."""
    gate = admission(inflight=1)
    a = gate.tenant("a")
    assert gate.try_enter(0, a)
    order: list[str] = []

    async def request(name: str) -> None:
        tenant = gate.tenant(name[0])
        await gate.enter(gate.deadline(), 0, tenant)
        order.append(name)
        await asyncio.sleep(0)
        gate.leave(0, tenant)

    tasks = [asyncio.create_task(request(name)) for name in ("a1", "a2", "b1", "c1")]
    await settle()
    gate.leave(0, a)
    await asyncio.gather(*tasks)
    assert order == ["b1", "c1", "a1", "a2"]
    assert (gate.inflight, gate.queued, gate.tenants) == (0, 0, 0)


async def test_a_tenant_at_its_slot_cap_waits_while_another_tenant_enters_at_once() -> None:
    gate = admission(inflight=4, per_tenant=2, timeout_s=0.05)
    a, b = gate.tenant("a"), gate.tenant("b")
    assert gate.try_enter(0, a) and gate.try_enter(0, a)
    assert not gate.try_enter(0, a)  # a free slot of the service, none of A's
    with pytest.raises(AdmissionRefused) as refused:
        await gate.enter(gate.deadline(), 0, a)
    assert (refused.value.status, refused.value.reason, refused.value.limit) == (
        503,
        "queue_timeout",
        TENANT_INFLIGHT,
    )
    assert "limits.max_inflight_per_tenant = 2" in refused.value.message and refused.value.retry_after_s >= 1
    waiting = asyncio.create_task(gate.enter(gate.deadline() + 5, 0, a))
    await settle()
    assert gate.queued == 1
    assert gate.try_enter(0, b) and gate.try_enter(0, b)  # A's waiter does not hold B back
    assert not gate.try_enter(0, b) and gate.inflight == 4
    gate.leave(0, b)  # a slot of the service, but A is still at its cap: nobody of A's enters
    await settle()
    assert not waiting.done() and gate.inflight == 3
    gate.leave(0, a)  # A below its cap again: its waiter takes the slot
    await waiting
    assert gate.inflight == 3 and gate.queued == 0
    for tenant in (a, a, b):
        gate.leave(0, tenant)
    assert (gate.inflight, gate.tenants) == (0, 0)


async def test_a_tenant_over_its_queue_places_is_refused_at_once_and_others_still_queue() -> None:
    gate = admission(inflight=1, queued=4, queued_per_tenant=1)
    a, b = gate.tenant("a"), gate.tenant("b")
    assert gate.try_enter(0, a)
    first = asyncio.create_task(gate.enter(gate.deadline(), 0, a))
    await settle()
    with pytest.raises(AdmissionRefused) as refused:
        await gate.enter(gate.deadline(), 0, a)
    assert (refused.value.status, refused.value.reason, refused.value.limit) == (
        429,
        "queue_full",
        TENANT_QUEUE,
    )
    assert "limits.max_queued_per_tenant = 1" in refused.value.message
    other = asyncio.create_task(gate.enter(gate.deadline(), 0, b))  # B's place is its own
    await settle()
    assert gate.queued == 2 and not other.done()
    gate.leave(0, a)  # A held the slot: B's turn comes first
    await other
    gate.leave(0, b)
    await first
    gate.leave(0, a)
    assert (gate.inflight, gate.queued, gate.tenants) == (0, 0, 0)


async def test_replica_waiters_take_their_tenants_queue_places() -> None:
    gate = admission(inflight=4, queued=4, queued_per_tenant=1)
    a, b = gate.tenant("a"), gate.tenant("b")
    assert gate.try_enter(0, a) and gate.try_enter(0, a) and gate.try_enter(0, b)
    free = asyncio.Event()
    replica_wait = asyncio.create_task(gate.wait_until(free.is_set, gate.deadline(), "every replica busy", a))
    await settle()
    with pytest.raises(AdmissionRefused) as refused:
        await gate.wait_until(free.is_set, gate.deadline(), "every replica busy", a)
    assert refused.value.limit == TENANT_QUEUE
    other = asyncio.create_task(gate.wait_until(free.is_set, gate.deadline(), "every replica busy", b))
    await settle()
    assert gate.queued == 2
    free.set()
    await asyncio.gather(replica_wait, other)
    for tenant in (a, a, b):
        gate.leave(0, tenant)
    assert (gate.inflight, gate.queued, gate.tenants) == (0, 0, 0)


async def test_the_tenant_table_is_bounded_and_new_tenants_past_it_share_the_overflow_tenant() -> None:
    gate = admission(inflight=8, tenants=2)
    assert gate.tenant(None) is gate.default_tenant and gate.tenant("") is gate.default_tenant
    long_name = "t" * (TENANT_CHARS + 72)
    a, b = gate.tenant(long_name), gate.tenant("b")
    assert gate.tenant("t" * TENANT_CHARS) is a  # cut to 128 characters, as the console does
    assert gate.try_enter(0, a) and gate.try_enter(0, b) and gate.tenants == 2
    c, d = gate.tenant("c"), gate.tenant("d")
    assert c is gate.overflow_tenant and d is gate.overflow_tenant and gate.tenants == 2
    assert gate.try_enter(0, c) and gate.overflow_tenant.inflight == 1
    gate.leave(0, c)
    gate.leave(0, a)  # an idle tenant leaves the table: room for a new one
    assert gate.tenants == 1 and gate.tenant("c") is not gate.overflow_tenant
    gate.leave(0, b)
    assert gate.tenants == 1  # "c" was looked up but never entered: it stays until it is used
    assert gate.try_enter(0, gate.tenant("c"))
    gate.leave(0, gate.tenant("c"))
    assert (gate.tenants, gate.inflight) == (0, 0)


async def test_the_overflow_tenant_shares_one_set_of_caps() -> None:
    gate = admission(inflight=4, per_tenant=1, tenants=1)
    assert gate.try_enter(0, gate.tenant("a"))
    assert gate.try_enter(0, gate.tenant("b"))  # the overflow tenant's one slot
    assert not gate.try_enter(0, gate.tenant("c"))  # shares it with "b"
    assert gate.try_enter(0, gate.tenant(None))  # the default tenant is a tenant of its own
    for tenant in (gate.tenant("a"), gate.overflow_tenant, gate.default_tenant):
        gate.leave(0, tenant)
    assert (gate.inflight, gate.tenants) == (0, 0)


async def test_the_waiter_whose_turn_it_is_is_never_passed_for_bytes_whatever_its_tenant() -> None:
    gate = admission(inflight=8, budget=1000)
    a, b = gate.tenant("a"), gate.tenant("b")
    assert gate.try_enter(900, a)
    order: list[str] = []

    async def request(name: str, size: int) -> None:
        await gate.enter(gate.deadline(), size, gate.tenant(name[0]))
        order.append(name)

    large = asyncio.create_task(request("a-large", 800))
    await settle()
    small = asyncio.create_task(request("b-small", 50))  # it would fit, but A's turn comes first
    await settle()
    assert order == [] and gate.queued == 2 and not gate.try_enter(10, b)
    gate.leave(900, a)
    await asyncio.gather(large, small)
    assert order == ["a-large", "b-small"] and gate.body_bytes == 850


async def test_a_capped_tenants_waiter_holds_nobody_back_for_bytes() -> None:
    gate = admission(inflight=8, per_tenant=1, budget=1000)
    a, b = gate.tenant("a"), gate.tenant("b")
    assert gate.try_enter(100, a)
    waiting = asyncio.create_task(gate.enter(gate.deadline(), 100, a))  # capped: not its turn
    await settle()
    assert gate.try_enter(700, b)  # fits, and no turn comes before it
    assert not gate.try_enter(300, gate.tenant("c"))  # does not fit: it waits, in turn
    c_waiting = asyncio.create_task(gate.enter(gate.deadline(), 300, gate.tenant("c")))
    await settle()
    gate.leave(100, a)  # A has a turn again, after C's: C first (300 fits now)...
    await c_waiting
    await settle()
    assert not waiting.done() and gate.body_bytes == 1000  # ...and A's 100 waits for bytes, in turn
    gate.leave(700, b)
    await waiting
    assert (gate.body_bytes, gate.inflight, gate.queued) == (400, 2, 0)


async def test_cancelled_and_timed_out_waiters_of_every_tenant_give_everything_back() -> None:
    gate = admission(inflight=2, queued=8, per_tenant=1, budget=1000)
    a, b = gate.tenant("a"), gate.tenant("b")
    assert gate.try_enter(500, a) and gate.try_enter(400, b)
    waiters = [asyncio.create_task(gate.enter(gate.deadline(), 300, gate.tenant(name))) for name in "aabbcc"]
    await settle()
    assert gate.queued == 6 and gate.tenants == 3
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert gate.queued == 0 and gate.tenants == 2  # "c" had nothing else: it left the table
    timed_out = asyncio.create_task(
        gate.enter(asyncio.get_running_loop().time() + 0.05, 10, gate.tenant("c"))
    )
    with pytest.raises(AdmissionRefused) as refused:
        await timed_out
    assert refused.value.limit in (MAX_BYTES, "max_inflight")
    gate.leave(500, a)
    gate.leave(400, b)
    assert (gate.inflight, gate.queued, gate.tenants, gate.body_bytes) == (0, 0, 0, 0)
    assert gate.try_enter(1000, gate.tenant("c"))


async def test_a_waiter_cancelled_as_it_is_admitted_gives_its_slot_to_the_next_turn() -> None:
    gate = admission(inflight=1)
    z, a, b = gate.tenant("z"), gate.tenant("a"), gate.tenant("b")
    assert gate.try_enter(0, z)
    first = asyncio.create_task(gate.enter(gate.deadline(), 0, a))
    second = asyncio.create_task(gate.enter(gate.deadline(), 0, b))
    await settle()
    gate.leave(0, z)  # admits A's waiter...
    assert a.inflight == 1 and not second.done()
    first.cancel()  # ...whose task is cancelled before it runs: the slot passes to B
    await asyncio.gather(first, return_exceptions=True)
    await second
    assert gate.inflight == 1 and b.inflight == 1 and a.inflight == 0
    gate.leave(0, b)
    assert (gate.inflight, gate.tenants) == (0, 0)


async def test_without_tenants_the_caps_at_the_global_values_change_nothing() -> None:
    """The defaults: no header (the default tenant), per-tenant caps at the global ones."""
    gate = admission(inflight=2, queued=2)
    assert gate.try_enter() and gate.try_enter() and not gate.try_enter()
    waiters = [asyncio.create_task(gate.enter(gate.deadline())) for _ in range(2)]
    await settle()
    with pytest.raises(AdmissionRefused) as refused:
        await gate.enter(gate.deadline())
    assert refused.value.limit == "max_inflight" and refused.value.status == 429
    gate.leave()
    gate.leave()
    await asyncio.gather(*waiters)
    gate.leave()
    gate.leave()
    assert (gate.inflight, gate.queued, gate.tenants) == (0, 0, 0)


async def test_every_change_of_the_count_is_published_and_other_workers_slots_count() -> None:
    """``kvlb serve --workers N``: each change of this worker's count reaches ``on_change`` (a slot
    passed on to a waiter publishes the count once it is taken again), and the other workers'
    admitted requests (``peers``) take slots from every tenant alike."""
    gate = admission(inflight=3, per_tenant=2)
    published: list[int] = []
    others = [1]
    gate.on_change = published.append
    gate.peers = lambda: others[0]
    a, b = gate.tenant("a"), gate.tenant("b")
    assert gate.try_enter(0, a) and gate.try_enter(0, b)
    assert not gate.try_enter(0, b)  # 2 here + 1 elsewhere: the service is full
    waiting = asyncio.create_task(gate.enter(gate.deadline(), 0, b))
    await settle()
    others[0] = 0  # a slot freed on another worker: seen at the waiter's next check
    await waiting
    assert published == [1, 2, 3] and b.inflight == 2
    gate.leave(0, a)
    gate.leave(0, b)
    gate.leave(0, b)
    assert published == [1, 2, 3, 2, 1, 0] and gate.tenants == 0


class Elsewhere:
    """The other workers' requests of each tenant key, as the shared table would report them (a
    plain stand-in for ``LoadShare.peer_tenant_admitted``), and what this worker published."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.published: list[tuple[int, int]] = []
        self.asked = 0

    def peers(self, key: int) -> int:
        self.asked += 1
        return self.counts.get(key, 0)

    def publish(self, key: int, inflight: int) -> None:
        self.published.append((key, inflight))


def shared(gate: Admission) -> Elsewhere:
    elsewhere = Elsewhere()
    gate.tenant_peers = elsewhere.peers
    gate.on_tenant_change = elsewhere.publish
    return elsewhere


async def test_the_other_workers_requests_of_a_tenant_count_against_its_cap() -> None:
    """Per-tenant cap 2, one request of A on another worker: this worker admits one of A, then A's
    next request waits while B's go on at once; when the other worker's request ends (its slot
    freed), A's waiter is admitted at its next recheck, within about ``RECHECK_S``."""
    gate = admission(inflight=8, per_tenant=2)
    elsewhere = shared(gate)
    ka = tenant_key("a")
    elsewhere.counts[ka] = 1
    a, b = gate.tenant("a"), gate.tenant("b")
    assert gate.try_enter(0, a)
    assert not gate.try_enter(0, a)  # 1 here + 1 elsewhere: A is at its cap
    waiting = asyncio.create_task(gate.enter(gate.deadline(), 0, a))
    await asyncio.sleep(3 * RECHECK_S)
    assert not waiting.done() and gate.queued == 1 and a.inflight == 1
    assert gate.try_enter(0, b) and gate.try_enter(0, b)  # A's waiter holds nobody back
    assert not gate.try_enter(0, a)  # nor does a newcomer of A pass A's waiter
    freed = Unstalled()  # a loaded machine's stall of this process is not the gate's wait
    elsewhere.counts[ka] = 0  # the other worker's request of A ended
    await waiting
    assert freed.seconds() < 3 * RECHECK_S and a.inflight == 2
    kb = tenant_key("b")
    assert elsewhere.published == [(ka, 1), (kb, 1), (kb, 2), (ka, 2)]
    for tenant in (a, a, b, b):
        gate.leave(0, tenant)
    assert elsewhere.published[-4:] == [(ka, 1), (ka, 0), (kb, 1), (kb, 0)]
    assert (gate.inflight, gate.queued, gate.tenants) == (0, 0, 0)


async def test_a_tenant_at_its_cap_elsewhere_times_out_with_its_limit_and_its_slot_here_frees_it() -> None:
    """A waiter of a tenant held at its cap by the other workers gets 503 with ``limit``
    ``tenant_inflight``; a slot of the tenant freed on this worker passes to its waiter at once."""
    gate = admission(inflight=8, per_tenant=2)
    elsewhere = shared(gate)
    elsewhere.counts[tenant_key("a")] = 2
    a = gate.tenant("a")
    with pytest.raises(AdmissionRefused) as refused:
        await gate.enter(asyncio.get_running_loop().time() + 2 * RECHECK_S, 0, a)
    assert (refused.value.status, refused.value.limit) == (503, TENANT_INFLIGHT)
    assert "limits.max_inflight_per_tenant = 2" in refused.value.message
    assert (gate.inflight, gate.queued, gate.tenants) == (0, 0, 0)
    elsewhere.counts[tenant_key("a")] = 1
    a = gate.tenant("a")
    assert gate.try_enter(0, a)
    waiting = asyncio.create_task(gate.enter(gate.deadline(), 0, a))
    await asyncio.sleep(2 * RECHECK_S)
    assert not waiting.done()
    gate.leave(0, a)  # its own slot here: handed on at once, no recheck needed
    await asyncio.wait_for(waiting, RECHECK_S / 5)
    gate.leave(0, a)
    assert (gate.inflight, gate.tenants) == (0, 0)


async def test_the_default_and_overflow_tenants_are_shared_under_their_own_keys() -> None:
    gate = admission(inflight=8, per_tenant=1, tenants=1)
    elsewhere = shared(gate)
    elsewhere.counts[DEFAULT_TENANT_KEY] = 1
    assert not gate.try_enter()  # the default tenant's one slot is taken on another worker
    assert gate.try_enter(0, gate.tenant("a"))
    assert gate.try_enter(0, gate.tenant("b"))  # past max_tenants: the overflow tenant
    assert elsewhere.published[-1] == (OVERFLOW_TENANT_KEY, 1)
    elsewhere.counts[OVERFLOW_TENANT_KEY] = 1
    gate.leave(0, gate.overflow_tenant)
    assert not gate.try_enter(0, gate.tenant("c"))  # the overflow tenant is one tenant across workers
    gate.leave(0, gate.tenant("a"))
    assert (gate.inflight, gate.tenants) == (0, 0)


async def test_without_tenant_peers_the_other_workers_are_not_asked_and_waiters_are_not_polled() -> None:
    """Unshared (one worker, or the per-tenant cap at the global one): the tenant check is this
    worker's count alone."""
    gate = admission(inflight=8, per_tenant=1)
    elsewhere = Elsewhere()
    gate.on_tenant_change = elsewhere.publish
    a = gate.tenant("a")
    assert gate.try_enter(0, a) and not gate.try_enter(0, a)
    gate.leave(0, a)
    assert elsewhere.asked == 0 and elsewhere.published == [(tenant_key("a"), 1), (tenant_key("a"), 0)]


async def test_many_tenants_set_aside_by_the_other_workers_are_looked_at_once_per_recheck() -> None:
    """Forty tenants, each at its cap with the other workers and one waiter here: the waiters'
    rechecks ask about the set-aside tenants once per half ``RECHECK_S``, not once per waiter."""
    gate = admission(inflight=64, queued=64, per_tenant=1)
    elsewhere = shared(gate)
    names = [f"t{i}" for i in range(40)]
    for name in names:
        elsewhere.counts[tenant_key(name)] = 1
    waiters = [asyncio.create_task(gate.enter(gate.deadline(), 0, gate.tenant(name))) for name in names]
    await asyncio.sleep(RECHECK_S / 2)
    elsewhere.asked = 0
    await asyncio.sleep(10 * RECHECK_S)
    assert gate.queued == 40 and not any(task.done() for task in waiters)
    assert elsewhere.asked <= 40 * 24, elsewhere.asked  # 20 half-rechecks of 40 tenants, and a margin
    elsewhere.counts.clear()
    await asyncio.gather(*waiters)
    assert gate.inflight == 40
    for name in names:
        gate.leave(0, gate.tenant(name))
    assert (gate.inflight, gate.queued, gate.tenants) == (0, 0, 0)
