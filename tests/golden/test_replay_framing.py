"""Golden replay framing: the emulator answers as SGLang 0.5.23 and vLLM 0.32 do, kvlb reads both forms.

docs/reference/engine-events.md §1.2: a DEALER that sends ``[b"", start_seq8]`` gets one ``[b"", topic,
seq8, payload]`` per kept batch with ``seq >= start``, then ``[b"", b"", ff×8, b""]``. Older
descriptions (and older emulators) answered ``[b"", seq8, payload]`` and ``[b"", ff×8, b""]``; kvlb's
subscriber must keep reading that form too. The payloads served to the subscriber are the real
SGLang 0.5.23 captures (``tests/golden/real/sglang-0.5.23-cpu``, seq 0..19).
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

from balancer.engines.sglang import SglangDecoder
from balancer.events import Resync, Stored
from balancer.metrics import Metrics
from balancer.sources.base import IngestBatch
from balancer.sources.zmq_settings import ZmqSourceSettings
from balancer.sources.zmq_sub import ZmqEventSource
from balancer.types import ReplicaId
from replicas.sim.config import EngineKind, ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

CAPTURES = Path(__file__).resolve().parent / "real" / "sglang-0.5.23-cpu"
TOPIC = b"kv-events"
END_SEQ = b"\xff" * 8
ZMQ_ENGINES: tuple[EngineKind, ...] = ("sglang", "vllm")


def captured_batches() -> list[tuple[int, bytes]]:
    """(seq, payload) of the 20 consecutive SGLang 0.5.23 frames (seq 0..19)."""
    batches = []
    for path in sorted(CAPTURES.glob("sgl2-frame*.hex")):
        topic, seq, payload = (bytes.fromhex(line) for line in path.read_text().split())
        assert topic == TOPIC
        batches.append((int.from_bytes(seq, "big"), payload))
    return batches


# ------------------------------------------------------------------------------- the emulator answers


@asynccontextmanager
async def running(zctx: zmq.asyncio.Context, engine: EngineKind) -> AsyncIterator[Replica]:
    config = ReplicaConfig(
        name="golden",
        engine=engine,
        profile=get_profile("cpu-test"),
        time_scale=20.0,
        topic="kv-events",
        page_size=4,
    )
    async with started(config, zctx) as replica:
        yield replica


async def ask_replay(zctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """Every message a DEALER receives for ``[b"", start8]``, the end marker included."""
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies: list[list[bytes]] = []
        async with asyncio.timeout(5):
            while not replies or END_SEQ not in replies[-1]:
                replies.append(await dealer.recv_multipart())
        return replies
    finally:
        dealer.close(linger=0)


@pytest.mark.parametrize("engine", ZMQ_ENGINES)
async def test_emulator_replay_answers_with_the_topic_frame_and_the_four_frame_end(
    engine: EngineKind,
) -> None:
    zctx = zmq.asyncio.Context()
    try:
        async with running(zctx, engine) as replica, aiohttp.ClientSession() as session:
            body: dict[str, Any] = {"prompt": list(range(300, 340)), "max_tokens": 1, "temperature": 0}
            async with session.post(replica.url + "/v1/completions", json=body) as response:
                assert response.status == 200
            publisher = replica.personality.publishers[0]  # type: ignore[union-attr]
            kept = list(publisher.buffer)
            assert kept, "the request stored blocks: at least one batch is kept for replay"
            replies = await ask_replay(zctx, publisher.replay_endpoint, kept[0][0])
            expected = [[b"", TOPIC, seq.to_bytes(8, "big"), payload] for seq, payload in kept]
            assert replies == [*expected, [b"", b"", END_SEQ, b""]]
            later = await ask_replay(zctx, publisher.replay_endpoint, kept[-1][0] + 1)
            assert later == [[b"", b"", END_SEQ, b""]]  # nothing newer: the end marker alone
    finally:
        zctx.destroy(linger=0)


# ---------------------------------------------------------------------------- kvlb reads both forms


async def serve_replay(
    router: zmq.asyncio.Socket, batches: list[tuple[int, bytes]], asked: list[int], with_topic: bool
) -> None:
    while True:
        client, empty, start = await router.recv_multipart()
        asked.append(int.from_bytes(start, "big"))
        for seq, payload in batches:
            if seq >= asked[-1]:
                head = [TOPIC] if with_topic else []
                await router.send_multipart([client, empty, *head, seq.to_bytes(8, "big"), payload])
        await router.send_multipart([client, b"", *([b""] if with_topic else []), END_SEQ, b""])


@pytest.mark.parametrize("with_topic", [True, False], ids=["0.5.23-four-frames", "older-three-frames"])
async def test_subscriber_takes_replayed_real_batches_in_either_form(with_topic: bool) -> None:
    batches = captured_batches()
    assert [seq for seq, _ in batches] == list(range(20))
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    router = ctx.socket(zmq.ROUTER)
    asked: list[int] = []
    received: list[IngestBatch] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
        replay_port = router.bind_to_random_port("tcp://127.0.0.1")
        tasks.append(asyncio.create_task(serve_replay(router, batches, asked, with_topic)))
        source = ZmqEventSource(
            ReplicaId("sglang-0"),
            f"tcp://127.0.0.1:{pub_port}",
            ctx=ctx,
            decoder=SglangDecoder(block_size=16),
            metrics=Metrics.create(),
            topic=TOPIC,
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            settings=ZmqSourceSettings(replay_timeout_s=5.0),
        )
        tasks.append(asyncio.create_task(source.run(received.append)))
        async with asyncio.timeout(5):
            assert await pub.recv() == b"\x01" + TOPIC  # subscribed
        live = msgpack.packb([0.0, [{"type": "AllBlocksCleared"}], 0])
        await pub.send_multipart([TOPIC, (20).to_bytes(8, "big"), live])
        async with asyncio.timeout(10):
            while source.status().last_seq != 20:  # noqa: ASYNC110 - polling another task's state
                await asyncio.sleep(0.02)
        status = source.status()
        assert asked and asked[0] == 0
        assert status.replay_failures == 0 and status.resyncs == 0 and status.decode_errors == 0
        assert [b.seq for b in received] == list(range(21))  # every captured batch in order, then live
        stored = [e for b in received for e in b.events if isinstance(e, Stored)]
        assert len(stored) > 20 and not any(isinstance(e, Resync) for b in received for e in b.events)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pub.close(linger=0)
        router.close(linger=0)
        ctx.destroy(linger=0)
