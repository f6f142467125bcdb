"""``limits.max_tokenizing_per_tenant``: a tenant's long prompts take at most that many of the
tokenizer's threads at once, while another tenant's go on (real sockets, the real default tokenizer,
one in-process balancer). Before 2026-12-01 (branch h-tenantfollow) nothing bounded a tenant's share
of the threads: four long prompts of one tenant were tokenized at once, taking the cores from the
event loop that serves every other tenant (docs/reliability.md, "Tenant isolation")."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web
from kvlb_harness import MODEL, completion_replica, metric_value, shared_deepseek, wait_ready

from balancer.app import Balancer
from balancer.config import Settings, from_mapping

HEADER = "x-kvlb-tenant"
PROMPT_CHARS = 200_000
"""Characters of a long prompt: about 0.1-0.2 s of tokenizing each, in a thread."""


@asynccontextmanager
async def balancer_with_tokenizer(
    url: str, **limits: Any
) -> AsyncIterator[tuple[Balancer, aiohttp.ClientSession]]:
    tree = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {"model": MODEL, "replicas": [{"id": "r0", "url": url, "engine": "sglang", "block_size": 4}]}
        ],
        "health_interval_s": 0.2,
        "scrape_interval_s": 0,
        "limits": limits,
    }
    balancer = Balancer(from_mapping(Settings, tree).validate(), tokenizers={MODEL: shared_deepseek()})
    try:
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)
            yield balancer, session
    finally:
        await balancer.stop()


async def answer(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
        }
    )


def long_prompt(seed: int) -> bytes:
    rng = random.Random(seed)
    words = [f"w{rng.randrange(10**6)}" for _ in range(2_000)]
    text = " ".join(rng.choice(words) for _ in range(PROMPT_CHARS // 4))[:PROMPT_CHARS]  # holds alike
    return json.dumps({"model": MODEL, "prompt": text, "max_tokens": 1}).encode()


async def send(session: aiohttp.ClientSession, url: str, tenant: str, body: bytes) -> tuple[int, str | None]:
    headers = {HEADER: tenant, "content-type": "application/json"}
    async with session.post(url + "/v1/completions", data=body, headers=headers) as response:
        await response.read()
        return response.status, response.headers.get("Retry-After")


async def sampled_holds(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list[float]:
    """``kvlb_admission_tokenizing_bytes`` every 5 ms until ``stop`` (bounded: 4,000 samples)."""
    samples: list[float] = []
    for _ in range(4_000):
        if stop.is_set():
            break
        async with session.get(url + "/metrics") as response:
            samples.append(metric_value(await response.text(), "kvlb_admission_tokenizing_bytes"))
        await asyncio.sleep(0.005)
    return samples


async def test_one_tenant_s_long_prompts_take_one_thread_at_a_time_and_another_tenant_goes_on() -> None:
    body = long_prompt(0)  # one body: every request holds the same bytes for the tokenizer
    limits = {"max_tokenizing_per_tenant": 1, "queue_timeout_s": 20.0}
    async with completion_replica(answer) as url, balancer_with_tokenizer(url, **limits) as (balancer, http):
        session = http
        stop = asyncio.Event()
        sampler = asyncio.create_task(sampled_holds(session, balancer.url, stop))
        assert await send(session, balancer.url, "a", body) == (200, None)
        stop.set()
        alone = max(await sampler)  # what one request holds at most (a prompt may hold in two steps)
        assert alone > 0, "no tokenizing hold was sampled"
        stop = asyncio.Event()
        sampler = asyncio.create_task(sampled_holds(session, balancer.url, stop))
        done_order: list[str] = []

        async def tenant(name: str, body: bytes) -> int:
            status, _ = await send(session, balancer.url, name, body)
            done_order.append(name)
            return status

        async with asyncio.timeout(60):
            a = [asyncio.create_task(tenant("a", body)) for _ in range(4)]
            await asyncio.sleep(0.05)  # A's first is in its thread, the others wait for its turn
            b = asyncio.create_task(tenant("b", body))
            statuses = await asyncio.gather(*a, b)
            stop.set()
            samples = await sampler
        async with session.get(balancer.url + "/metrics") as response:
            metrics = await response.text()
    assert statuses == [200] * 5
    # A's four never held the threads together: the bytes held for tokenizing are one request's at
    # most, or A's one and B's one (without the bound: three to five requests' at once)
    assert 0 < max(samples) <= 2 * alone, (alone, sorted(set(samples)))
    # B waited for none of A's: it ended before A's last (A's four go one after another)
    assert done_order.index("b") < len(done_order) - 1, done_order
    assert metric_value(metrics, "kvlb_admission_tokenizing_waits_total") >= 3


async def test_a_tenant_waiting_too_long_for_a_turn_gets_503_with_retry_after() -> None:
    bodies = [long_prompt(seed) for seed in range(6)]
    limits = {"max_tokenizing_per_tenant": 1, "queue_timeout_s": 0.2}
    async with completion_replica(answer) as url, balancer_with_tokenizer(url, **limits) as (balancer, http):
        session = http
        async with asyncio.timeout(60):
            answers = await asyncio.gather(*(send(session, balancer.url, "a", body) for body in bodies))
        async with session.get(balancer.url + "/metrics") as response:
            metrics = await response.text()
    refused = [retry for status, retry in answers if status == 503]
    assert refused and all(retry is not None and int(retry) >= 1 for retry in refused), answers
    assert any(status == 200 for status, _ in answers), answers
    shed = metric_value(metrics, "kvlb_admission_shed_total", reason="tenant_tokenizing")
    assert shed == len(refused), metrics
