"""``limits.prefill_tokens_per_s``: a non-streaming request gives its prompt tokens of its tenant's
``limits.max_inflight_prompt_tokens_per_tenant`` back at the estimated end of its prefill, not at the
end of its answer (real sockets, a fake replica on 127.0.0.1 answering each completion whole after
``ANSWER_S``). Before 2026-12-01 (branch h-tenantfollow) a non-streaming request held them until its
answer was in, so a tenant's long generations held its allowance while they decoded."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web
from kvlb_harness import MODEL, balancer_over, completion_replica

HEADER = "x-kvlb-tenant"
ANSWER_S = 1.0
"""How long the fake replica takes over each answer (its prefill and decode together)."""
PROMPT_TOKENS = 80
CAP = 100
"""The tenant's allowance: one prompt at a time."""
RATE = 800.0
"""``limits.prefill_tokens_per_s``: a prompt's estimated prefill is 0.1 s."""


@pytest.mark.parametrize("rate", [None, RATE])
async def test_a_whole_answer_gives_its_prompt_tokens_back_after_its_estimated_prefill(
    rate: float | None,
) -> None:
    arrivals: list[float] = []

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        arrivals.append(time.monotonic())
        await asyncio.sleep(ANSWER_S)
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1, "total_tokens": 81},
            }
        )

    limits: dict[str, float] = {"max_inflight_prompt_tokens_per_tenant": CAP, "queue_timeout_s": 10.0}
    if rate is not None:
        limits["prefill_tokens_per_s"] = rate
    async with completion_replica(slow) as url, balancer_over(url, limits=limits) as (balancer, session):

        async def send(first: int) -> int:
            prompt = [first + i for i in range(PROMPT_TOKENS)]
            body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1})
            headers = {HEADER: "a", "content-type": "application/json"}
            async with session.post(balancer.url + "/v1/completions", data=body, headers=headers) as r:
                await r.read()
                return r.status

        async with asyncio.timeout(30):
            first = asyncio.create_task(send(1))
            await asyncio.sleep(0.02)
            statuses = await asyncio.gather(first, send(1000))
    assert statuses == [200, 200]
    gap_s = arrivals[1] - arrivals[0]
    if rate is None:  # held to the end of the first answer
        assert gap_s >= ANSWER_S * 0.9, gap_s
    else:  # given back 0.1 s after the first was sent: the second goes long before its end
        assert gap_s < ANSWER_S / 2, gap_s
