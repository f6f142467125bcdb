"""The bounded admission queue: FIFO hand-over, refusals with Retry-After, replica-slot waits.

The first tests drive :class:`balancer.service.admission.Admission` directly on the event loop; the last ones
go through a real balancer and emulated replicas over sockets.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from kvlb_harness import MODEL, Harness, running, shared_deepseek
from unstalled import Unstalled

from balancer.service.admission import Admission, AdmissionLimits, AdmissionRefused
from balancer.tokenizer.tokenizer import Tokenizer


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def admission(inflight: int = 1, queued: int = 2, timeout_s: float = 0.5) -> Admission:
    return Admission(AdmissionLimits(inflight, queued, timeout_s))


async def test_waiters_are_admitted_first_come_first_served_and_never_over_the_cap() -> None:
    gate = admission(inflight=1, queued=3, timeout_s=2.0)
    order: list[int] = []
    await gate.enter(gate.deadline())

    async def request(index: int) -> None:
        await gate.enter(gate.deadline())
        assert gate.inflight == 1
        order.append(index)
        await asyncio.sleep(0.01)
        gate.leave()

    tasks = [asyncio.create_task(request(i)) for i in range(3)]
    await asyncio.sleep(0.02)
    assert gate.queued == 3
    with pytest.raises(AdmissionRefused) as refused:
        await gate.enter(gate.deadline())
    assert (refused.value.status, refused.value.reason) == (429, "queue_full")
    gate.leave()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2] and gate.inflight == 0 and gate.queued == 0


async def test_the_immediate_path_never_jumps_the_queue() -> None:
    """``try_enter`` (the request path's no-wait admission) takes a free slot only while nobody
    waits: a slot handed over by ``leave`` goes to the oldest waiter, not to a newcomer."""
    gate = admission(inflight=1, queued=2, timeout_s=2.0)
    assert gate.try_enter() and gate.inflight == 1
    assert not gate.try_enter() and gate.inflight == 1  # full
    waiter = asyncio.create_task(gate.enter(gate.deadline()))
    await asyncio.sleep(0.01)
    gate.leave()  # handed to the waiter: the count stays
    assert not gate.try_enter() and gate.inflight == 1
    await waiter
    gate.leave()
    assert gate.inflight == 0 and gate.try_enter() and gate.inflight == 1


async def test_a_wait_past_the_timeout_is_refused_with_503_and_leaves_the_queue() -> None:
    gate = admission(inflight=1, queued=2, timeout_s=0.1)
    await gate.enter(gate.deadline())
    started, unstalled = asyncio.get_running_loop().time(), Unstalled()
    with pytest.raises(AdmissionRefused) as refused:
        await gate.enter(gate.deadline())
    waited_s = asyncio.get_running_loop().time() - started
    assert refused.value.status == 503 and refused.value.retry_after_s >= 1
    # refused at its timeout: not before, and not much after (a loaded machine's stall of this
    # process not counted)
    assert waited_s >= 0.09 and unstalled.seconds() < 0.5 and gate.queued == 0
    gate.leave()
    assert gate.inflight == 0


async def test_a_cancelled_waiter_never_takes_a_slot() -> None:
    gate = admission(inflight=1, queued=2, timeout_s=5.0)
    await gate.enter(gate.deadline())
    waiter = asyncio.create_task(gate.enter(gate.deadline()))
    await asyncio.sleep(0.01)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    gate.leave()
    assert gate.inflight == 0 and gate.queued == 0


async def test_waiting_for_a_condition_counts_in_the_queue_and_wakes_on_leave() -> None:
    gate = admission(inflight=4, queued=1, timeout_s=2.0)
    free = False
    await gate.enter(gate.deadline())
    waiting = asyncio.create_task(gate.wait_until(lambda: free, gate.deadline(), "every replica is full"))
    await asyncio.sleep(0.01)
    with pytest.raises(AdmissionRefused) as refused:  # the queue (1) is taken by the waiter
        await gate.wait_until(lambda: False, gate.deadline(), "every replica is full")
    assert "every replica is full" in refused.value.message
    free = True
    gate.leave()
    await asyncio.wait_for(waiting, 0.5)
    assert gate.queued == 0


# ----------------------------------------------------------------------------- over sockets


def stream_body(first: int, max_tokens: int = 60) -> dict[str, object]:
    return {"model": MODEL, "prompt": [first, 2, 3, 4, 5], "max_tokens": max_tokens, "stream": True}


async def hold_streams(h: Harness, count: int, max_tokens: int = 60) -> list[aiohttp.ClientResponse]:
    held = []
    for index in range(count):
        response = await h.session.post(h.url + "/v1/completions", json=stream_body(10 + index, max_tokens))
        assert response.status == 200
        assert (await response.content.readline()).startswith(b"data: ")
        held.append(response)
    return held


async def test_over_capacity_requests_queue_then_run_or_get_clear_refusals(tokenizer: Tokenizer) -> None:
    limits = {"limits__max_inflight": 1, "limits__max_queued": 1, "limits__queue_timeout_s": 5.0}
    async with running(tokenizer, 2, time_scale=0.25, **limits) as h:
        held = await hold_streams(h, 1, max_tokens=40)
        small = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
        queued = asyncio.create_task(h.post("/v1/completions", small))
        await asyncio.sleep(0.1)
        refused = await h.post("/v1/completions", small)
        assert refused.status == 429 and refused.headers["Retry-After"] == "1"
        assert "1 requests queued" in refused.json()["error"]["message"]
        assert not queued.done()
        await held[0].read()  # the stream ends: its slot passes to the queued request
        assert (await queued).status == 200


async def test_a_request_queued_too_long_gets_503_with_retry_after(tokenizer: Tokenizer) -> None:
    limits = {"limits__max_inflight": 1, "limits__max_queued": 4, "limits__queue_timeout_s": 0.3}
    async with running(tokenizer, 1, time_scale=0.1, **limits) as h:
        held = await hold_streams(h, 1, max_tokens=200)
        try:
            answer = await h.post("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1})
            assert answer.status == 503 and int(answer.headers["Retry-After"]) >= 1
            assert "limits.queue_timeout_s = 0.3" in answer.json()["error"]["message"]
        finally:
            for response in held:
                response.close()


async def test_with_every_replica_full_a_request_waits_for_a_replica_slot(tokenizer: Tokenizer) -> None:
    limits = {"limits__max_inflight_per_replica": 1, "limits__queue_timeout_s": 10.0}
    async with running(tokenizer, 2, time_scale=0.25, **limits) as h:
        held = await hold_streams(h, 2, max_tokens=30)
        waiting = asyncio.create_task(
            h.post("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1})
        )
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await held[1].read()
        answer = await waiting
        assert answer.status == 200 and answer.headers["x-kvlb-replica"] in ("r0", "r1")
        held[0].close()
