"""TRT-LLM personality over real HTTP: the destructive event drain, its JSON shape, hashes, overflow,
restarts, iteration stats and health endpoints.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
import zmq.asyncio
from emulated_replica import started

from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

TPB = 8  # tokens per block used in these tests
U32, U64 = (1 << 32) - 1, (1 << 64) - 1


def ref_block_hash(tokens: list[int], parent: int | None) -> int:
    """TRT-LLM's V1 ``BlockKeyHasher``, written independently of the emulator.

    The recipe is docs/reference/engine-events.md §4.5."""

    def mix32(value: int, seed: int) -> int:
        value &= U32
        value = (((value >> 16) ^ value) * 0x45D9F3B) & U32
        value = (((value >> 16) ^ value) * 0x45D9F3B) & U32
        value = (((value >> 16) ^ value) + 0x9E3779B9) & U32  # the add wraps at 32 bits
        return seed ^ ((value + (seed << 6) + (seed >> 2)) & U64)

    seed = (len(tokens) ^ ((parent or 0) * 0xBF58476D1CE4E5B9)) & U64
    for token in tokens:
        seed = mix32(token, seed)
    return seed


def ref_chain(tokens: list[int], parent: int | None = None) -> list[int]:
    hashes = []
    for start in range(0, len(tokens), TPB):
        parent = ref_block_hash(tokens[start : start + TPB], parent)
        hashes.append(parent)
    return hashes


@asynccontextmanager
async def running(**overrides: Any) -> AsyncIterator[tuple[Replica, aiohttp.ClientSession]]:
    settings: dict[str, Any] = {"time_scale": 20.0, "page_size": TPB, **overrides}
    config = ReplicaConfig(name="trt", engine="trtllm", profile=get_profile("cpu-test"), **settings)
    zctx = zmq.asyncio.Context()
    try:
        async with started(config, zctx) as replica, aiohttp.ClientSession() as session:
            yield replica, session
    finally:
        zctx.destroy(linger=0)


async def drain(session: aiohttp.ClientSession, replica: Replica) -> list[dict[str, Any]]:
    async with session.post(replica.url + "/kv_cache_events") as response:
        assert response.status == 200 and response.content_type == "application/json"
        events: list[dict[str, Any]] = json.loads(await response.read())
        return events


async def complete(
    session: aiohttp.ClientSession, replica: Replica, prompt: list[int], max_tokens: int = 1
) -> Any:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    async with session.post(replica.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def tokens_of(block: dict[str, Any]) -> list[int]:
    assert all(t["type"] == "unique_token" and t["token_extra_id"] == 0 for t in block["tokens"])
    return [t["token_id"] for t in block["tokens"]]


async def test_created_first_then_stored_with_partial_block_and_v1_hashes() -> None:
    async with running() as (replica, session):
        prompt = list(range(300, 320))  # prompt[:-1] = 19 tokens: blocks of 8, 8 and a partial 3
        result = await complete(session, replica, prompt)
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        events = await drain(session, replica)
        assert [e["event_id"] for e in events] == list(range(len(events)))
        created = events[0]
        assert created["data"] == {"type": "created", "num_blocks_per_cache_level": [256 // TPB, 0]}
        assert created["window_size"] == 512 and "attention_dp_rank" not in created
        stored = events[1]["data"]
        assert stored["type"] == "stored" and stored["parent_hash"] is None
        blocks = stored["blocks"]
        assert [tokens_of(b) for b in blocks] == [prompt[0:8], prompt[8:16], prompt[16:19]]
        assert [b["block_hash"] for b in blocks] == ref_chain(prompt[:-1])
        assert {b["cache_level"] for b in blocks} == {0} and all(b["type"] == "stored_block" for b in blocks)
        assert await drain(session, replica) == []  # the drain really drains

        again = await complete(session, replica, prompt)  # router-side alignment: prompt[:-1]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


async def test_drain_decodes_with_the_balancer_decoder() -> None:
    decoders = pytest.importorskip("balancer.engines.trtllm")
    from balancer.events import Stored

    async with running() as (replica, session):
        await complete(session, replica, list(range(400, 437)), max_tokens=4)
        async with session.post(replica.url + "/kv_cache_events") as response:
            body = await response.read()
        batch = decoders.TrtllmDecoder(tokens_per_block=TPB).decode([body])
        assert batch.errors == ()
        stored = [e for e in batch.events if isinstance(e, Stored)]
        assert list(stored[0].engine_hashes) == ref_chain(list(range(400, 436)))[:4]  # partial dropped


async def test_overflow_drops_the_oldest_events_leaving_gaps() -> None:
    async with running(event_buffer_max_size=3) as (replica, session):
        for base in range(5):
            await complete(session, replica, list(range(1000 * base + 1000, 1000 * base + 1020)))
        events = await drain(session, replica)
        ids = [e["event_id"] for e in events]
        assert len(ids) == 3 and ids == sorted(ids) and ids[0] > 1  # created and early stores are gone
        stats = await (await session.get(replica.url + "/admin/stats")).json()
        assert stats["events_overflow_dropped"] >= ids[0] - 1 >= 1


async def test_eviction_emits_removed_and_host_tier_emits_updated() -> None:
    prompts = [list(range(base, base + 81)) for base in (10_000, 20_000, 30_000, 40_000)]
    for host_blocks in (0, 64):
        async with running(host_cache_blocks=host_blocks) as (replica, session):
            for prompt in prompts:  # 10 full blocks each, a 32-block pool
                await complete(session, replica, prompt)
            events = await drain(session, replica)
            first = ref_chain(prompts[0][:-1])
            kinds = [e["data"]["type"] for e in events]
            if host_blocks == 0:
                removed = [
                    h for e in events if e["data"]["type"] == "removed" for h in e["data"]["block_hashes"]
                ]
                assert set(first) <= set(removed) and "updated" not in kinds
            else:
                updated = [e["data"] for e in events if e["data"]["type"] == "updated"]
                assert {u["block_hash"] for u in updated} >= set(first) and "removed" not in kinds
                assert updated[0]["cache_level"] == {"type": "event_diff", "new_value": 1, "old_value": 0}


async def test_restart_starts_again_at_event_id_zero_with_created() -> None:
    async with running() as (replica, session):
        await complete(session, replica, list(range(300, 320)))
        assert len(await drain(session, replica)) >= 2
        await session.post(replica.url + "/admin/faults", json={"restart": True})
        events = await drain(session, replica)
        assert events[0]["event_id"] == 0 and events[0]["data"]["type"] == "created"


async def test_attention_dp_ranks_and_iteration_stats() -> None:
    async with running(dp_size=2) as (replica, session):
        await complete(session, replica, list(range(300, 320)))
        await complete(session, replica, list(range(300, 320)))  # round robin: the other rank
        events = await drain(session, replica)
        created = [e for e in events if e["data"]["type"] == "created"]
        assert sorted(e["attention_dp_rank"] for e in created) == [0, 1]
        assert all(e["event_id"] == 0 for e in created)
        stats = await (await session.get(replica.url + "/metrics")).json()
        assert stats and {"kvCacheStats", "numQueuedRequests", "iter", "inflightBatchingStats"} <= set(
            stats[0]
        )
        assert stats[0]["kvCacheStats"]["tokensPerBlock"] == TPB
        assert await (await session.get(replica.url + "/metrics")).json() == []  # drained too
        text = await (await session.get(replica.url + "/prometheus/metrics")).text()
        assert "trtllm_kv_cache_hit_rate{" in text


async def test_health_endpoints_and_injected_health_failure() -> None:
    async with running() as (replica, session):
        assert (await session.get(replica.url + "/health")).status == 200
        assert (await session.get(replica.url + "/health_generate")).status == 200
        await session.post(replica.url + "/admin/faults", json={"fail_health": True})
        assert (await session.get(replica.url + "/health")).status == 503
        assert (await session.get(replica.url + "/health_generate")).status == 500
        bad = await session.post(replica.url + "/admin/faults", json={"fail_helth": True})
        assert bad.status == 400
