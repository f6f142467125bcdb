"""The emulator's vLLM personality against the real vLLM 0.32 captures (tests/golden/real/vllm-0.32.0-cpu).

The capture's frames 001-004 are one 512-token prompt prefilled 128 tokens per step, published as four
batches of one chained ``BlockStored`` each (seq 0..3: nothing before them). A replica given the same
tokens, with 128-token blocks and 128-token prefill chunks, must send the same four messages: topic,
seq and payload byte for byte, but for the 8 bytes of the float64 timestamp. ``POST
/reset_prefix_cache`` must then send frame 035's ``AllBlocksCleared``. Evictions (frames 007-012) are
one ``BlockRemoved`` of one hash per block, tail first; every message decodes in kvlb's vLLM decoder.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from emulated_replica import started
from wire_hashes import vllm_block_hashes

from balancer.engines.registry import engine_spec
from balancer.engines.vllm import parse_vllm_prometheus
from balancer.events import Removed, Stored
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

CAPTURE = Path(__file__).resolve().parent / "real" / "vllm-0.32.0-cpu"
TS_BYTES = slice(2, 10)
"""Where the float64 timestamp sits in a payload ``93 cb <8 bytes> ...`` (fixarray of 3, float64)."""


def captured(number: int) -> list[bytes]:
    return [bytes.fromhex(line) for line in (CAPTURE / f"vllm2-frame{number:03d}.hex").read_text().split()]


def captured_prompt() -> list[int]:
    """The 512 tokens of frames 001-004 (one chained block each)."""
    return [token for n in range(1, 5) for token in msgpack.unpackb(captured(n)[2])[1][0]["token_ids"]]


@asynccontextmanager
async def running(zctx: zmq.asyncio.Context, **profile: Any) -> AsyncIterator[Replica]:
    base = get_profile("cpu-small-llama").with_overrides(chunk_prefill_tokens=128, **profile)
    config = ReplicaConfig(name="vllm-0", engine="vllm", profile=base, time_scale=50.0, topic="kv-events")
    assert config.block_size == 128 and config.eviction_mode == "block"  # vLLM's defaults
    async with started(config, zctx) as replica:
        yield replica


async def subscribed(zctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    await asyncio.sleep(0.3)  # PUB/SUB slow joiner
    return sub


async def drain(sub: zmq.asyncio.Socket) -> list[list[bytes]]:
    messages = []
    while await sub.poll(400):
        messages.append(await sub.recv_multipart())
    return messages


async def complete(session: aiohttp.ClientSession, replica: Replica, prompt: list[int]) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    async with session.post(replica.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        answer: dict[str, Any] = await response.json()
        return answer


def same_but_timestamp(ours: list[bytes], theirs: list[bytes]) -> bool:
    (topic, seq, payload), (their_topic, their_seq, their_payload) = ours, theirs
    assert payload[:2] == their_payload[:2] == b"\x93\xcb"
    timeless = payload[: TS_BYTES.start] + payload[TS_BYTES.stop :]
    return (topic, seq, timeless) == (
        their_topic,
        their_seq,
        their_payload[: TS_BYTES.start] + their_payload[TS_BYTES.stop :],
    )


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_a_prompt_and_a_reset_give_the_captured_frames_byte_for_byte(zctx: zmq.asyncio.Context) -> None:
    async with running(zctx) as replica, aiohttp.ClientSession() as session:
        publisher = replica.personality.publishers[0]  # type: ignore[union-attr]
        assert publisher.seq == 0 and not publisher.buffer  # vLLM publishes nothing at start-up
        sub = await subscribed(zctx, publisher.pub_endpoint)
        answer = await complete(session, replica, captured_prompt())
        assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        messages = await drain(sub)
        assert len(messages) == 4
        for ours, number in zip(messages, range(1, 5), strict=True):
            assert same_but_timestamp(ours, captured(number)), f"frame {number:03d}"

        again = await complete(session, replica, captured_prompt())
        # vLLM recomputes the last prompt token, so a fully cached prompt reuses 3 of its 4 blocks.
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 384
        await drain(sub)
        async with session.post(replica.url + "/reset_prefix_cache") as response:
            assert response.status == 200 and await response.json() == {"success": True}
        [cleared] = await drain(sub)
        assert cleared[2][TS_BYTES.stop :] == captured(35)[2][TS_BYTES.stop :]  # AllBlocksCleared, rank 0
        sub.close()


async def test_evictions_are_one_block_removed_per_block_tail_first(zctx: zmq.asyncio.Context) -> None:
    async with running(zctx, kv_capacity_tokens=640) as replica, aiohttp.ClientSession() as session:
        publisher = replica.personality.publishers[0]  # type: ignore[union-attr]
        sub = await subscribed(zctx, publisher.pub_endpoint)
        first = captured_prompt()
        await complete(session, replica, first)
        other = [token + 1 for token in first[:384]]
        await complete(session, replica, other)  # a pool of 5 blocks: its 3 new blocks + 1 evict 3 of 4
        messages = await drain(sub)
        decoder = engine_spec("vllm").decoder(128)
        events = []
        for message in messages:
            batch = decoder.decode(message)
            assert batch.errors == () and batch.ignored == 0
            events.extend(batch.events)
            for raw in msgpack.unpackb(message[2])[1]:
                if raw["type"] == "BlockRemoved":
                    assert list(raw) == ["type", "block_hashes", "medium", "group_idx"]
                    assert len(raw["block_hashes"]) == 1 and raw["medium"] == "GPU" and raw["group_idx"] == 0
                elif raw["type"] == "BlockStored":
                    assert raw["extra_keys"] == [None] * len(raw["block_hashes"])
                    assert raw["kv_cache_spec_kind"] == "full_attention" and raw["lora_name"] is None
        first_hashes = [value for value, _ in vllm_block_hashes(first, 128)]
        removed = [h for event in events if isinstance(event, Removed) for h in event.engine_hashes]
        assert removed and set(removed) <= set(first_hashes)
        assert removed == sorted(removed, key=first_hashes.index, reverse=True)  # tail block first
        stored = [h for event in events if isinstance(event, Stored) for h in event.engine_hashes]
        assert stored[: len(first_hashes)] == first_hashes  # u64, as vLLM publishes them
        sub.close()


async def test_restart_is_silent_and_starts_again_at_seq_0(zctx: zmq.asyncio.Context) -> None:
    async with running(zctx) as replica, aiohttp.ClientSession() as session:
        publisher = replica.personality.publishers[0]  # type: ignore[union-attr]
        await complete(session, replica, captured_prompt()[:256])
        assert publisher.seq == 2
        async with session.post(replica.url + "/admin/faults", json={"restart": True}) as response:
            assert response.status == 200
        assert publisher.seq == 0 and not publisher.buffer  # no AllBlocksCleared, unlike SGLang


async def test_http_surface_reads_as_vllm(zctx: zmq.asyncio.Context) -> None:
    async with running(zctx) as replica, aiohttp.ClientSession() as session:
        await complete(session, replica, captured_prompt()[:256])
        async with session.get(replica.url + "/metrics") as response:
            text = await response.text()
        load = parse_vllm_prometheus(text)
        assert load.running_reqs == 0 and load.dp_ranks == 1
        assert load.capacity_tokens == replica.config.capacity_blocks * 128
        assert 'vllm:prompt_tokens_total{engine="0",model_name=' in text
        async with session.get(replica.url + "/kv_event_sources") as response:
            sources = await response.json()
        assert sources["0"]["endpoint"].endswith(f":{replica.config.event_port}")
        assert sources["0"]["topic"] == "kv-events" and sources["0"]["publisher"] == "zmq"
        async with session.get(replica.url + "/version") as response:
            assert (await response.json())["version"] == "0.32.0"
