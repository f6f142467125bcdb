"""SGLang personality over real sockets: ZMQ PUB frames, replay, HTTP endpoints, DP ranks, faults.

Frames are checked against an independent reference decode written here from the spec
(``docs/reference/engine-events.md`` §1-§2) and, when present, against the balancer's own decoder.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
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

from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

PAGE = 4  # cpu-test page size
END_SEQ = b"\xff" * 8


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@asynccontextmanager
async def running(zctx: zmq.asyncio.Context, **overrides: Any) -> AsyncIterator[Replica]:
    settings: dict[str, Any] = {"time_scale": 20.0, "profile": get_profile("cpu-test"), **overrides}
    config = ReplicaConfig(name="sg", engine="sglang", **settings)
    async with started(config, zctx) as replica:
        yield replica


async def subscribe(zctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    await asyncio.sleep(0.2)  # PUB/SUB slow joiner
    return sub


async def receive(sub: zmq.asyncio.Socket, timeout_s: float = 0.3) -> list[list[bytes]]:
    """Every message that arrives until the socket stays quiet for ``timeout_s``."""
    messages = []
    while await sub.poll(int(timeout_s * 1000)):
        messages.append(await sub.recv_multipart())
    return messages


async def replay(zctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """``[b"", seq8, payload]`` of each batch a DEALER gets from ``start`` (0.5.23's 4-frame replies)."""
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies: list[list[bytes]] = []
        async with asyncio.timeout(5):
            while True:
                reply = await dealer.recv_multipart()
                assert len(reply) == 4 and reply[0] == b""  # 0.5.23: [b"", topic, seq8, payload]
                if reply[2] == END_SEQ:
                    assert reply == [b"", b"", END_SEQ, b""]
                    return replies
                replies.append([b"", reply[2], reply[3]])  # the topic frame checked, then dropped
    finally:
        dealer.close(linger=0)


def ref_decode(frames: list[bytes]) -> tuple[int, int, list[Any]]:
    """Spec decode: 3 frames [topic, seq u64 BE, msgpack [ts, events, dp_rank]] -> (seq, rank, events)."""
    assert len(frames) == 3
    ts, events, rank = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
    assert isinstance(ts, float)
    return int.from_bytes(frames[1], "big"), rank, events


def ref_page_hashes(tokens: list[int], page: int) -> list[int]:
    """SGLang's chained SHA-256 page hashes as signed i64, written independently.

    The recipe is docs/reference/engine-events.md §2.4."""
    out, prior = [], b""
    for start in range(0, len(tokens) - len(tokens) % page, page):
        prior = hashlib.sha256(prior + struct.pack(f"<{page}I", *tokens[start : start + page])).digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


async def complete(session: aiohttp.ClientSession, replica: Replica, prompt: list[int], **extra: Any) -> Any:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    async with session.post(replica.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_startup_clear_then_coalesced_store_with_golden_hashes(zctx: zmq.asyncio.Context) -> None:
    async with running(zctx) as replica, aiohttp.ClientSession() as session:
        publisher = replica.personality.publishers[0]  # type: ignore[union-attr]
        [first] = await replay(zctx, publisher.replay_endpoint, 0)
        assert first[1] == (0).to_bytes(8, "big")
        assert msgpack.unpackb(first[2])[1] == [{"type": "AllBlocksCleared"}]  # seq 0 at start-up

        sub = await subscribe(zctx, publisher.pub_endpoint)
        prompt = list(range(1000, 1031))  # 31 tokens (one prefill chunk): 7 full pages and a partial one
        result = await complete(session, replica, prompt)
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        messages = await receive(sub)
        seq, rank, events = ref_decode(messages[0])
        assert (seq, rank) == (1, 0)
        [stored] = events
        assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None
        assert stored["block_size"] == PAGE and stored["token_ids"] == prompt[:28]
        assert stored["block_hashes"] == ref_page_hashes(prompt, PAGE)  # one event, 7 coalesced pages
        assert set(stored) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                               "lora_id", "medium"}  # fmt: skip

        again = await complete(session, replica, prompt)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 28
        sub.close()


async def test_events_round_trip_through_the_balancer_decoder(zctx: zmq.asyncio.Context) -> None:
    decoders = pytest.importorskip("balancer.engines.sglang")
    from balancer.events import Stored

    for encoding in ("map", "array"):
        async with running(zctx, event_encoding=encoding) as replica, aiohttp.ClientSession() as session:
            sub = await subscribe(zctx, replica.personality.publishers[0].pub_endpoint)  # type: ignore[union-attr]
            prompt = list(range(2000, 2021))
            await complete(session, replica, prompt, max_tokens=8)
            decoder = decoders.SglangDecoder(block_size=PAGE)
            batches = [decoder.decode(frames) for frames in await receive(sub)]
            stored = [e for b in batches for e in b.events if isinstance(e, Stored)]
            assert stored[0].parent is None
            assert [h & (2**64 - 1) for h in ref_page_hashes(prompt, PAGE)] == list(stored[0].engine_hashes)
            assert stored[1].parent == stored[0].engine_hashes[-1]  # the finished sequence extends the chain
            raw = stored[0].tokens + stored[1].tokens
            sequence = list(struct.unpack(f"<{len(raw) // 4}I", raw))  # prompt, then generated tokens
            assert sequence[:20] == prompt[:20] and len(sequence) == 28  # (21 + 8 - 1) tokens, full pages
            expected = [h & (2**64 - 1) for h in ref_page_hashes(sequence, PAGE)]
            assert expected == [*stored[0].engine_hashes, *stored[1].engine_hashes]
            assert all(b.errors == () for b in batches)
            sub.close()


async def test_eviction_publishes_removed_lru_first(zctx: zmq.asyncio.Context) -> None:
    async with running(zctx) as replica, aiohttp.ClientSession() as session:
        sub = await subscribe(zctx, replica.personality.publishers[0].pub_endpoint)  # type: ignore[union-attr]
        prompts = [list(range(base, base + 80)) for base in (10_000, 20_000, 30_000, 40_000)]
        for prompt in prompts:  # 20 pages each, a 64-page pool: the fourth evicts the first
            await complete(session, replica, prompt)
        events = [e for frames in await receive(sub) for e in ref_decode(frames)[2]]
        removed = [e for e in events if e["type"] == "BlockRemoved"]
        assert removed, events
        chain = ref_page_hashes(prompts[0], PAGE)
        # The oldest chain goes first, leaf node first; pages root-most first within each node. Its
        # nodes are the prefill chunks cached as they completed: 32, 32 and 16 tokens.
        assert removed[0]["block_hashes"] == chain[16:20] + chain[8:16] + chain[0:8]
        stats = (await (await session.get(replica.url + "/admin/stats")).json())["ranks"][0]
        assert stats["evicted_blocks_total"] == len(chain)
        sub.close()


async def test_flush_cache_publishes_all_blocks_cleared(zctx: zmq.asyncio.Context) -> None:
    async with running(zctx) as replica, aiohttp.ClientSession() as session:
        sub = await subscribe(zctx, replica.personality.publishers[0].pub_endpoint)  # type: ignore[union-attr]
        await complete(session, replica, list(range(100, 120)))
        async with session.post(replica.url + "/flush_cache") as response:
            assert response.status == 200
        events = [ref_decode(frames)[2] for frames in await receive(sub)]
        assert events[-1] == [{"type": "AllBlocksCleared"}]
        again = await complete(session, replica, list(range(100, 120)))
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        sub.close()


async def test_replay_fills_a_gap_left_by_dropped_batches(zctx: zmq.asyncio.Context) -> None:
    async with running(zctx) as replica, aiohttp.ClientSession() as session:
        publisher = replica.personality.publishers[0]  # type: ignore[union-attr]
        sub = await subscribe(zctx, publisher.pub_endpoint)
        await session.post(replica.url + "/admin/faults", json={"drop_events": 1.0})
        await complete(session, replica, list(range(500, 520)))  # seq 1 is lost (HWM-style)
        await session.delete(replica.url + "/admin/faults")
        await complete(session, replica, list(range(600, 620)))
        seen = [ref_decode(frames)[0] for frames in await receive(sub)]
        assert seen and seen[0] >= 2  # the subscriber sees a gap
        replayed = await replay(zctx, publisher.replay_endpoint, 1)
        assert [int.from_bytes(r[1], "big") for r in replayed][: seen[0]] == list(range(1, seen[0] + 1))
        lost = msgpack.unpackb(replayed[0][2], raw=False)[1]
        assert lost[0]["block_hashes"] == ref_page_hashes(list(range(500, 520)), PAGE)
        sub.close()


async def test_batches_dropped_without_replay_are_lost_for_good(zctx: zmq.asyncio.Context) -> None:
    """``replay_dropped: false``: the dropped batch is in neither the live stream nor the replay
    buffer (the later batches are in both)."""
    async with running(zctx) as replica, aiohttp.ClientSession() as session:
        publisher = replica.personality.publishers[0]  # type: ignore[union-attr]
        sub = await subscribe(zctx, publisher.pub_endpoint)
        await session.post(replica.url + "/admin/faults", json={"drop_events": 1.0, "replay_dropped": False})
        await complete(session, replica, list(range(500, 520)))  # seq 1 is lost for good
        await session.delete(replica.url + "/admin/faults")
        await complete(session, replica, list(range(600, 620)))
        seen = [ref_decode(frames)[0] for frames in await receive(sub)]
        assert seen and seen[0] >= 2
        replayed = [int.from_bytes(r[1], "big") for r in await replay(zctx, publisher.replay_endpoint, 0)]
        assert replayed[0] == 0 and 1 not in replayed and seen[0] in replayed
        sub.close()


async def test_replay_from_before_the_buffer_starts_at_the_oldest_kept_batch(
    zctx: zmq.asyncio.Context,
) -> None:
    async with running(zctx, buffer_steps=2) as replica, aiohttp.ClientSession() as session:
        publisher = replica.personality.publishers[0]  # type: ignore[union-attr]
        for base in (100, 200, 300):
            await complete(session, replica, list(range(base, base + 20)))
        replayed = await replay(zctx, publisher.replay_endpoint, 0)
        seqs = [int.from_bytes(r[1], "big") for r in replayed]
        assert seqs == [publisher.seq - 2, publisher.seq - 1]  # no error: the consumer sees the jump


async def test_restart_starts_over_with_new_epoch(zctx: zmq.asyncio.Context) -> None:
    async with running(zctx, epoch_in_topic=True, topic="kv") as replica, aiohttp.ClientSession() as session:
        publisher = replica.personality.publishers[0]  # type: ignore[union-attr]
        sub = await subscribe(zctx, publisher.pub_endpoint)
        await complete(session, replica, list(range(100, 120)))
        before = await receive(sub)
        async with session.post(replica.url + "/admin/faults", json={"restart": True}) as response:
            assert response.status == 200
        after = await receive(sub)
        assert after[0][1] == (0).to_bytes(8, "big")
        assert msgpack.unpackb(after[0][2])[1] == [{"type": "AllBlocksCleared"}]
        epoch_before = before[0][0].split(b"\x00sgl-kv-epoch=")[1]
        epoch_after = after[0][0].split(b"\x00sgl-kv-epoch=")[1]
        assert before[0][0].startswith(b"kv\x00") and epoch_before != epoch_after
        again = await complete(session, replica, list(range(100, 120)))
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        sub.close()


async def test_dp_ranks_publish_on_base_plus_rank(zctx: zmq.asyncio.Context) -> None:
    async with running(zctx, dp_size=2) as replica, aiohttp.ClientSession() as session:
        publishers = replica.personality.publishers  # type: ignore[union-attr]
        ports = [int(p.pub_endpoint.rsplit(":", 1)[1]) for p in publishers]
        assert ports[1] == ports[0] + 1
        subs = [await subscribe(zctx, p.pub_endpoint) for p in publishers]
        await complete(session, replica, list(range(100, 120)), data_parallel_rank=1)
        assert await receive(subs[0], 0.3) == []
        [(seq, rank, events)] = [ref_decode(frames) for frames in await receive(subs[1])]
        assert rank == 1 and seq == 1 and events[0]["type"] == "BlockStored"
        async with session.get(replica.url + "/server_info") as response:
            info = await response.json()
        assert info["kv_events"]["endpoint_port_base"] == ports[0] and info["kv_events"]["dp_size"] == 2
        assert info["page_size"] == PAGE
        for sub in subs:
            sub.close()


async def test_sglang_http_endpoints(zctx: zmq.asyncio.Context) -> None:
    async with running(zctx, metrics_prefix="sglang_") as replica, aiohttp.ClientSession() as session:
        await complete(session, replica, list(range(100, 120)))
        await complete(session, replica, list(range(100, 120)))
        loads = await (await session.get(replica.url + "/v1/loads")).json()
        assert loads["dp_rank_count"] == 1 and loads["loads"][0]["cache_hit_rate"] == pytest.approx(16 / 40)
        get_load = await (await session.get(replica.url + "/get_load")).json()
        assert set(get_load[0]) >= {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
        model = await (await session.get(replica.url + "/get_model_info")).json()
        assert model["is_generation"] is True
        text = await (await session.get(replica.url + "/metrics")).text()
        for gauge in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate"):
            assert f"sglang_{gauge}{{" in text
        assert "sglang_cache_hit_rate{" in text and "0.4" in text


CAPTURES = Path(__file__).resolve().parents[1] / "golden" / "real" / "sglang-0.5.23-cpu"


async def test_reproduces_a_real_sglang_frame_byte_for_byte(zctx: zmq.asyncio.Context) -> None:
    """Real SGLang 0.5.23 seq 1 (32 coalesced pages): same tokens in, same bytes out but the timestamp."""
    real = [bytes.fromhex(line) for line in (CAPTURES / "sgl2-frame002.hex").read_text().split()]
    [stored] = msgpack.unpackb(real[2], raw=False)[1]
    overrides = {"profile": get_profile("h100-llama3-8b"), "topic": "kv-events", "time_scale": 50.0}
    async with running(zctx, **overrides) as replica, aiohttp.ClientSession() as session:
        sub = await subscribe(zctx, replica.personality.publishers[0].pub_endpoint)  # type: ignore[union-attr]
        await complete(session, replica, stored["token_ids"])
        [ours] = await receive(sub)
        sub.close()
    assert ours[0] == real[0] == b"kv-events" and ours[1] == real[1] == (1).to_bytes(8, "big")
    assert ours[2][:2] == real[2][:2] == b"\x93\xcb"  # [float64 ts, events, rank]
    assert ours[2][10:] == real[2][10:]
