"""Byte limits of the ZMQ source (issue #17 defect 8): a message over ``ZMQ_MAXMSGSIZE``
(``limits.event_message_bytes``) is refused by libzmq, which drops the connection and does not
reconnect by itself; the source counts the disconnect, resyncs the rank, reopens its SUB, and the
next normal message is applied. The replay DEALER has the same limit. Real sockets on 127.0.0.1
(the rig is :mod:`zmq_rig`)."""

from __future__ import annotations

import asyncio
import dataclasses

import zmq
import zmq.asyncio
from zmq_rig import (  # noqa: F401  (pytest fixtures)
    FAST,
    REPLICA,
    TOPIC,
    Publisher,
    ctx_fixture,
    eventually,
    publisher_fixture,
    running,
)

LIMIT = 4096
SMALL = dataclasses.replace(FAST, max_message_bytes=LIMIT)


async def resubscribed(publisher: Publisher, timeout_s: float = 5.0) -> None:
    """Wait for the source's new SUB to subscribe. The publisher must be verbose
    (``XPUB_VERBOSE``): the new socket may subscribe before the XPUB has dropped the old connection,
    and a plain XPUB passes up only a topic's first subscriber."""
    async with asyncio.timeout(timeout_s):
        while await publisher.pub.recv() != b"\x01" + TOPIC:
            pass


async def test_an_oversize_message_is_refused_counted_resynced_and_the_next_one_applied(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    publisher.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=SMALL) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(3)
        await rig.settle(2)
        # 64 kB in one frame, live only (never in the replay buffer), with the next seq.
        oversize = [TOPIC, publisher.seq.to_bytes(8, "big"), b"\x00" * (16 * LIMIT)]
        await publisher.pub.send_multipart(oversize)
        await eventually(lambda: rig.index.resyncs() == [(0, "disconnect")])
        await resubscribed(publisher)
        await publisher.pages(2)
        await rig.settle(4)
        assert rig.index.timeline() == [1, 2, 3, "disconnect", 1, 2, 3, 4, 5]
        assert rig.metric("kvlb_events_disconnects_total", {"replica": REPLICA}) == 1
        assert rig.metric("kvlb_events_resyncs_total", {"replica": REPLICA, "reason": "disconnect"}) == 1
        assert (
            rig.metric(
                "kvlb_events_decode_errors_total", {"replica": REPLICA, "engine": "sglang", "reason": "frame"}
            )
            == 0
        )
        assert publisher.replay_requests == [0, 0]  # the catch-up of each connection


async def test_an_oversize_replay_reply_ends_the_replay_and_the_gap_resyncs(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    """The DEALER has the same limit: an oversize replayed batch ends that replay within its
    timeout; what it could not fill resyncs and the live stream goes on."""
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=SMALL) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(2)
        await rig.settle(1)
        publisher.buffer.append((publisher.seq, b"\x00" * (16 * LIMIT)))  # lost live, oversize in replay
        publisher.seq += 1
        await publisher.pages(1)
        await rig.settle(3)
        assert rig.index.timeline() == [1, 2, "gap", 4]
        assert publisher.replay_requests == [0, 2]  # the connection's catch-up, then the gap's
        assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "failed"}) == 1
