"""The server's per-request layers, cut for issue #16, keep their guarantees on the data-plane path
(over real sockets on 127.0.0.1, a real balancer):

* the in-flight accounting, now inside the app's one middleware (``kvlb_middleware``, no middleware
  of its own): a ``/v1/completions`` request still running at the shutdown grace is cancelled then,
  and counted as 499, instead of aiohttp waiting twice its ``shutdown_timeout``.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web
from kvlb_harness import MODEL, completion_replica, metric_value, wait_ready
from prometheus_client import generate_latest

from balancer.app import Balancer
from balancer.config import Settings, from_mapping
from balancer.serve_options import ServeOptions
from balancer.tokenizer.tokenizer import TokenIdTokenizer

GRACE_S = 0.5
HELD_S = 30.0
"""The longest the fake replica holds an answer (far past every bound of the test)."""


async def test_a_request_in_flight_at_the_grace_is_cancelled_then_and_counted() -> None:
    started = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        await request.read()
        started.set()
        await asyncio.sleep(HELD_S)  # the answer never comes within the test
        return web.Response(text="late")

    async with completion_replica(held) as url:
        tree = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": [
                {"model": MODEL, "replicas": [{"id": "r0", "url": url, "engine": "sglang", "block_size": 4}]}
            ],
            "health_interval_s": 0.2,
            "scrape_interval_s": 0,
        }
        balancer = Balancer(
            from_mapping(Settings, tree).validate(),
            tokenizers={MODEL: TokenIdTokenizer()},
            options=ServeOptions(shutdown_grace_s=GRACE_S),
        )
        await balancer.start()
        stopped = False
        try:
            async with aiohttp.ClientSession() as session:
                await wait_ready(session, balancer.url)
                body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 4}
                call = asyncio.create_task(session.post(balancer.url + "/v1/completions", json=body))
                try:
                    await asyncio.wait_for(started.wait(), 30.0)
                    began = time.monotonic()
                    await balancer.stop()
                    stopped = True
                    took_s = time.monotonic() - began
                finally:
                    call.cancel()
                    await asyncio.gather(call, return_exceptions=True)
        finally:
            if not stopped:
                await balancer.stop()
    # cancelled at the grace: without the request's task kept, aiohttp waited its shutdown_timeout
    # (the grace + 2 s) twice, about 5 s
    assert took_s < GRACE_S + 1.5, took_s
    text = generate_latest(balancer.metrics.registry).decode()
    assert metric_value(text, "kvlb_http_requests_total", endpoint="/v1/completions", status="499") == 1
