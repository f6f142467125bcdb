"""The upstream client's stage timeouts against real servers on 127.0.0.1: a replica that never
sends its headers (first byte) and one that goes silent mid-body (idle)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from balancer.config.settings import TimeoutConfig
from balancer.errors import UpstreamTimeout
from balancer.upstream.client import RetryableUpstream, UpstreamClient


async def _silent_headers(request: web.Request) -> web.StreamResponse:
    await asyncio.sleep(30)
    return web.Response(text="too late")


async def _silent_body(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b"data: first\n\n")
    await asyncio.sleep(30)
    return response


@pytest.fixture
async def base_url() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/headers", _silent_headers)
    app.router.add_post("/body", _silent_body)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_no_headers_within_first_byte_s_is_retryable(base_url: str) -> None:
    client = UpstreamClient(TimeoutConfig(first_byte_s=0.2, idle_s=5.0))
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(RetryableUpstream, match=r"no response headers within 0\.2s") as info:
            await client.open(base_url, "/headers", b"{}", {})
        assert info.value.reason == "timeout"
        assert asyncio.get_running_loop().time() - started < 2.0
    finally:
        await client.aclose()


async def test_a_silent_stream_times_out_after_idle_s(base_url: str) -> None:
    client = UpstreamClient(TimeoutConfig(first_byte_s=5.0, idle_s=0.2))
    try:
        stream = await client.open(base_url, "/body", b"{}", {})
        chunks = stream.chunks()
        assert await anext(chunks) == b"data: first\n\n"
        with pytest.raises(UpstreamTimeout, match=r"no data from replica for 0\.2s"):
            await anext(chunks)
        stream.close()
    finally:
        await client.aclose()


async def test_a_replica_cookie_is_not_sent_back_on_later_requests() -> None:
    """The client keeps no cookie jar: one client's upstream session must not ride on another's."""
    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Cookie"))
        response = web.Response(text="{}", content_type="application/json")
        response.set_cookie("session", "client-a")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    client = UpstreamClient(TimeoutConfig(first_byte_s=5.0, idle_s=5.0))
    try:
        url = f"http://localhost:{runner.addresses[0][1]}"  # a host name: the jar takes no IP cookies
        for _ in range(2):
            stream = await client.open(url, "/v1/completions", b"{}", {})
            assert [chunk async for chunk in stream.chunks()] == [b"{}"]
            assert stream.finished
            stream.release()
        assert seen == [None, None]
    finally:
        await client.aclose()
        await runner.cleanup()
