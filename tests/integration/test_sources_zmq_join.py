"""ZmqEventSource against a real publisher on 127.0.0.1 (the rig is :mod:`zmq_rig`): joining late
(replay from 0 or from a resume point), unreachable replay sockets, epochs, malformed messages, an
engine started after the balancer, and the path into a real in-memory index.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgpack
import pytest
import zmq
import zmq.asyncio
from zmq_rig import (  # noqa: F401  (pytest fixtures)
    BLOCK,
    END,
    FAST,
    REPLICA,
    TOPIC,
    Publisher,
    RecordingIndex,
    Rig,
    ctx_fixture,
    eventually,
    page,
    publisher_fixture,
    running,
)

from balancer.engines.sglang import SglangDecoder
from balancer.metrics import Metrics
from balancer.sources.pipeline import EventIngest
from balancer.sources.zmq_settings import endpoint_for_rank
from balancer.sources.zmq_sub import ZmqEventSource


async def test_late_join_replays_from_zero(ctx: zmq.asyncio.Context, publisher: Publisher) -> None:
    await publisher.pages(10)  # published before anyone subscribed: only the replay buffer has them
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(2)
        await rig.settle(11)
        assert rig.index.pages() == list(range(1, 13))
        assert rig.index.resyncs() == []
        assert publisher.replay_requests == [0]
        # The catch-up is asked at connect; seq 10 and 11 are duplicates if its answer already had them.
        assert rig.source.status().duplicates <= 2


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
    settings = dataclasses.replace(FAST, replay_timeout_s=0.2)
    dead = f"tcp://127.0.0.1:{dead_port}"
    async with running(ctx, publisher.endpoint, dead, settings=settings) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(5, drop=lambda seq: seq == 2)
        await rig.settle(4)
        assert rig.index.timeline() == [1, 2, "gap", 4, 5]
        # The connection's catch-up and the gap's replay both time out.
        assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "failed"}) == 2
        assert rig.source.status().replay_failures == 2


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
        # The connection's catch-up replay may deliver every page before the live copies queued on
        # the SUB (the malformed ones among them) are read: wait for the live stream to be drained.
        await eventually(lambda: rig.source.status().decode_errors >= 5)
        assert rig.index.pages() == [1, 2, 3, 4, 5]
        assert rig.index.resyncs() == []
        errors = {
            reason: rig.metric(
                "kvlb_events_decode_errors_total", {"replica": REPLICA, "engine": "sglang", "reason": reason}
            )
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
    from balancer.index.hashing import BlockHasher

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
