"""The byte budget of admission (``limits.max_inflight_body_bytes``): what a request holds, when it
waits, in which order, and that every way out gives every byte back. Drives
:class:`balancer.service.admission.Admission` on the event loop (no I/O)."""

from __future__ import annotations

import asyncio

import pytest

from balancer.service.admission import MAX_BYTES, MAX_INFLIGHT, Admission, AdmissionLimits, AdmissionRefused

BUDGET = 1000


def admission(inflight: int = 8, queued: int = 4, timeout_s: float = 5.0, budget: int = BUDGET) -> Admission:
    return Admission(AdmissionLimits(inflight, queued, timeout_s, budget))


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_request_enters_while_its_bytes_fit_and_gives_them_back_on_leaving() -> None:
    gate = admission()
    assert gate.try_enter(600) and gate.body_bytes == 600
    assert gate.try_enter(400) and gate.body_bytes == 1000  # exactly full fits
    assert not gate.try_enter(1) and gate.inflight == 2  # a slot is free, the bytes are not
    assert gate.try_enter(0)  # a body of nothing needs no bytes
    gate.leave(0)
    gate.leave(600)
    gate.leave(400)
    assert (gate.inflight, gate.body_bytes) == (0, 0)


async def test_waiters_for_bytes_are_admitted_in_order_and_a_small_one_never_jumps_a_large_one() -> None:
    gate = admission()
    await gate.enter(gate.deadline(), 900)
    order: list[str] = []

    async def request(name: str, size: int) -> None:
        await gate.enter(gate.deadline(), size)
        order.append(name)

    large = asyncio.create_task(request("large", 800))
    await settle()
    small = asyncio.create_task(request("small", 50))  # it would fit now, but the large one came first
    await settle()
    assert order == [] and gate.queued == 2 and not gate.try_enter(10)
    gate.leave(900)
    await asyncio.gather(large, small)
    assert order == ["large", "small"] and gate.body_bytes == 850 and gate.inflight == 2


async def test_a_full_queue_is_429_and_a_wait_too_long_503_both_for_the_bytes() -> None:
    gate = admission(queued=1, timeout_s=0.05)
    await gate.enter(gate.deadline(), 700)
    with pytest.raises(AdmissionRefused) as timed_out:
        await gate.enter(gate.deadline(), 700)
    assert (timed_out.value.status, timed_out.value.reason, timed_out.value.limit) == (
        503,
        "queue_timeout",
        MAX_BYTES,
    )
    assert "max_inflight_body_bytes" in timed_out.value.message and timed_out.value.retry_after_s >= 1
    waiting = asyncio.create_task(gate.enter(gate.deadline(), 700))
    await settle()
    with pytest.raises(AdmissionRefused) as full:
        await gate.enter(gate.deadline(), 700)
    assert (full.value.status, full.value.reason, full.value.limit) == (429, "queue_full", MAX_BYTES)
    assert "700 bytes of request bodies" in full.value.message
    with pytest.raises(AdmissionRefused):
        await waiting
    gate.leave(700)
    assert (gate.inflight, gate.body_bytes, gate.queued) == (0, 0, 0)


async def test_a_refusal_for_want_of_a_slot_still_says_max_inflight() -> None:
    gate = admission(inflight=1, queued=0)
    assert gate.try_enter(10)
    with pytest.raises(AdmissionRefused) as full:
        await gate.enter(gate.deadline(), 10)
    assert (full.value.status, full.value.limit) == (429, MAX_INFLIGHT)


async def test_a_large_waiter_giving_up_lets_the_ones_behind_it_in() -> None:
    gate = admission()
    await gate.enter(gate.deadline(), 900)
    loop = asyncio.get_running_loop()
    large = asyncio.create_task(gate.enter(loop.time() + 0.05, 800))
    await settle()
    small = asyncio.create_task(gate.enter(loop.time() + 30, 50))
    with pytest.raises(AdmissionRefused):
        await large
    await asyncio.wait_for(small, 5)  # admitted when the head left the queue, not at its own deadline
    assert (gate.inflight, gate.body_bytes, gate.queued) == (2, 950, 0)


async def test_a_cancelled_waiter_holds_nothing_and_one_cancelled_as_it_was_admitted_gives_back() -> None:
    gate = admission()
    await gate.enter(gate.deadline(), 900)
    waiter = asyncio.create_task(gate.enter(gate.deadline(), 500))
    await settle()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (gate.inflight, gate.body_bytes, gate.queued) == (1, 900, 0)
    # admitted by the leave below and cancelled before it ran: it gives its slot and bytes back
    waiter = asyncio.create_task(gate.enter(gate.deadline(), 500))
    await settle()
    gate.leave(900)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (gate.inflight, gate.body_bytes, gate.queued) == (0, 0, 0)


async def test_a_body_read_chunk_by_chunk_holds_as_it_goes_and_goes_before_the_newcomers() -> None:
    gate = admission()
    assert gate.try_enter(0)  # no declared length
    await gate.hold(400, gate.deadline())
    assert gate.try_enter(500)  # another request
    newcomer = asyncio.create_task(gate.enter(gate.deadline(), 500))
    await settle()
    chunk = asyncio.create_task(gate.hold(200, gate.deadline()))  # 1,100 > 1,000: it waits
    await settle()
    assert not chunk.done() and not newcomer.done() and gate.queued == 2
    gate.leave(500)  # room for either, not both: the request already in flight goes first
    await chunk
    await settle()
    assert not newcomer.done() and gate.body_bytes == 600
    gate.leave(600)
    await newcomer
    gate.leave(500)
    assert (gate.inflight, gate.body_bytes, gate.queued) == (0, 0, 0)


async def test_token_ids_are_added_without_waiting_and_newcomers_wait_until_they_fit_again() -> None:
    gate = admission()
    assert gate.try_enter(900)
    gate.add(300)  # over the budget: counted, never refused
    assert gate.body_bytes == 1200 and not gate.try_enter(0)
    newcomer = asyncio.create_task(gate.enter(gate.deadline(), 100))
    await settle()
    assert not newcomer.done()
    gate.leave(1200)
    await newcomer
    gate.leave(100)
    assert (gate.inflight, gate.body_bytes) == (0, 0)


async def test_without_a_queue_a_body_that_does_not_fit_is_refused_at_once() -> None:
    gate = admission(queued=0)
    assert gate.try_enter(600)
    with pytest.raises(AdmissionRefused) as full:
        await gate.enter(gate.deadline(), 600)
    assert (full.value.status, full.value.limit) == (429, MAX_BYTES)
    with pytest.raises(AdmissionRefused):
        await gate.hold(600, gate.deadline())
    gate.leave(600)
    assert gate.body_bytes == 0


async def test_giving_back_part_of_a_reservation_admits_the_waiters_it_makes_room_for_in_order() -> None:
    """A gRPC call reserves the most its message may be, then gives back the difference once the
    message is in: the freed bytes go to the front queue (bytes for calls without a slot) first, then
    to the slot waiters in order, as :meth:`Admission.leave` hands them on."""
    gate = admission()
    await gate.enter(gate.deadline(), 800)  # a reservation; its message turns out to be 100 bytes
    order: list[str] = []

    async def enter(name: str, size: int) -> None:
        await gate.enter(gate.deadline(), size)
        order.append(name)

    async def hold(name: str, size: int) -> None:  # a call without a slot (Route, admin)
        await gate.hold(size, gate.deadline())
        order.append(name)

    first = asyncio.create_task(enter("first", 500))
    await settle()
    second = asyncio.create_task(enter("second", 200))
    route = asyncio.create_task(hold("route", 300))
    await settle()
    assert order == [] and gate.queued == 3
    gate.give_back(700)  # holds 100: the route's 300 first, then the first's 500; the second's 200 wait
    await settle()
    assert order == ["route", "first"] and gate.body_bytes == 900 and gate.queued == 1
    gate.give_back(300)  # the route ends: its bytes, without a slot
    await asyncio.gather(first, second, route)
    assert order == ["route", "first", "second"] and gate.body_bytes == 800 and gate.inflight == 3
    for size in (100, 500, 200):
        gate.leave(size)
    assert (gate.inflight, gate.body_bytes, gate.queued) == (0, 0, 0)


async def test_a_hold_that_fits_passes_a_larger_one_waiting_so_neither_deadlocks() -> None:
    """A request reading its body in chunks holds 600; a reservation of 500 waits for room; the
    reader's next 100 fits and goes at once, so it can finish and give the room back (made to wait
    behind the 500, both would wait until their deadline)."""
    gate = admission(timeout_s=0.5)
    await gate.enter(gate.deadline(), 0)
    await gate.hold(600, gate.deadline())
    waiting = asyncio.create_task(gate.hold(500, gate.deadline()))  # 1,100 > 1,000: it waits
    await settle()
    await asyncio.wait_for(gate.hold(100, gate.deadline()), timeout=0.1)  # 700 fits: no wait
    assert not waiting.done()
    gate.leave(700)  # the reader is done
    await asyncio.wait_for(waiting, timeout=0.1)
    assert gate.body_bytes == 500
