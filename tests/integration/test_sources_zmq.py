"""ZmqEventSource against a real publisher on 127.0.0.1 (the rig is :mod:`zmq_rig`): ordering, gaps
filled by replay, resyncs, and restarts of the engine (seq regression, a new process, a new epoch).
"""

from __future__ import annotations

import asyncio
import dataclasses

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


async def test_in_order_batches_arrive_in_order(ctx: zmq.asyncio.Context, publisher: Publisher) -> None:
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(30)
        await rig.settle(29)
        assert rig.index.pages() == list(range(1, 31))
        assert rig.index.resyncs() == []
        assert publisher.replay_requests == [0]  # the catch-up of the new connection; no gap replay
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
        await asyncio.wait_for(publisher.replay_served.wait(), 5)  # the connection's catch-up: empty
        await publisher.pages(25, drop=lambda seq: seq in dropped)
        await rig.settle(24)
        assert rig.index.pages() == list(range(1, 26))  # every page, in order, exactly once
        assert rig.index.resyncs() == []
        # A replay returns the whole buffer tail, so a later gap may already be covered by it.
        catch_up, *requests = publisher.replay_requests
        assert catch_up == 0
        assert requests[0] == 3 and set(requests) <= {3, 11, 19}
        assert rig.metric("kvlb_events_seq_gaps_total", {"replica": REPLICA}) == len(requests)
        assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "filled"}) == len(
            requests
        )
        assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "empty"}) == 1
        status = rig.source.status()
        assert (status.gaps, status.replays, status.replay_failures) == (len(requests), len(requests) + 1, 0)


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
        assert publisher.replay_requests == [0, 0]  # the connection's catch-up, then the restart's


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


async def test_a_message_over_max_message_bytes_is_refused_and_resynced(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    """``ZMQ_MAXMSGSIZE``: a batch larger than ``max_message_bytes`` never reaches kvlb's memory; ZMQ
    drops the publisher's connection instead, which resyncs the rank; the stream then goes on."""
    settings = dataclasses.replace(FAST, max_message_bytes=4096)
    # Every subscription reaches the test, a duplicate too: the fresh socket may subscribe before the
    # XPUB has dropped the old connection, and a plain XPUB passes up only a topic's first subscriber.
    publisher.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=settings) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(3)
        await rig.settle(2)
        huge = dict(page(publisher.seq), token_ids=[1000 + i for i in range(4 * 1024)])
        await publisher.publish([huge])  # seq 3: about 12 kB
        await eventually(lambda: (0, "disconnect") in rig.index.resyncs())
        async with asyncio.timeout(5):  # the XPUB sees the unsubscribe, then the fresh socket's
            while await publisher.pub.recv() != b"\x01" + TOPIC:
                pass
        await publisher.pages(3)  # seqs 4-6
        await rig.settle(6)
        assert 4 not in rig.index.pages()  # the huge batch (page hash 4) was never applied
        assert rig.index.pages()[-3:] == [5, 6, 7]
