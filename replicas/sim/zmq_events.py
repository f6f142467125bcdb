"""The ZMQ KV-event publisher of one DP rank, shared by the SGLang and vLLM personalities (I/O shell).

Both engines publish the same way (docs/reference/engine-events.md §1): a PUB socket on ``event_port +
rank`` sending ``[topic, seq8, msgpack([ts, events, rank])]``, one batch per scheduler step that changed
the cache, and a ROUTER replay socket on ``replay_port + rank`` keeping the last ``buffer_steps``
batches. A DEALER that sends ``[b"", start_seq8]`` gets ``[b"", topic, seq8, payload]`` per kept batch
with ``seq >= start``, then ``[b"", b"", ff×8, b""]`` (SGLang 0.5.23's and vLLM 0.32's 4-frame
answer). A batch's seq is consumed, and the batch kept for replay, even when a fault drops its send.

What differs per engine is how cache records become events and what is published at start-up: each
personality subclasses :class:`ZmqRankPublisher` (:meth:`~ZmqRankPublisher.encode`,
:meth:`~ZmqRankPublisher.startup_events`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any, ClassVar

import zmq
import zmq.asyncio

from replicas.sim.cache import CacheRecord
from replicas.sim.config import ReplicaConfig
from replicas.sim.faults import FaultState
from replicas.sim.scheduler import StepResult
from replicas.wire.sglang import REPLAY_END, KvEventEncoder, frames, parse_replay_request, replay_reply

log = logging.getLogger(__name__)


class ZmqRankPublisher:
    """PUB + replay ROUTER + the page-hash map of one DP rank; subclasses encode the records."""

    def __init__(
        self,
        zctx: zmq.asyncio.Context,
        config: ReplicaConfig,
        rank: int,
        faults: FaultState,
        encoder: KvEventEncoder,
    ) -> None:
        self.rank = rank
        self.config = config
        self._faults = faults
        self._encoder = encoder
        self.pub_endpoint = f"tcp://{config.host}:{config.event_port + rank}"
        self.replay_endpoint = f"tcp://{config.host}:{config.replay_port + rank}"
        self._pub = zctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = zctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        # A sync view of the PUB socket: a PUB send never blocks (it drops at the HWM).
        self._send: zmq.Socket[bytes] = zmq.Socket.shadow(self._pub.underlying)
        # page id -> (event hash, digest); bounded by the pool
        self._hashes: dict[int, tuple[int, bytes]] = {}
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.seq = 0
        self.epoch = uuid.uuid4().hex
        self._task: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------------------- engine specifics

    def startup_events(self) -> list[object]:
        """What the engine publishes as its first batch when it starts (nothing: no batch)."""
        return []

    def encode(self, records: Sequence[CacheRecord]) -> list[object]:
        """The events of one step's cache records."""
        raise NotImplementedError

    # --------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._pub.bind(self.pub_endpoint)
        self._replay.bind(self.replay_endpoint)
        name = f"{self.config.engine}-replay-{self.rank}"
        self._task = asyncio.create_task(self._serve_replay(), name=name)
        if events := self.startup_events():
            self.publish(events)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._pub.close(linger=0)
        self._replay.close(linger=0)

    def restart(self) -> None:
        """A new engine process: seq from 0, empty replay buffer, new epoch, the start-up batch."""
        self._hashes.clear()
        self.buffer.clear()
        self.seq = 0
        self.epoch = uuid.uuid4().hex
        if events := self.startup_events():
            self.publish(events)

    def on_records(self, records: Sequence[CacheRecord]) -> None:
        if events := self.encode(records):
            self.publish(events)

    def publish(self, events: list[object]) -> None:
        """One batch: its seq is consumed and it is kept for replay even when the fault drops it
        (unless ``replay_dropped`` is off)."""
        payload = self._encoder.batch(time.time(), events, self.rank)
        seq, self.seq = self.seq, self.seq + 1
        lost = self._faults.drop_batch()
        if not lost or self._faults.settings.replay_dropped:
            self.buffer.append((seq, payload))
        if lost:
            return
        epoch = self.epoch if self.config.epoch_in_topic else None
        try:
            self._send.send_multipart(frames(self.config.topic, seq, payload, epoch=epoch), flags=zmq.NOBLOCK)
        except zmq.Again:  # PUB drops at the HWM rather than raising, but be safe
            log.debug("PUB send of seq %d would block; dropped", seq)

    async def _serve_replay(self) -> None:
        while True:
            request = await self._replay.recv_multipart()
            try:
                start = parse_replay_request(request)
            except ValueError as exc:
                log.debug("ignoring malformed replay request: %s", exc)
                continue
            identity = request[0]
            for seq, payload in list(self.buffer):
                if seq >= start:
                    reply = replay_reply(self.config.topic, seq, payload)
                    await self._replay.send_multipart([identity, *reply])
            await self._replay.send_multipart([identity, *REPLAY_END])


class ZmqPersonality:
    """The step observer of an engine that publishes over ZMQ: one publisher per DP rank. A subclass
    builds its publishers (:meth:`publisher`), names its flush endpoint and adds its HTTP routes."""

    flush_path: ClassVar[str]
    REFUSES_OTHER_MODELS: ClassVar[bool] = False
    """Whether the engine answers a request for a model it does not serve 404 (vLLM); SGLang serves
    any name."""

    def __init__(self, zctx: zmq.asyncio.Context, config: ReplicaConfig, faults: FaultState) -> None:
        self.config = config
        self.publishers = [self.publisher(zctx, config, rank, faults) for rank in range(config.dp_size)]

    def publisher(
        self, zctx: zmq.asyncio.Context, config: ReplicaConfig, rank: int, faults: FaultState
    ) -> ZmqRankPublisher:
        raise NotImplementedError

    def on_step(self, rank: int, result: StepResult | None, records: Sequence[CacheRecord]) -> None:
        self.publishers[rank].on_records(records)

    async def start(self) -> None:
        for publisher in self.publishers:
            publisher.start()

    async def close(self) -> None:
        for publisher in self.publishers:
            await publisher.close()

    def restart(self) -> None:
        for publisher in self.publishers:
            publisher.restart()

    def describe(self) -> dict[str, Any]:
        return {
            "events": [p.pub_endpoint for p in self.publishers],
            "replay": [p.replay_endpoint for p in self.publishers],
            "topic": self.config.topic,
            "flush": f"POST {self.flush_path}",
        }
