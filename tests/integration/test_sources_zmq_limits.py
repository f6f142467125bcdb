"""Byte limits of the ZMQ source (issue #17 defect 8): a message over ``ZMQ_MAXMSGSIZE``
(``limits.event_message_bytes``) is refused by libzmq, which drops the connection and does not
reconnect by itself; the source counts the disconnect, resyncs the rank, reopens its SUB, and the
next normal message is applied. The replay DEALER has the same limit. Real sockets on 127.0.0.1
(the rig is :mod:`zmq_rig`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import zmq
import zmq.asyncio
from zmq_rig import (  # noqa: F401  (pytest fixtures)
    FAST,
    REPLICA,
    TOPIC,
    Publisher,
    ctx_fixture,
    eventually,
    page,
    publisher_fixture,
    running,
)

from balancer.sources.read_ahead import ReadAhead

LIMIT = 4096
SMALL = dataclasses.replace(FAST, max_message_bytes=LIMIT, replay_timeout_s=3.0)
"""The oversize replay reply ends its replay only at this timeout; the catch-up's answer, which must
not time out under load (it would count as a second ``failed`` replay), is given 3 s rather than 1."""
PATIENT = dataclasses.replace(FAST, replay_timeout_s=30.0)
"""For replays that end on their answer (a reply of too many frames, an empty catch-up): a busy
machine must not end them at the timeout first (FAST's 1 s was missed at load 14)."""
WAIT_S = 30.0
"""Waits that end on their condition: long enough for a loaded machine."""


async def resubscribed(publisher: Publisher, timeout_s: float = WAIT_S) -> None:
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
        await publisher.wait_subscribed(WAIT_S)
        await publisher.pages(3)
        await rig.settle(2, timeout_s=WAIT_S)
        # 64 kB in one frame, live only (never in the replay buffer), with the next seq.
        oversize = [TOPIC, publisher.seq.to_bytes(8, "big"), b"\x00" * (16 * LIMIT)]
        await publisher.pub.send_multipart(oversize)
        await eventually(lambda: rig.index.resyncs() == [(0, "disconnect")], timeout_s=WAIT_S)
        await resubscribed(publisher)
        await publisher.pages(2)
        await rig.settle(4, timeout_s=WAIT_S)
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
        await publisher.wait_subscribed(WAIT_S)
        await publisher.pages(2)
        await rig.settle(1, timeout_s=WAIT_S)
        publisher.buffer.append((publisher.seq, b"\x00" * (16 * LIMIT)))  # lost live, oversize in replay
        publisher.seq += 1
        await publisher.pages(1)
        await rig.settle(3, timeout_s=WAIT_S)
        assert rig.index.timeline() == [1, 2, "gap", 4]
        assert publisher.replay_requests == [0, 2]  # the connection's catch-up, then the gap's
        assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "failed"}) == 1


MANY_FRAMES = 100_000
"""Empty frames after a message's three: each within ``MAXMSGSIZE`` and the read-ahead's bytes, so
only a bound on frames stops them (read whole they cost this thread about a second of CPU)."""


async def test_a_message_of_many_frames_is_read_no_further_shed_and_its_sub_dropped(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    """ZMQ bounds a frame and the pipe's messages, not a message's frames: a live message of
    100,003 empty frames was read whole (a Python object each) before the decoder refused it. Now
    the source reads at most ``MAX_MESSAGE_FRAMES`` of it, sheds it (its seq taken in order, one
    resync), counts it as a shed run of cause ``frames`` and drops the SUB with the rest of it; the
    next messages are taken in order after the reopen, with no replay of the refused seq."""
    publisher.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=PATIENT) as rig:
        await publisher.wait_subscribed(WAIT_S)
        await publisher.pages(3)
        await rig.settle(2, timeout_s=WAIT_S)
        seq = publisher.seq
        publisher.buffer.append((seq, b"\x00"))  # the replay would have it, unused: no replay asked
        publisher.seq += 1
        many = [TOPIC, seq.to_bytes(8, "big"), b"\x00", *([b""] * MANY_FRAMES)]
        await publisher.pub.send_multipart(many)
        await eventually(lambda: rig.index.resyncs() == [(0, "overflow")], timeout_s=WAIT_S)
        await resubscribed(publisher)
        await publisher.pages(2)
        await rig.settle(5, timeout_s=WAIT_S)
        assert rig.index.timeline() == [1, 2, 3, "overflow", 5, 6]
        labels = {"replica": REPLICA}
        assert rig.metric("kvlb_events_shed_total", labels) == 1
        assert rig.metric("kvlb_events_shed_runs_total", {**labels, "cause": "frames"}) == 1
        frame_errors = {**labels, "engine": "sglang", "reason": "frame"}
        assert rig.metric("kvlb_events_decode_errors_total", frame_errors) == 0
        assert rig.metric("kvlb_events_seq_gaps_total", labels) == 0
        assert publisher.replay_requests == [0]  # the connection's catch-up only


async def test_a_replay_reply_of_many_frames_ends_the_replay_and_the_gap_resyncs(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    """The replay DEALER reads a reply frame by frame too: one of more than ``MAX_MESSAGE_FRAMES``
    is refused as a ``frame`` decode error after those frames, the replay ends unclean (its DEALER
    closed with the rest), what it could not fill resyncs and the live stream goes on."""
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=PATIENT) as rig:
        await publisher.wait_subscribed(WAIT_S)
        await publisher.pages(2)
        await rig.settle(1, timeout_s=WAIT_S)
        lost = await publisher.publish([page(publisher.seq)], drop=True)  # lost live
        publisher.extra_frames[lost] = [b""] * MANY_FRAMES
        await publisher.pages(1)
        await rig.settle(3, timeout_s=WAIT_S)
        assert rig.index.timeline() == [1, 2, "gap", 4]
        assert publisher.replay_requests == [0, 2]  # the connection's catch-up, then the gap's
        frame_errors = {"replica": REPLICA, "engine": "sglang", "reason": "frame"}
        assert rig.metric("kvlb_events_decode_errors_total", frame_errors) == 1
        assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "failed"}) == 1


def test_the_read_ahead_counts_what_a_frame_holds_besides_its_bytes() -> None:
    """``max_backlog_bytes`` bounds the read-ahead's memory: messages of few bytes hold more than
    their bytes (a ``zmq.Frame`` each, about 200 B). 200 messages of 8 bytes (1.6 kB of bytes,
    120 kB held) queued past an 8 KiB bound are a flood: the next one is shed for ``backlog``. The
    bytes alone never reached the bound, and the read-ahead read the whole queue into Python."""
    settings = dataclasses.replace(FAST, max_message_bytes=4096, max_backlog_bytes=8192)
    sync = zmq.Context()
    pub, sub = sync.socket(zmq.PUB), sync.socket(zmq.SUB)
    try:
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        ahead = ReadAhead(settings)
        ahead.reader = sub
        deadline = time.monotonic() + 5.0
        while not zmq.select([sub], [], [], 0.05)[0]:  # until the subscription is in force
            assert time.monotonic() < deadline, "no subscription"
            pub.send_multipart([b"", (0).to_bytes(8, "big"), b""])
        while ahead.read(None) is not None:  # the probes
            pass
        for seq in range(1, 201):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), b""])
        time.sleep(0.3)  # all 200 arrive (a few kB on the loopback)
        read = ahead.read(None)
        assert read is not None and read[1] and ahead.shed_cause == "backlog"
    finally:
        pub.close(linger=0)
        sub.close(linger=0)
        sync.term()
