"""The pace a request body must keep (``timeouts.body_min_rate_bytes_per_s`` after
``timeouts.body_rate_grace_s``) over real sockets: a client that declares a large body and sends
next to nothing holds its bytes of ``limits.max_inflight_body_bytes`` only until it falls behind,
not for all of ``timeouts.body_read_s``; a body sent at the pace passes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest
from kvlb_harness import MODEL, Harness, metric, running, shared_deepseek, wait_for

from balancer.api.openai import body_due
from balancer.config import TimeoutConfig
from balancer.tokenizer.tokenizer import Tokenizer
from loadtests.faults.stalled_bodies import stalled_sender

BODY_BYTES = 100_000
LIMITS = {
    "limits__max_body_bytes": 128 * 1024,
    "limits__max_inflight_body_bytes": 250_000,  # two declared bodies and their ids, not three
    "limits__queue_timeout_s": 1.0,
    "timeouts__body_read_s": 6.0,
}


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def body(first: int, size: int = BODY_BYTES) -> bytes:
    head = json.dumps({"model": MODEL, "prompt": [first, 2, 3, 4], "max_tokens": 2}).encode()
    pad = size - len(head) - len(b', "pad": ""')
    return head[:-1] + b', "pad": "' + b"x" * pad + b'"}'


async def status_of(reader: asyncio.StreamReader) -> int:
    line = await reader.readline()
    return int(line.split()[1])


async def stall_two_then_send(h: Harness, status_wait_s: float) -> tuple[list[int], int, float]:
    """Two stalled senders take the whole budget; then a whole body is sent. Returns the stalled
    ones' statuses (408 when cut; 0 when still held as the whole body was answered: none came within
    ``status_wait_s`` of the answer), the whole body's status and the seconds it took."""
    stalled = [await stalled_sender(h.url, BODY_BYTES) for _ in range(2)]
    try:

        async def held() -> bool:
            return await metric(h, "kvlb_admission_body_bytes") >= 2 * BODY_BYTES

        await wait_for("both declared bodies held", held)
        started = time.monotonic()
        answer = await h.post("/v1/completions", body(30))
        took_s = time.monotonic() - started
        statuses = []
        for reader, _ in stalled:
            try:
                async with asyncio.timeout(status_wait_s):
                    statuses.append(await status_of(reader))
            except TimeoutError:
                statuses.append(0)
        return statuses, answer.status, took_s
    finally:
        for _, writer in stalled:
            writer.close()


async def test_stalled_bodies_are_cut_at_the_pace_and_free_the_budget(tokenizer: Tokenizer) -> None:
    paced = {"timeouts__body_min_rate_bytes_per_s": 50_000, "timeouts__body_rate_grace_s": 0.3}
    async with running(tokenizer, 1, **LIMITS, **paced) as h:
        statuses, status, took_s = await stall_two_then_send(h, status_wait_s=5.0)  # sent already
        assert statuses == [408, 408]
        # waited for the pace's cut (0.3 s of grace), not the 6 s read limit
        assert status == 200 and took_s < 3.0
        limit = "body_min_rate_bytes_per_s"
        assert await metric(h, "kvlb_http_body_timeouts_total", limit=limit) == 2

        async def released() -> bool:
            return await metric(h, "kvlb_admission_body_bytes") == 0

        await wait_for("every byte given back", released)


async def test_without_a_pace_stalled_bodies_hold_the_budget(tokenizer: Tokenizer) -> None:
    """The same senders with the pace off keep the budget for ``body_read_s``: the whole body waits
    ``queue_timeout_s`` and gets 503 (what the pace fixes)."""
    async with running(tokenizer, 1, **LIMITS, timeouts__body_min_rate_bytes_per_s=0) as h:
        statuses, status, _ = await stall_two_then_send(h, status_wait_s=0.05)
        assert status == 503 and statuses == [0, 0]
        assert await metric(h, "kvlb_http_body_timeouts_total", limit="body_min_rate_bytes_per_s") == 0


async def test_a_body_sent_at_the_pace_passes(tokenizer: Tokenizer) -> None:
    pace = {"timeouts__body_min_rate_bytes_per_s": 20_000, "timeouts__body_rate_grace_s": 0.2}
    async with running(tokenizer, 1, **LIMITS, **pace) as h:
        data = body(40, 40_000)

        async def trickle() -> AsyncIterator[bytes]:  # 50 kB/s in 8 chunks: above the pace
            for start in range(0, len(data), 5_000):
                yield data[start : start + 5_000]
                await asyncio.sleep(0.1)

        async with h.session.post(h.url + "/v1/completions", data=trickle()) as response:
            assert response.status == 200, await response.text()
        assert await metric(h, "kvlb_http_body_timeouts_total", limit="body_min_rate_bytes_per_s") == 0


def test_body_due_gives_each_byte_its_time_within_the_read_limit() -> None:
    timeouts = TimeoutConfig(body_read_s=10.0, body_min_rate_bytes_per_s=1000, body_rate_grace_s=1.0)
    assert body_due(100.0, 0, 0.0, timeouts) == 101.0
    assert body_due(100.0, 500, 0.0, timeouts) == 101.5
    assert body_due(100.0, 500, 2.0, timeouts) == 103.5  # the wait for budget bytes is not the client's
    assert body_due(100.0, 50_000, 0.0, timeouts) == 110.0  # never past body_read_s
    off = TimeoutConfig(body_read_s=10.0, body_min_rate_bytes_per_s=0)
    assert body_due(100.0, 0, 0.0, off) == 110.0


async def test_a_wait_for_budget_bytes_is_not_counted_against_the_bodys_pace(tokenizer: Tokenizer) -> None:
    """A body without a declared length that waits for budget bytes mid-read (its chunks held as they
    come) longer than its pace allowed is not cut for it: the wait is kvlb's, not the client's
    (``held_s`` in :func:`body_due`). Two declared bodies trickled above the pace hold the budget
    until their clients go away, 1.5 s into the chunked body's read; its client sends 15 kB, then the
    rest once they are gone. Without the wait counted as kvlb's, those 15 kB were due by 1.05 s (20
    kB/s after 0.3 s) and the body would get 408 as its wait ends."""
    pace = {"timeouts__body_min_rate_bytes_per_s": 20_000, "timeouts__body_rate_grace_s": 0.3}
    limits = {**LIMITS, "limits__queue_timeout_s": 4.0}
    async with running(tokenizer, 1, **limits, **pace) as h:
        declared = 120_000  # two of them: 240,000 of the 250,000 bytes
        senders = [await stalled_sender(h.url, declared) for _ in range(2)]

        async def trickle(writer: asyncio.StreamWriter, first: int) -> None:
            data = body(first, declared)[10:]  # stalled_sender sent the first 10 bytes
            for start in range(0, len(data), 4_000):  # 40 kB/s: above the pace, never cut
                writer.write(data[start : start + 4_000])
                await writer.drain()
                await asyncio.sleep(0.1)

        trickles = [asyncio.create_task(trickle(w, 60 + i)) for i, (_, w) in enumerate(senders)]
        try:

            async def held() -> bool:
                return await metric(h, "kvlb_admission_body_bytes") >= 2 * declared

            await wait_for("both declared bodies held", held)
            data = body(70, 60_000)
            gone = asyncio.Event()

            async def chunked() -> AsyncIterator[bytes]:
                for start in range(0, len(data), 5_000):
                    if start == 15_000:  # the third chunk waits for budget bytes: send on after
                        await gone.wait()
                        await asyncio.sleep(0.2)
                    yield data[start : start + 5_000]
                    await asyncio.sleep(0.05)

            async def go_away() -> None:  # the declared bodies' clients leave: their bytes free
                await asyncio.sleep(1.5)
                for task in trickles:
                    task.cancel()
                for _, writer in senders:
                    writer.close()
                gone.set()

            leaving = asyncio.create_task(go_away())
            async with h.session.post(h.url + "/v1/completions", data=chunked()) as response:
                assert response.status == 200, await response.text()
            await leaving
        finally:
            for task in trickles:
                task.cancel()
            for _, writer in senders:
                writer.close()
        assert await metric(h, "kvlb_http_body_timeouts_total", limit="body_min_rate_bytes_per_s") == 0


async def test_a_body_kvlb_was_too_busy_to_read_is_not_cut(tokenizer: Tokenizer) -> None:
    """A client that sent its whole body while kvlb's event loop was busy (here: blocked on purpose
    past the body's pace deadline) is not behind: the bytes waiting unread count for it
    (``content.total_bytes``), and the body gets 200, not 408. The pace's timer and the socket's
    bytes come due in the same loop turn; before, the timer won and the client got the blame."""
    pace = {"timeouts__body_min_rate_bytes_per_s": 50_000, "timeouts__body_rate_grace_s": 0.3}
    async with running(tokenizer, 1, **LIMITS, **pace) as h:
        data = body(50)
        reader, writer = await stalled_sender(h.url, len(data))  # the first 10 bytes, then a pause
        try:

            async def reading() -> bool:
                return await metric(h, "kvlb_admission_body_bytes") >= len(data)

            await wait_for("the body's read begun", reading)
            writer.write(data[10:])  # the rest reaches the socket at once (loopback)...
            time.sleep(0.8)  # noqa: ASYNC251 ...while the loop is busy past the 0.3 s pace deadline
            await writer.drain()
            async with asyncio.timeout(5):
                assert await status_of(reader) == 200
        finally:
            writer.close()
        assert await metric(h, "kvlb_http_body_timeouts_total", limit="body_min_rate_bytes_per_s") == 0
