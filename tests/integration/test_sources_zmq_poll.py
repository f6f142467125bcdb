"""A silent live stream: the ZMQ source polls the replay socket (the rig is :mod:`zmq_rig`).

The publisher goes on publishing while every live message is lost (a PUB high-water mark, a stalled
connection), and its replay buffer is short: waiting for the next live message to show the gap
would find the buffer long past the lost batches (a resync). Polling the replay socket while the
stream is silent takes every batch in order instead, and an idle publisher costs polls that back
off."""

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


async def test_an_idle_publisher_is_polled_less_and_less(ctx: zmq.asyncio.Context) -> None:
    publisher = Publisher(ctx)
    try:
        async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=POLLING) as rig:
            await publisher.wait_subscribed()
            await publisher.pages(2)
            await rig.settle(1)
            await asyncio.sleep(1.0)
            polls = len(publisher.replay_requests) - 1  # the first request is the connection's catch-up
            # 0.05 s, doubling up to 0.2 s: 0.05 + 0.1 + 0.2 × 4 ≈ 0.95 s → 6 polls (not 20)
            assert 3 <= polls <= 8, publisher.replay_requests
            assert set(publisher.replay_requests[1:]) == {2}
            assert (
                rig.metric("kvlb_events_replay_polls_total", {"replica": REPLICA, "outcome": "nothing"})
                == polls
            )
            assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "failed"}) == 0
            assert rig.index.resyncs() == []
    finally:
        await publisher.aclose()


def test_poll_intervals_are_validated() -> None:
    with pytest.raises(ConfigError, match="replay_poll_min_s must be <="):
        dataclasses.replace(POLLING, replay_poll_min_s=1.0, replay_poll_max_s=0.5).validate()
    with pytest.raises(ConfigError, match="replay_poll_min_s"):
        dataclasses.replace(POLLING, replay_poll_min_s=0.0).validate()
