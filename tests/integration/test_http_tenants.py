"""Tenant isolation at admission over real sockets: a balancer in front of a slow replica on
127.0.0.1; tenant A floods it, tenant B's few requests are all admitted and served while A is held
to its own caps (``limits.max_inflight_per_tenant``, ``limits.max_queued_per_tenant``) and gets 429
or 503 with Retry-After, never another error. The same flood with the per-tenant caps left at the
global ones (the default) shows what the caps prevent: B refused too. The gRPC face reads the
tenant from the call's metadata, and one tenant's caps count its calls and HTTP requests alike."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from grpc_harness import failure, grpc_running, token_request
from kvlb_harness import MODEL, balancer_over, completion_replica, metric_value, shared_deepseek

from balancer.tokenizer.tokenizer import Tokenizer

SLOW_S = 0.2
"""How long the replica takes to answer one request (seconds)."""
FLOODERS = 24
"""Tenant A's clients, each sending one request after another."""
HEADER = "x-kvlb-tenant"
LIMITS = {"max_inflight": 4, "max_queued": 8, "queue_timeout_s": 10.0, "max_inflight_per_replica": 64}
TENANT_CAPS = {"max_inflight_per_tenant": 2, "max_queued_per_tenant": 4}


@asynccontextmanager
async def slow_replica() -> AsyncIterator[str]:
    """A replica on 127.0.0.1 (its URL yielded) that answers each completion after ``SLOW_S``."""

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(SLOW_S)
        answer = {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
        }
        return web.json_response(answer)

    async with completion_replica(complete) as url:
        yield url


async def send(session: aiohttp.ClientSession, url: str, tenant: str, first: int) -> tuple[int, str | None]:
    body = json.dumps({"model": MODEL, "prompt": [first, 2, 3, 4], "max_tokens": 1})
    headers = {HEADER: tenant, "content-type": "application/json"}
    async with session.post(url + "/v1/completions", data=body, headers=headers) as response:
        await response.read()
        return response.status, response.headers.get("Retry-After")


async def flood_and_probe(limits: dict[str, Any]) -> tuple[list[tuple[int, str | None]], list[int], str]:
    """Tenant A floods (``FLOODERS`` clients) while tenant B sends 6 requests, 2 at a time; returns
    A's answers, B's statuses and the balancer's metrics text."""
    async with slow_replica() as url, balancer_over(url, limits=limits) as (balancer, session):
        done = asyncio.Event()
        a_answers: list[tuple[int, str | None]] = []

        async def flooder(index: int) -> None:
            for sent in range(200):  # bounded: stops once B is done
                if done.is_set():
                    return
                answer = await send(session, balancer.url, "tenant-a", 100 + sent)
                a_answers.append(answer)
                if answer[0] != 200:  # refused: back at once, then and again after a pause
                    await asyncio.sleep(0.02 * (index % 2))

        flooders = [asyncio.create_task(flooder(i)) for i in range(FLOODERS)]
        try:
            async with asyncio.timeout(60):
                while len(a_answers) < FLOODERS:  # noqa: ASYNC110 - A is flooding: the queue is full
                    await asyncio.sleep(0.02)
                b_statuses: list[int] = []
                for pair in range(3):
                    answers = await asyncio.gather(
                        *(send(session, balancer.url, "tenant-b", 10 + 2 * pair + i) for i in range(2))
                    )
                    b_statuses += [status for status, _ in answers]
        finally:
            done.set()
            await asyncio.gather(*flooders)
        async with session.get(balancer.url + "/metrics") as response:
            metrics = await response.text()
        return a_answers, b_statuses, metrics


async def test_a_flooding_tenant_is_held_to_its_caps_and_another_tenant_is_served() -> None:
    a_answers, b_statuses, metrics = await flood_and_probe({**LIMITS, **TENANT_CAPS})
    assert b_statuses == [200] * 6
    a_statuses = {status for status, _ in a_answers}
    assert a_statuses <= {200, 429, 503} and 429 in a_statuses and 200 in a_statuses
    for status, retry_after in a_answers:
        if status != 200:
            assert retry_after is not None and int(retry_after) >= 1
    assert metric_value(metrics, "kvlb_admission_shed_total", reason="tenant_queue") >= 1
    assert metric_value(metrics, "kvlb_admission_shed_total", reason="max_inflight") == 0
    assert metric_value(metrics, "kvlb_admission_tenant_overflow_total") == 0


async def test_without_per_tenant_caps_the_flooding_tenant_takes_every_place() -> None:
    """What the caps prevent: with them at the global values (the default, no isolation), A's flood
    holds every slot and queue place and B is refused (429, the global queue full) too."""
    a_answers, b_statuses, metrics = await flood_and_probe(LIMITS)
    assert 429 in b_statuses
    assert {status for status, _ in a_answers} <= {200, 429, 503}
    assert metric_value(metrics, "kvlb_admission_shed_total", reason="tenant_queue") == 0


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def test_grpc_calls_carry_their_tenant_in_metadata_and_share_its_caps_with_http(
    tokenizer: Tokenizer,
) -> None:
    async with grpc_running(
        tokenizer,
        1,
        time_scale=0.05,
        limits__max_inflight=4,
        limits__max_inflight_per_tenant=1,
        limits__max_queued_per_tenant=0,
    ) as g:
        a = ((HEADER, "tenant-a"),)
        first = g.balancer.Generate(token_request([7, 8, 9, 10], max_tokens=100), metadata=a)
        try:
            assert (await first.read()).index == 0  # in flight: tenant A's one slot
            second = g.balancer.Generate(token_request([11, 12, 13], max_tokens=1), metadata=a)
            error = await failure(second.read())
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limits.max_queued_per_tenant = 0" in (error.details() or "")
            assert ("retry-after", "1") in tuple(error.trailing_metadata() or ())
            body = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 1}
            over_http = await g.http.post("/v1/completions", body, headers={HEADER: "tenant-a"})
            assert over_http.status == 429 and over_http.headers["Retry-After"] == "1"
            other = g.balancer.Generate(
                token_request([21, 22, 23], max_tokens=1), metadata=((HEADER, "tenant-b"),)
            )
            chunks = [chunk async for chunk in other]
            assert chunks and chunks[0].index == 0
        finally:
            first.cancel()
        async with g.http.session.get(g.http.url + "/metrics") as response:
            metrics = await response.text()
        assert metric_value(metrics, "kvlb_admission_shed_total", reason="tenant_queue") == 2
