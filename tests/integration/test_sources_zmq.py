"""ZmqEventSource against a real publisher on 127.0.0.1: ordering, replay, resync, bad input.

The publisher here is written for the test from the wire facts (engine-events.md §1): an XPUB (a PUB
that also tells us when the subscriber has joined) sending ``[topic, seq8, msgpack([ts, events,
rank])]`` and a ROUTER replay server answering ``[b"", seq8]`` with ``[b"", seq8, payload]`` frames
and the END marker. Events are SGLang 0.5.23 tagged maps. The source decodes with the real
``SglangDecoder``; the sink records what ``index.apply`` received.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

import msgpack
import pytest
import zmq
import zmq.asyncio

from balancer.engines.sglang import SglangDecoder
from balancer.events import KvEvent, Resync, Stored
from balancer.index.base import ApplyResult, IndexStats
from balancer.metrics import Metrics
from balancer.sources.pipeline import EventIngest
from balancer.sources.zmq_sub import ZmqEventSource, ZmqSourceSettings, endpoint_for_rank
from balancer.types import ReplicaId

REPLICA = ReplicaId("sgl-0")
TOPIC = b"kv-events"
BLOCK = 4
END = (-1).to_bytes(8, "big", signed=True)
FAST = ZmqSourceSettings(replay_timeout_s=1.0, reconnect_initial_s=0.01, reconnect_max_s=0.1)


class RecordingIndex:
    """Test double of the sink: records every event ``apply`` receives, in order."""

    def __init__(self) -> None:
        self.events: list[KvEvent] = []

    async def apply(self, replica: ReplicaId, events: Sequence[KvEvent], now: float) -> ApplyResult:
        assert replica == REPLICA
        self.events.extend(events)
        stored = sum(e.block_count for e in events if isinstance(e, Stored))
        return ApplyResult(stored_blocks=stored, resyncs=sum(isinstance(e, Resync) for e in events))

    async def drop_replica(self, replica: ReplicaId) -> int:
        return 0

    async def stats(self) -> IndexStats:
        return IndexStats(0, 0)

    async def aclose(self) -> None:
        return None

    def pages(self) -> list[int]:
        """Engine hash of every stored page, in arrival order."""
        return [h for e in self.events if isinstance(e, Stored) for h in e.engine_hashes]

    def resyncs(self) -> list[tuple[int, str]]:
        return [(e.dp_rank, e.reason) for e in self.events if isinstance(e, Resync)]

    def timeline(self) -> list[object]:
        """Pages and resyncs interleaved as they arrived."""
        return [
            e.engine_hashes[0] if isinstance(e, Stored) else e.reason
            for e in self.events
            if isinstance(e, Stored | Resync)
        ]


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
        self.replay_served = asyncio.Event()
        """Set once a replay request has been answered in full (END sent)."""
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
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    await self.router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([identity, b"", END, b""])
            self.replay_served.set()

    async def aclose(self) -> None:
        self._server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._server
        self.pub.close(0)
        self.router.close(0)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
async def publisher(ctx: zmq.asyncio.Context) -> AsyncIterator[Publisher]:
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

    async def settle(self, last_seq: int) -> None:
        """Wait until the source took ``last_seq`` and the applier emptied the queue."""

        def done() -> bool:
            queued = self.ingest.status()[REPLICA].queued_batches
            return self.source.status().last_seq == last_seq and queued == 0

        await eventually(done)

    def metric(self, name: str, labels: dict[str, str]) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def running(
    ctx: zmq.asyncio.Context, endpoint: str, replay: str | None, **kwargs: object
) -> AsyncIterator[Rig]:
    """A real EventIngest with one ZMQ source feeding a RecordingIndex."""
    metrics = Metrics.create()
    index = RecordingIndex()
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


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_in_order_batches_arrive_in_order(ctx: zmq.asyncio.Context, publisher: Publisher) -> None:
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(30)
        await rig.settle(29)
        assert rig.index.pages() == list(range(1, 31))
        assert rig.index.resyncs() == []
        assert publisher.replay_requests == []
        assert rig.source.status().last_seq == 29
        applied = rig.metric(
            "kvlb_events_applied_total", {"engine": "sglang", "type": "stored", "status": "applied"}
        )
        assert applied == 30
        assert (
            rig.metrics.registry.get_sample_value("kvlb_events_lag_seconds", {"replica": REPLICA}) is not None
        )


async def test_gaps_are_filled_by_replay_exactly_once(ctx: zmq.asyncio.Context, publisher: Publisher) -> None:
    dropped = {3, 4, 5, 11, 19}
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(25, drop=lambda seq: seq in dropped)
        await rig.settle(24)
        assert rig.index.pages() == list(range(1, 26))  # every page, in order, exactly once
        assert rig.index.resyncs() == []
        # A replay returns the whole buffer tail, so a later gap may already be covered by it.
        requests = publisher.replay_requests
        assert requests[0] == 3 and set(requests) <= {3, 11, 19}
        assert rig.metric("kvlb_events_seq_gaps_total", {"replica": REPLICA}) == len(requests)
        assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "filled"}) == len(
            requests
        )
        status = rig.source.status()
        assert (status.gaps, status.replays, status.replay_failures) == (len(requests), len(requests), 0)


async def test_gap_beyond_replay_buffer_resyncs(ctx: zmq.asyncio.Context) -> None:
    publisher = Publisher(ctx, buffer_steps=3)
    try:
        async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
            await publisher.wait_subscribed()
            await publisher.pages(11, drop=lambda seq: 3 <= seq <= 9)
            await rig.settle(10)
            # seqs 3..9 lost; the buffer (8, 9, 10) starts above the wanted 3: resync, then 8..10.
            assert rig.index.timeline() == [1, 2, 3, "gap", 9, 10, 11]
            assert rig.index.resyncs() == [(0, "gap")]
            assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "partial"}) == 1
            assert rig.metric("kvlb_events_resyncs_total", {"replica": REPLICA, "reason": "gap"}) == 1
    finally:
        await publisher.aclose()


async def test_gap_without_replay_endpoint_resyncs(ctx: zmq.asyncio.Context, publisher: Publisher) -> None:
    async with running(ctx, publisher.endpoint, None) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(6, drop=lambda seq: seq == 2)
        await rig.settle(5)
        assert rig.index.timeline() == [1, 2, "gap", 4, 5, 6]


async def test_seq_regression_means_restart(ctx: zmq.asyncio.Context, publisher: Publisher) -> None:
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(5)
        await rig.settle(4)
        publisher.restart()
        await publisher.pages(3)
        await rig.settle(2)
        assert rig.index.timeline() == [1, 2, 3, 4, 5, "restart", 1, 2, 3]
        assert rig.source.status().last_seq == 2
        assert rig.metric("kvlb_events_resyncs_total", {"replica": REPLICA, "reason": "restart"}) == 1


async def test_restart_missing_first_batches_replays_from_zero(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(5)
        await rig.settle(4)
        publisher.restart()
        await publisher.pages(3, drop=lambda seq: seq < 2)  # the SUB missed seq 0 and 1 of the new run
        await rig.settle(2)
        assert rig.index.timeline() == [1, 2, 3, 4, 5, "restart", 1, 2, 3]
        assert publisher.replay_requests == [0]


async def test_a_new_process_whose_seq_lands_above_the_old_one_is_a_restart(
    ctx: zmq.asyncio.Context,
) -> None:
    """The engine process dies and a new one starts on the same ports. The SUB misses the new
    process's first batches, so the first live seq it sees (6) is above the old last seq (4): by seq
    alone a gap, which replay would fill from the new process on top of the dead one's blocks. The
    dropped TCP connection says otherwise: the rank is resynced and replayed from 0."""
    old = Publisher(ctx)
    async with running(ctx, old.endpoint, old.replay_endpoint) as rig:
        await old.wait_subscribed()
        await old.pages(5)
        await rig.settle(4)
        await old.aclose()
        await eventually(lambda: rig.index.resyncs() == [(0, "disconnect")])
        new = Publisher(ctx, port=old.port, replay_port=old.replay_port)
        try:
            await new.wait_subscribed()
            await new.pages(8, drop=lambda seq: seq < 6)
            await rig.settle(7)
            assert rig.index.timeline() == [1, 2, 3, 4, 5, "disconnect", 1, 2, 3, 4, 5, 6, 7, 8]
            assert rig.metric("kvlb_events_resyncs_total", {"replica": REPLICA, "reason": "disconnect"}) == 1
            assert rig.metric("kvlb_events_resyncs_total", {"replica": REPLICA, "reason": "gap"}) == 0
        finally:
            await new.aclose()


async def test_late_join_replays_from_zero(ctx: zmq.asyncio.Context, publisher: Publisher) -> None:
    await publisher.pages(10)  # published before anyone subscribed: only the replay buffer has them
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(2)
        await rig.settle(11)
        assert rig.index.pages() == list(range(1, 13))
        assert rig.index.resyncs() == []
        assert publisher.replay_requests == [0]
        assert rig.source.status().duplicates <= 1  # seq 11 is a duplicate if replay already had it


async def test_late_join_beyond_buffer_and_resume_point(ctx: zmq.asyncio.Context) -> None:
    publisher = Publisher(ctx, buffer_steps=4)
    try:
        await publisher.pages(10)
        async with running(ctx, publisher.endpoint, publisher.replay_endpoint, resume_seq=3) as rig:
            await publisher.wait_subscribed()
            # The catch-up replay is answered first, while the buffer holds 7..10.
            await asyncio.wait_for(publisher.replay_served.wait(), 5)
            await publisher.pages(1)
            await rig.settle(10)
            assert publisher.replay_requests == [3]
            assert rig.index.timeline() == ["gap", 7, 8, 9, 10, 11]
    finally:
        await publisher.aclose()


async def test_engine_behind_the_resume_point_restarted(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, resume_seq=100) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(3)
        await rig.settle(2)
        assert rig.index.timeline() == ["restart", 1, 2, 3]
        assert publisher.replay_requests == [100]  # the catch-up at start found nothing that new


async def test_unreachable_replay_socket_times_out_and_resyncs(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    probe = ctx.socket(zmq.ROUTER)
    dead_port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(0)
    settings = ZmqSourceSettings(replay_timeout_s=0.2, reconnect_initial_s=0.01, reconnect_max_s=0.1)
    dead = f"tcp://127.0.0.1:{dead_port}"
    async with running(ctx, publisher.endpoint, dead, settings=settings) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(5, drop=lambda seq: seq == 2)
        await rig.settle(4)
        assert rig.index.timeline() == [1, 2, "gap", 4, 5]
        assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "failed"}) == 1
        assert rig.source.status().replay_failures == 1


async def test_late_join_without_replay_resyncs_then_goes_live(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    await publisher.pages(4)
    async with running(ctx, publisher.endpoint, None) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(2)
        await rig.settle(5)
        assert rig.index.timeline() == ["gap", 5, 6]


async def test_epoch_change_resyncs(ctx: zmq.asyncio.Context, publisher: Publisher) -> None:
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        await publisher.wait_subscribed()
        publisher.topic = TOPIC + b"\x00sgl-kv-epoch=aaaa"
        await publisher.pages(3)
        await rig.settle(2)
        publisher.topic = TOPIC + b"\x00sgl-kv-epoch=bbbb"
        publisher.restart()
        await publisher.pages(2)
        await rig.settle(1)
        assert rig.index.timeline() == [1, 2, 3, "epoch", 1, 2]  # one resync, not epoch + restart
        assert rig.source.status().epoch == "bbbb"


async def test_malformed_messages_are_counted_and_skipped(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(2)
        seq8 = publisher.seq.to_bytes(8, "big")
        await publisher.pub.send_multipart([TOPIC, seq8, b"\xc1 not msgpack"])
        await publisher.pub.send_multipart([TOPIC, b"\x00\x01", msgpack.packb([1.0, [], 0])])
        await publisher.pub.send_multipart([TOPIC, b"lonely"])
        await publisher.pub.send_multipart([TOPIC, seq8, msgpack.packb({"no": "envelope"})])
        bad_event = {"type": "BlockStored", "block_hashes": "nope"}
        await publisher.publish([bad_event, page(publisher.seq)])  # one bad event, one good
        await publisher.pages(2)
        await rig.settle(4)
        assert rig.index.pages() == [1, 2, 3, 4, 5]
        assert rig.index.resyncs() == []
        errors = {
            reason: rig.metric("kvlb_events_decode_errors_total", {"engine": "sglang", "reason": reason})
            for reason in ("msgpack", "frame", "schema", "event")
        }
        assert errors == {"msgpack": 1, "frame": 2, "schema": 1, "event": 1}
        assert rig.source.status().decode_errors == 5


async def test_engine_started_after_the_balancer(ctx: zmq.asyncio.Context) -> None:
    probe = ctx.socket(zmq.PUB)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(0)
    await asyncio.sleep(0.05)
    async with running(ctx, f"tcp://127.0.0.1:{port}", None) as rig:
        await asyncio.sleep(0.2)  # the SUB retries a port where nothing listens yet
        publisher = Publisher(ctx, port=port)
        try:
            await publisher.wait_subscribed()
            await publisher.pages(3)
            await rig.settle(2)
            assert rig.index.timeline() == [1, 2, 3]
        finally:
            await publisher.aclose()


def test_endpoint_for_rank() -> None:
    assert endpoint_for_rank("tcp://10.0.0.5:5557", 0) == "tcp://10.0.0.5:5557"
    assert endpoint_for_rank("tcp://10.0.0.5:5557", 3) == "tcp://10.0.0.5:5560"
    assert endpoint_for_rank("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert endpoint_for_rank("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"


async def test_end_to_end_into_memory_index(ctx: zmq.asyncio.Context, publisher: Publisher) -> None:
    """Wire → real decoder → pipeline → real MemoryIndex → a request prefix matches the replica."""
    memory = pytest.importorskip("balancer.index.memory")
    from balancer.hashing import BlockHasher

    hasher = BlockHasher(model="m", block_size=BLOCK)
    index = memory.MemoryIndex(hasher)
    metrics = Metrics.create()
    source = ZmqEventSource(
        REPLICA,
        publisher.endpoint,
        ctx=ctx,
        decoder=SglangDecoder(block_size=BLOCK),
        metrics=metrics,
        topic=TOPIC,
        replay_endpoint=publisher.replay_endpoint,
        settings=FAST,
    )
    ingest = EventIngest(index, metrics=metrics)
    ingest.add_replica(REPLICA, "sglang", [source])
    await ingest.start()
    try:
        await publisher.wait_subscribed()
        await publisher.pages(6, drop=lambda seq: seq == 2)  # a gap the replay fills
        await eventually(lambda: ingest.status()[REPLICA].applied_batches >= 6)
        tokens = list(range(6 * BLOCK + 3))  # the pages' tokens plus a partial tail
        overlap = await index.match(hasher.request_keys(tokens), None, time.monotonic())
        assert overlap.of(REPLICA) == 6
        stats = await index.stats()
        assert stats.blocks_by_replica.get(REPLICA) == 6
    finally:
        await ingest.aclose()


async def test_resume_catches_up_from_a_quiet_publisher(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    # A new ingester resumes at seq 4 of a replica that publishes nothing more: the batches it
    # missed still arrive, asked for at once rather than at the next live message.
    await publisher.pages(8)
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, resume_seq=4) as rig:
        await rig.settle(7)
        assert rig.index.pages() == [5, 6, 7, 8]
        assert rig.index.resyncs() == []
        assert publisher.replay_requests == [4]


async def test_an_engine_restarted_after_a_catch_up_is_not_taken_for_duplicates(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    await publisher.pages(6)
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, resume_seq=2) as rig:
        await rig.settle(5)  # caught up 2..5 from the replay socket, no live message yet
        publisher.restart()
        await publisher.wait_subscribed()
        await publisher.pages(2)  # seq 0 and 1 of the new process
        await rig.settle(1)
        assert rig.index.timeline() == [3, 4, 5, 6, "restart", 1, 2]
