"""The rig of the ZMQ source tests (test_sources_zmq*.py): a real publisher on 127.0.0.1 and a
real EventIngest feeding a recording index.

The publisher is written for the tests from the wire facts (docs/reference/engine-events.md §1): an
XPUB (a PUB that also tells us when the subscriber has joined) sending ``[topic, seq8,
msgpack([ts, events, rank])]`` and a ROUTER replay server answering ``[b"", seq8]`` with
``[b"", seq8, payload]`` frames and the END marker. Events are SGLang 0.5.23 tagged maps. The source
decodes with the real ``SglangDecoder``; the sink records what ``index.apply`` received.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import msgpack
import pytest
import zmq
import zmq.asyncio
from recording_index import RecordingIndex
from waiting import eventually

from balancer.engines.sglang import SglangDecoder
from balancer.metrics import Metrics
from balancer.sources.pipeline import EventIngest
from balancer.sources.zmq_settings import ZmqSourceSettings
from balancer.sources.zmq_sub import ZmqEventSource
from balancer.types import ReplicaId

REPLICA = ReplicaId("sgl-0")
TOPIC = b"kv-events"
BLOCK = 4
END = (-1).to_bytes(8, "big", signed=True)
FAST = ZmqSourceSettings(
    replay_timeout_s=1.0,
    reconnect_initial_s=0.01,
    reconnect_max_s=0.1,
    replay_poll_min_s=60.0,  # no poll of a silent stream: these tests count the replay requests
    replay_poll_max_s=60.0,
)
POLLING = dataclasses.replace(FAST, replay_poll_min_s=0.05, replay_poll_max_s=0.2)
"""Polls a silent stream's replay socket (tests/integration/test_sources_zmq_poll.py)."""


def page(seq: int) -> dict[str, object]:
    """SGLang 0.5.23 ``BlockStored`` map for one page; its hash is ``seq + 1``, chained to ``seq``."""
    return {
        "type": "BlockStored",
        "block_hashes": [seq + 1],
        "parent_block_hash": seq if seq else None,
        "token_ids": [seq * BLOCK + i for i in range(BLOCK)],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
    }


class Publisher:
    """An SGLang-style publisher of one DP rank: XPUB live stream + ROUTER replay ring buffer."""

    def __init__(
        self, ctx: zmq.asyncio.Context, *, buffer_steps: int = 1000, port: int = 0, replay_port: int = 0
    ) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if port:
            self.pub.bind(f"tcp://127.0.0.1:{port}")
            self.port = port
        else:
            self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if replay_port:
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self.replay_port = replay_port
        else:
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.topic = TOPIC
        self.replay_requests: list[int] = []
        self.replay_peers: list[bytes] = []
        """The ROUTER identity of each replay request's connection, in order."""
        self.replay_served = asyncio.Event()
        """Set once a replay request has been answered in full (END sent)."""
        self.extra_frames: dict[int, list[bytes]] = {}
        """Frames the replay socket sends after a seq's payload (none sends any: a broken publisher)."""
        self.replay_gate: asyncio.Event | None = None
        """When set to an event, each replay request is answered only once it is set (from the buffer
        as it is then): a slow replay socket, while live messages queue on the subscriber."""
        self._server = asyncio.create_task(self._serve_replay())

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    async def wait_subscribed(self, timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            message = await self.pub.recv()
        assert message == b"\x01" + TOPIC

    async def publish(self, events: list[object], *, drop: bool = False) -> int:
        """Publish one batch (``drop``: only into the replay buffer, as a PUB HWM drop would)."""
        seq = self.seq
        self.seq += 1
        payload = msgpack.packb([time.time(), events, 0])
        self.buffer.append((seq, payload))
        if not drop:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def pages(self, count: int, *, drop: Callable[[int], bool] = lambda seq: False) -> None:
        for _ in range(count):
            await self.publish([page(self.seq)], drop=drop(self.seq))

    def restart(self) -> None:
        """The engine restarted: seq from 0 and an empty replay buffer."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        while True:
            identity, empty, start = await self.router.recv_multipart()
            assert empty == b""
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            self.replay_peers.append(identity)
            if self.replay_gate is not None:
                await self.replay_gate.wait()
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    extra = self.extra_frames.get(seq, [])
                    await self.router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload, *extra])
            await self.router.send_multipart([identity, b"", END, b""])
            self.replay_served.set()

    async def aclose(self) -> None:
        self._server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._server
        self.pub.close(0)
        self.router.close(0)


@pytest.fixture(name="ctx")
async def ctx_fixture() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(name="publisher")
async def publisher_fixture(ctx: zmq.asyncio.Context) -> AsyncIterator[Publisher]:
    pub = Publisher(ctx)
    yield pub
    await pub.aclose()


class Rig:
    def __init__(
        self, source: ZmqEventSource, index: RecordingIndex, metrics: Metrics, ingest: EventIngest
    ) -> None:
        self.source = source
        self.index = index
        self.metrics = metrics
        self.ingest = ingest

    async def settle(self, last_seq: int, timeout_s: float = 5.0) -> None:
        """Wait until the source took ``last_seq`` and the applier emptied the queue."""

        def done() -> bool:
            queued = self.ingest.status()[REPLICA].queued_batches
            return self.source.status().last_seq == last_seq and queued == 0

        await eventually(done, timeout_s=timeout_s)

    def metric(self, name: str, labels: dict[str, str]) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def running(
    ctx: zmq.asyncio.Context, endpoint: str, replay: str | None, **kwargs: object
) -> AsyncIterator[Rig]:
    """A real EventIngest with one ZMQ source feeding a RecordingIndex."""
    metrics = Metrics.create()
    index = RecordingIndex(REPLICA)
    kwargs.setdefault("settings", FAST)
    source = ZmqEventSource(
        REPLICA,
        endpoint,
        ctx=ctx,
        decoder=SglangDecoder(block_size=BLOCK),
        metrics=metrics,
        topic=TOPIC,
        replay_endpoint=replay,
        **kwargs,  # type: ignore[arg-type]
    )
    ingest = EventIngest(index, metrics=metrics)  # type: ignore[arg-type]
    ingest.add_replica(REPLICA, "sglang", [source])
    await ingest.start()
    try:
        yield Rig(source, index, metrics, ingest)
    finally:
        await ingest.aclose()
