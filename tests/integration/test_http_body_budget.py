"""The byte budget of the bodies held at once (``limits.max_inflight_body_bytes``) over real sockets:
a balancer and an emulated replica on 127.0.0.1, large bodies sent at once (declared and chunked,
HTTP and gRPC); refusals are 429/503 with Retry-After, and every byte comes back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_harness import failure, grpc_running, token_request
from kvlb_harness import MODEL, Harness, metric_value, running, shared_deepseek, wait_for

from balancer.tokenizer.tokenizer import Tokenizer

BODY_BYTES = 100_000
"""Size of each large body (an unknown field pads it: parsed, dropped, forwarded as is)."""
LIMITS = {
    "limits__max_body_bytes": 128 * 1024,
    "limits__max_inflight_body_bytes": 250_000,  # two large bodies and their ids, not three
}


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def large_body(first: int, *, stream: bool = False, max_tokens: int = 2) -> bytes:
    body: dict[str, Any] = {"model": MODEL, "prompt": [first, 2, 3, 4], "max_tokens": max_tokens}
    if stream:
        body["stream"] = True
    head = json.dumps(body).encode()
    pad = BODY_BYTES - len(head) - len(b', "pad": ""')
    return head[:-1] + b', "pad": "' + b"x" * pad + b'"}'


async def held_bytes(h: Harness) -> float:
    async with h.session.get(h.url + "/metrics") as response:
        return metric_value(await response.text(), "kvlb_admission_body_bytes")


async def shed(h: Harness, reason: str) -> float:
    async with h.session.get(h.url + "/metrics") as response:
        return metric_value(await response.text(), "kvlb_admission_shed_total", reason=reason)


async def open_large_streams(h: Harness, count: int) -> list[aiohttp.ClientResponse]:
    """``count`` streams of large bodies, each in flight (its first chunk read; 100 tokens each at the
    slow time scale: several seconds, and both fit the replica's 256-token cache)."""
    responses = []
    for index in range(count):
        data = large_body(10 + index, stream=True, max_tokens=100)
        response = await h.session.post(h.url + "/v1/completions", data=data)
        responses.append(response)
        assert response.status == 200
        assert (await response.content.readline()).startswith(b"data: ")
    return responses


async def test_a_body_over_the_budget_gets_429_or_503_with_retry_after(tokenizer: Tokenizer) -> None:
    async with running(
        tokenizer, 1, time_scale=0.05, limits__max_queued=1, limits__queue_timeout_s=1.0, **LIMITS
    ) as h:
        streams = await open_large_streams(h, 2)
        try:
            assert 2 * BODY_BYTES <= await held_bytes(h) <= 250_000
            waited = await h.post("/v1/completions", large_body(20))  # queued, then timed out
            assert waited.status == 503 and int(waited.headers["Retry-After"]) >= 1
            assert "max_inflight_body_bytes" in waited.json()["error"]["message"]
            # two at once: one takes the queue's one place (then times out), the other finds it full
            answers = await asyncio.gather(*(h.post("/v1/completions", large_body(21 + i)) for i in range(2)))
            assert sorted(a.status for a in answers) == [429, 503]
            for answer in answers:
                assert int(answer.headers["Retry-After"]) >= 1
                assert "max_inflight_body_bytes" in answer.json()["error"]["message"]
            small = await h.post("/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 1})
            assert small.status == 200  # what fits goes through
        finally:
            for stream in streams:
                stream.close()
        await wait_for("every byte given back", lambda: is_zero(h), timeout_s=5.0)
        assert await shed(h, "body_bytes") == 3
        assert (await h.post("/v1/completions", large_body(23))).status == 200
        bad = large_body(24)[:-2]  # cut short: not JSON (400 after the read)
        assert (await h.post("/v1/completions", bad)).status == 400
        unknown = large_body(25).replace(MODEL.encode(), b"no-such-model", 1)
        assert (await h.post("/v1/completions", unknown)).status == 404
        assert await held_bytes(h) == 0


async def is_zero(h: Harness) -> bool:
    return await held_bytes(h) == 0


async def chunked(body: bytes, size: int = 16 * 1024) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]
        await asyncio.sleep(0)


async def test_a_burst_of_large_bodies_waits_for_room_and_every_byte_comes_back(tokenizer: Tokenizer) -> None:
    """Twelve large bodies at once, half declared and half chunked, with room for two: the others
    wait their turn (they all succeed with a long enough queue), nothing but 200 comes back, the
    bytes held never pass the budget by more than the ids, and all of them are given back."""
    async with running(
        tokenizer, 1, time_scale=0.25, limits__max_queued=32, limits__queue_timeout_s=60.0, **LIMITS
    ) as h:
        peak = 0.0
        done = asyncio.Event()

        async def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, await held_bytes(h))
                await asyncio.sleep(0.01)

        async def send(index: int) -> tuple[int, bytes]:
            body = large_body(100 + index, max_tokens=8)
            data: Any = body if index % 2 else chunked(body)
            async with h.session.post(h.url + "/v1/completions", data=data) as response:
                return response.status, await response.read()

        sampler = asyncio.create_task(sample())
        answers = await asyncio.gather(*(send(i) for i in range(12)))
        done.set()
        await sampler
        assert [status for status, _ in answers] == [200] * 12, answers
        assert 0 < peak <= 250_000 + 2 * 4 * 16  # two bodies and the few ids of two prompts
        await wait_for("every byte given back", lambda: is_zero(h), timeout_s=5.0)
        assert await shed(h, "body_bytes") == 0


async def test_a_grpc_generate_holds_its_message_and_what_it_forwards_then_gives_them_back(
    tokenizer: Tokenizer,
) -> None:
    """A ``Generate`` of 100 kB (a long ``session_key``) holds the message and the JSON it forwards:
    a second one does not fit the budget (no queue: RESOURCE_EXHAUSTED, ``retry-after``); cancelled,
    the first gives every byte back."""
    async with grpc_running(tokenizer, 1, time_scale=0.05, limits__max_queued=0, **LIMITS) as g:
        session_key = "s" * BODY_BYTES
        first = g.balancer.Generate(token_request([7, 8, 9, 10], max_tokens=100, session_key=session_key))
        assert (await first.read()).index == 0
        assert 2 * BODY_BYTES <= await held_bytes(g.http) <= 250_000
        second = g.balancer.Generate(token_request([11, 12, 13], max_tokens=1, session_key=session_key))
        error = await failure(second.read())
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_inflight_body_bytes" in (error.details() or "")
        assert ("retry-after", "1") in tuple(error.trailing_metadata() or ())
        first.cancel()
        await wait_for("every byte given back", lambda: is_zero(g.http), timeout_s=5.0)
        assert await shed(g.http, "body_bytes") == 1


async def test_a_retried_request_and_one_every_replica_refuses_give_every_byte_back(
    tokenizer: Tokenizer,
) -> None:
    """A replica refusing connections: requests routed to it are retried on the other one (200);
    with both refusing, the request fails (502, or 503 once both are marked down). Either way the
    bytes held return to 0."""
    async with running(tokenizer, 2, health_interval_s=60.0, **LIMITS) as h:  # no probe marks r0 down
        async with h.session.post(h.replicas[0].url + "/admin/faults", json={"refuse_s": 3.0}) as response:
            assert response.status == 200
        for index in range(4):
            answer = await h.post("/v1/completions", large_body(40 + index))
            assert answer.status == 200 and answer.headers["x-kvlb-replica"] == "r1"
        assert await held_bytes(h) == 0
        async with h.session.get(h.url + "/metrics") as response:  # some went to r0 first
            assert metric_value(await response.text(), "kvlb_upstream_retries_total") >= 1
        async with h.session.post(h.replicas[1].url + "/admin/faults", json={"refuse_s": 3.0}) as response:
            assert response.status == 200
        failed = await h.post("/v1/completions", large_body(50))
        assert failed.status in (502, 503), failed.body
        assert await held_bytes(h) == 0
