"""``ClientWrites``: the relay's deadline and the write-stall bound, on a real event loop (a write
is a future the test completes or not; what the client took is what the test says)."""

from __future__ import annotations

import asyncio

import pytest
from unstalled import Unstalled

from balancer.api.client_writes import ClientWrites

STALL_S = 0.2


class Taken(ClientWrites):
    """A bound whose ``taken`` is set by the test (bytes the client acknowledged so far)."""

    def __init__(self, deadline: float, stall_s: float) -> None:
        super().__init__(deadline, stall_s)
        self.bytes = 0

    def taken(self) -> int | None:
        return self.bytes


def far() -> float:
    return asyncio.get_running_loop().time() + 60.0


async def test_a_write_that_never_ends_is_stalled_within_the_bound() -> None:
    loop = asyncio.get_running_loop()
    writes = ClientWrites(far(), STALL_S)
    began, unstalled = loop.time(), Unstalled()
    with pytest.raises(TimeoutError):
        async with writes:
            writes.begin()
            await loop.create_future()  # a write the client never takes
    took = loop.time() - began
    assert writes.stalled and writes.writing
    # never before the bound; after it by at most a check's period, a loaded machine's stall of
    # this process not counted
    assert took >= STALL_S and unstalled.seconds() < STALL_S * 1.25 + 0.5


async def test_writes_that_end_are_never_stalled() -> None:
    writes = ClientWrites(far(), STALL_S)
    async with writes:
        for _ in range(20):  # four bounds of writes, each taking a fifth of it
            writes.begin()
            await asyncio.sleep(STALL_S / 5)
            writes.end()
    assert not writes.stalled and not writes.writing


async def test_bytes_taken_while_a_write_waits_keep_it_alive() -> None:
    """A write that waits for four bounds is not stalled while the client takes bytes (it reads
    slowly), and is stalled a bound after it stops."""
    loop = asyncio.get_running_loop()
    writes = Taken(far(), STALL_S)
    stopped_at = 0.0
    stopped = Unstalled()

    async def reader() -> None:
        nonlocal stopped_at, stopped
        for _ in range(40):  # four bounds, taking bytes every tenth of it
            await asyncio.sleep(STALL_S / 10)
            writes.bytes += 1000
        stopped_at, stopped = loop.time(), Unstalled()

    task = asyncio.create_task(reader())
    with pytest.raises(TimeoutError):
        async with writes:
            writes.begin()
            await loop.create_future()
    await task
    assert writes.stalled
    assert loop.time() - stopped_at >= STALL_S and stopped.seconds() < STALL_S * 1.25 + 0.5


async def test_the_deadline_while_a_write_waits_is_the_clients_fault() -> None:
    loop = asyncio.get_running_loop()
    writes = ClientWrites(loop.time() + STALL_S / 2, 60.0)
    with pytest.raises(TimeoutError):
        async with writes:
            writes.begin()
            await loop.create_future()
    assert writes.writing and not writes.stalled


async def test_the_deadline_between_writes_is_not() -> None:
    loop = asyncio.get_running_loop()
    writes = ClientWrites(loop.time() + STALL_S / 2, 60.0)
    with pytest.raises(TimeoutError):
        async with writes:
            writes.begin()
            writes.end()
            await loop.create_future()  # waiting for the replica
    assert not writes.writing and not writes.stalled


async def test_no_timer_is_left_behind() -> None:
    loop = asyncio.get_running_loop()
    writes = ClientWrites(far(), STALL_S)
    async with writes:
        writes.begin()
        writes.end()
    handles = [h for h in getattr(loop, "_scheduled", []) if not h.cancelled()]
    assert not [h for h in handles if getattr(h, "_callback", None) == writes._check]
