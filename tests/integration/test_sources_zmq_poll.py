"""A silent live stream: the ZMQ source polls the replay socket (the rig is :mod:`zmq_rig`).

The publisher goes on publishing while every live message is lost (a PUB high-water mark, a stalled
connection), and its replay buffer is short: waiting for the next live message to show the gap
would find the buffer long past the lost batches (a resync). Polling the replay socket while the
stream is silent takes every batch in order instead, also when the engine publishes in bursts with
quiet spells between them, and an idle publisher costs polls that back off."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import zmq.asyncio
from zmq_rig import (  # noqa: F401  (pytest fixtures)
    POLLING,
    REPLICA,
    Publisher,
    ctx_fixture,
    eventually,
    page,
    running,
)

from balancer.errors import ConfigError


async def test_batches_lost_live_are_read_from_a_short_replay_buffer_while_the_stream_is_silent(
    ctx: zmq.asyncio.Context,
) -> None:
    publisher = Publisher(ctx, buffer_steps=4)
    try:
        async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=POLLING) as rig:
            await publisher.wait_subscribed()
            await publisher.pages(3)
            await rig.settle(2)
            for _ in range(20):  # 20 batches lost live, 3 every 0.05 s: more than the buffer between polls
                await publisher.publish([page(publisher.seq)], drop=True)
                await asyncio.sleep(0.02)
            await rig.settle(22)
            assert rig.index.timeline() == list(range(1, 24))  # every page, in order, no resync
            assert rig.metric("kvlb_events_replay_polls_total", {"replica": REPLICA, "outcome": "new"}) >= 1
            await publisher.pages(1)  # the live stream is back: seq 23 follows
            await rig.settle(23)
            assert rig.index.resyncs() == []
    finally:
        await publisher.aclose()


@pytest.mark.parametrize("resume_seq", [None, 3])
async def test_a_batch_lost_live_before_the_first_one_taken_is_read_by_a_poll(
    ctx: zmq.asyncio.Context, resume_seq: int | None
) -> None:
    """A source that has taken no batch yet (a fresh engine; or a new lease holder resuming after
    the last batch applied, ``resume_seq``) whose catch-up found nothing: a batch then lost live (a
    subscription not yet in force at the publisher, a high-water mark) was noticed only at the next
    live message, never if the engine stayed idle (polls waited for a first batch). It is polled
    from the wanted seq now."""
    publisher = Publisher(ctx)
    for _ in range(resume_seq or 0):  # applied by the previous holder: not replayed again
        await publisher.publish([page(publisher.seq)], drop=True)
    try:
        async with running(
            ctx, publisher.endpoint, publisher.replay_endpoint, settings=POLLING, resume_seq=resume_seq
        ) as rig:
            await publisher.wait_subscribed()
            await asyncio.wait_for(publisher.replay_served.wait(), 5.0)  # the catch-up: nothing new
            seq = await publisher.publish([page(publisher.seq)], drop=True)
            await rig.settle(seq)
            assert rig.index.timeline() == [seq + 1]  # that page alone, no resync
            assert publisher.replay_requests[0] == (resume_seq or 0)
            assert rig.metric("kvlb_events_replay_polls_total", {"replica": REPLICA, "outcome": "new"}) == 1
    finally:
        await publisher.aclose()


async def test_bursts_lost_live_after_quiet_spells_are_read_before_a_short_buffer_rotates(
    ctx: zmq.asyncio.Context,
) -> None:
    """A busy engine publishes in bursts (a request's prefill, its decode pages, its end) with quiet
    spells between them. With every live message lost, a poll interval that doubled over a quiet spell
    let the next burst rotate the 4-batch buffer past the lost batches (issue #18, measured in the
    ``gap_beyond_replay`` fault). While batches keep coming the interval stays at its minimum, and a
    burst spread wider than it is read whole."""
    publisher = Publisher(ctx, buffer_steps=4)
    try:
        async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=POLLING) as rig:
            await publisher.wait_subscribed()
            await publisher.pages(1)
            await rig.settle(0)
            for _ in range(8):  # quiet 0.45 s, then 6 batches 0.02 s apart (at most 3 per 0.05 s)
                await asyncio.sleep(0.45)
                for _ in range(6):
                    await publisher.publish([page(publisher.seq)], drop=True)
                    await asyncio.sleep(0.02)
            await rig.settle(48)
            assert rig.index.resyncs() == []
            assert rig.index.timeline() == list(range(1, 50))  # every page, in order
            assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "partial"}) == 0
    finally:
        await publisher.aclose()


async def test_an_idle_publisher_is_polled_less_and_less(ctx: zmq.asyncio.Context) -> None:
    publisher = Publisher(ctx)
    settings = dataclasses.replace(POLLING, replay_poll_busy_s=0.3)
    try:
        async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=settings) as rig:
            await publisher.wait_subscribed()
            await publisher.pages(2)
            await rig.settle(1)
            await asyncio.sleep(0.3)
            busy = len(publisher.replay_requests) - 1  # the first request is the connection's catch-up
            # Within replay_poll_busy_s of the last batch: every 0.05 s, about 6 polls (a loaded
            # machine delays polls, never brings them forward: the lower bounds are loose).
            assert 2 <= busy <= 7, publisher.replay_requests
            await asyncio.sleep(1.0)
            polls = len(publisher.replay_requests) - 1 - busy
            # Then 0.05 s doubling up to 0.2 s: 0.1 + 0.2 × 4 ≈ 0.9 s → 5-6 polls (not 20)
            assert 2 <= polls <= 8, publisher.replay_requests
            assert set(publisher.replay_requests[1:]) == {2}
            assert (
                rig.metric("kvlb_events_replay_polls_total", {"replica": REPLICA, "outcome": "nothing"})
                == busy + polls
            )
            assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "failed"}) == 0
            assert rig.index.resyncs() == []
    finally:
        await publisher.aclose()


async def test_polls_keep_one_replay_connection_until_an_answer_is_late(ctx: zmq.asyncio.Context) -> None:
    """Polls reuse the source's DEALER (one connection, not one per poll). A request that times out
    closes it, so its answer, still on its way, is never read as the next request's: the next poll
    opens a fresh connection and every batch is taken once, in order."""
    publisher = Publisher(ctx, buffer_steps=4)
    settings = dataclasses.replace(POLLING, replay_timeout_s=0.2)
    try:
        async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=settings) as rig:
            await publisher.wait_subscribed()
            await publisher.pages(1)
            await rig.settle(0)
            # the catch-up, then polls (every 0.05 s while busy)
            await eventually(lambda: len(publisher.replay_requests) >= 4, timeout_s=5.0)
            assert len(set(publisher.replay_peers)) == 1, publisher.replay_requests
            publisher.replay_gate = asyncio.Event()  # the replay socket stops answering
            await publisher.publish([page(publisher.seq)], drop=True)
            await asyncio.sleep(0.5)  # requests time out after 0.2 s
            await publisher.publish([page(publisher.seq)], drop=True)
            publisher.replay_gate.set()
            await rig.settle(2)
            await asyncio.sleep(0.3)
            assert rig.index.timeline() == [1, 2, 3]
            assert (
                rig.metric("kvlb_events_replay_polls_total", {"replica": REPLICA, "outcome": "failed"}) >= 1
            )
            peers = list(dict.fromkeys(publisher.replay_peers))
            assert len(peers) >= 2  # a fresh DEALER after the timeout
            assert publisher.replay_peers[-3:] == [peers[-1]] * 3  # and kept again since
    finally:
        await publisher.aclose()


def test_poll_intervals_are_validated() -> None:
    with pytest.raises(ConfigError, match="replay_poll_min_s must be <="):
        dataclasses.replace(POLLING, replay_poll_min_s=1.0, replay_poll_max_s=0.5).validate()
    with pytest.raises(ConfigError, match="replay_poll_min_s"):
        dataclasses.replace(POLLING, replay_poll_min_s=0.0).validate()
    with pytest.raises(ConfigError, match="replay_poll_busy_s"):
        dataclasses.replace(POLLING, replay_poll_busy_s=-1.0).validate()
    dataclasses.replace(POLLING, replay_poll_busy_s=0.0).validate()
