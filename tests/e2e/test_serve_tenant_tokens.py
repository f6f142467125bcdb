"""``limits.max_inflight_prompt_tokens_per_tenant`` through a real ``kvlb serve --workers 2`` in
front of a slow stand-in replica, all on 127.0.0.1: a tenant sending many long prompts on fresh
connections (the kernel hands them to either worker) has at most its allowance of prompt tokens at
the replica for the whole service, not one allowance per worker."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from kvlb_harness import completion_replica
from serve_harness import MODEL, Child, start_serve, stop
from test_serve_tenant_rate import wait_served, write_config

PROMPT_TOKENS = 100
CAP = 2 * PROMPT_TOKENS
"""The tenant's allowance: two of its prompts at once."""
HOLD_S = 0.2
CLIENTS = 8
SEND_S = 2.0


async def test_a_tenants_prompt_tokens_are_held_to_its_allowance_across_two_workers(tmp_path: Path) -> None:
    """8 clients of tenant ``long`` send prompts of 100 token ids (non-streaming: each holds its
    tokens until its answer, 0.2 s at the replica) for 2 s, each on a fresh connection, with an
    allowance of 200 tokens: the replica never has more than 2 of them at once, plus one per other
    worker for two workers letting one in at the same instant (with the allowance per worker, before
    it was shared, up to 4)."""
    open_now = 0
    most = 0

    async def complete(request: web.Request) -> web.Response:
        nonlocal open_now, most
        body = await request.json()
        long = len(body["prompt"]) == PROMPT_TOKENS
        if long:
            open_now += 1
            most = max(most, open_now)
        try:
            await asyncio.sleep(HOLD_S)
        finally:
            if long:
                open_now -= 1
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
            }
        )

    serve: Child | None = None
    async with completion_replica(complete) as replica_url:
        path = write_config(
            tmp_path,
            replica_url,
            max_inflight=64,
            queue_timeout_s=10,
            max_inflight_prompt_tokens_per_tenant=CAP,
        )
        try:
            serve = await start_serve(tmp_path, path, "--workers", "2")
            url = serve.info["url"]
            await wait_served(url)
            statuses: list[int] = []
            stop_at = time.monotonic() + SEND_S
            body = json.dumps({"model": MODEL, "prompt": list(range(1, PROMPT_TOKENS + 1)), "max_tokens": 1})
            connector = aiohttp.TCPConnector(force_close=True, limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:

                async def client() -> None:
                    for _ in range(200):  # bounded in count and in time
                        if time.monotonic() >= stop_at:
                            return
                        async with session.post(
                            url + "/v1/completions",
                            data=body,
                            headers={"content-type": "application/json", "x-kvlb-tenant": "long"},
                        ) as r:
                            await r.read()
                            statuses.append(r.status)

                async with asyncio.timeout(SEND_S + 30):
                    await asyncio.gather(*(client() for _ in range(CLIENTS)))
            assert set(statuses) == {200} and len(statuses) >= 10, statuses
            assert 2 <= most <= 3, most
        finally:
            if serve is not None:
                await stop(serve)
