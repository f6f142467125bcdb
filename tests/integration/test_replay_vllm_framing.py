"""Replay from a vLLM 0.32 publisher: its replies carry the topic (found against a real engine).

vLLM's ``ZmqEventPublisher._service_replay`` answers ``[b"", start_seq8]`` with one
``[b"", topic, seq8, payload]`` per buffered batch and ends with ``[b"", b"", seq -1, b""]``; SGLang
sends ``[b"", seq8, payload]`` and ``[b"", seq -1, b""]``. The payloads served here are the real
frames captured from vLLM 0.32.0 on CPU (``tests/golden/real/vllm-0.32.0-cpu``), seq 0..11; the live
stream then sends seq 12, so a subscriber that joined late must replay 0..11 to catch up.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import zmq
import zmq.asyncio

from balancer.engines.sglang import SglangDecoder
from balancer.events import Resync, Stored
from balancer.metrics import Metrics
from balancer.sources.base import IngestBatch
from balancer.sources.zmq_settings import ZmqSourceSettings
from balancer.sources.zmq_sub import ZmqEventSource
from balancer.types import ReplicaId

CAPTURES = Path(__file__).resolve().parents[1] / "golden" / "real" / "vllm-0.32.0-cpu"
TOPIC = b"kv-events"
END = b"\xff" * 8


def captured_batches() -> list[tuple[int, bytes]]:
    """(seq, payload) of the consecutive captured frames 001..012 (seq 0..11)."""
    batches = []
    for number in range(1, 13):
        lines = (CAPTURES / f"vllm2-frame{number:03d}.hex").read_text().split()
        batches.append((int(lines[1], 16), bytes.fromhex(lines[2])))
    return batches


async def serve_vllm_replay(
    router: zmq.asyncio.Socket, batches: list[tuple[int, bytes]], asked: list[int]
) -> None:
    while True:
        client, empty, start = await router.recv_multipart()
        asked.append(int.from_bytes(start, "big"))
        for seq, payload in batches:
            if seq >= asked[-1]:
                await router.send_multipart([client, empty, TOPIC, seq.to_bytes(8, "big"), payload])
        await router.send_multipart([client, b"", b"", END, b""])


async def test_late_subscriber_replays_a_vllm_buffer() -> None:
    batches = captured_batches()
    assert [seq for seq, _ in batches] == list(range(12))
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    router = ctx.socket(zmq.ROUTER)
    asked: list[int] = []
    received: list[IngestBatch] = []
    source_task = server = None
    try:
        pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
        replay_port = router.bind_to_random_port("tcp://127.0.0.1")
        server = asyncio.create_task(serve_vllm_replay(router, batches, asked))
        source = ZmqEventSource(
            ReplicaId("vllm-0"),
            f"tcp://127.0.0.1:{pub_port}",
            ctx=ctx,
            decoder=SglangDecoder(block_size=128),
            metrics=Metrics.create(),
            topic=TOPIC,
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            settings=ZmqSourceSettings(replay_timeout_s=5.0, replay_poll_min_s=60.0, replay_poll_max_s=60.0),
        )
        source_task = asyncio.create_task(source.run(received.append))
        async with asyncio.timeout(5):
            assert await pub.recv() == b"\x01" + TOPIC  # subscribed
        live = msgpack.packb([0.0, [{"type": "AllBlocksCleared"}], 0])
        await pub.send_multipart([TOPIC, (12).to_bytes(8, "big"), live])
        async with asyncio.timeout(10):
            while source.status().last_seq != 12:  # noqa: ASYNC110 - polling another task's state
                await asyncio.sleep(0.02)
        status = source.status()
        assert asked == [0]
        assert status.replays == 1 and status.replay_failures == 0
        assert status.resyncs == 0 and status.decode_errors == 0
        assert [b.seq for b in received] == list(range(13))  # every captured batch, in order, then live
        stored = [e for b in received for e in b.events if isinstance(e, Stored)]
        assert stored and not any(isinstance(e, Resync) for b in received for e in b.events)
    finally:
        tasks = [t for t in (source_task, server) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pub.close(linger=0)
        router.close(linger=0)
        ctx.destroy(linger=0)
