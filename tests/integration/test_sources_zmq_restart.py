"""Start and restart of the ZMQ source against a real publisher on 127.0.0.1 (the rig is
:mod:`zmq_rig`): every new connection asks the replay socket for everything from seq 0, so a fresh
kvlb learns an idle engine's cache at once; the live messages queued during that catch-up merge with
the answer by seq (and by payload, which tells a duplicate from a restarted publisher's batch); a
lost connection drops the rank's blocks at once and is logged as a disconnect, and as a restart only
once a batch shows one."""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq
import zmq.asyncio
from zmq_rig import (  # noqa: F401  (pytest fixtures)
    REPLICA,
    Publisher,
    ctx_fixture,
    eventually,
    publisher_fixture,
    running,
)

LOGGER = "balancer.sources.zmq_sub"


async def test_a_fresh_source_learns_an_idle_publishers_cache_without_a_new_batch(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    """The engine published before kvlb started and then went quiet (docs/real-engines.md,
    finding 3): the catch-up at connect brings its whole buffer in, no live message needed."""
    await publisher.pages(6)
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        await rig.settle(5)
        assert rig.index.timeline() == [1, 2, 3, 4, 5, 6]
        assert publisher.replay_requests == [0]
        assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "filled"}) == 1


async def test_a_catch_up_beyond_the_buffer_takes_the_older_queued_live_messages_first(
    ctx: zmq.asyncio.Context,
) -> None:
    """The replay socket answers late, from a buffer that has moved past seq 0 meanwhile; the live
    stream queued seq 0-2 and 6-7 (3-5 were lost live). Seq 0-2 come from the live queue before the
    replayed 5-7, the lost 3-4 are a gap, and the live 6-7 are duplicates of the replay."""
    publisher = Publisher(ctx, buffer_steps=3)
    publisher.replay_gate = asyncio.Event()
    try:
        async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
            await publisher.wait_subscribed()
            await eventually(lambda: publisher.replay_requests == [0])
            await publisher.pages(8, drop=lambda seq: 3 <= seq <= 5)
            await asyncio.sleep(0.1)  # the live messages reach the subscriber's queue
            publisher.replay_gate.set()
            await rig.settle(7)
            assert rig.index.timeline() == [1, 2, 3, "gap", 6, 7, 8]
            # a live copy that reached the queue after the replay's 7 is read (and counted) later
            await eventually(lambda: rig.source.status().duplicates == 2)
            assert rig.index.timeline() == [1, 2, 3, "gap", 6, 7, 8]
            assert rig.metric("kvlb_events_replays_total", {"replica": REPLICA, "outcome": "partial"}) == 1
    finally:
        await publisher.aclose()


async def test_a_restart_on_the_same_connection_after_a_catch_up_is_not_a_duplicate(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    """After a catch-up from 0 (seq 0-5), the publisher starts again at seq 0 on the same connection
    (the emulator's in-place restart). By seq alone its seq 0 and 1 are duplicates; their payloads
    differ from the replayed ones, so they are a restart."""
    await publisher.pages(6)
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        await rig.settle(5)  # caught up 0..5 from the replay socket, no live message yet
        publisher.restart()
        await publisher.wait_subscribed()
        await publisher.pages(2)
        await rig.settle(1)
        assert rig.index.timeline() == [1, 2, 3, 4, 5, 6, "restart", 1, 2]


async def test_a_crash_is_logged_as_a_disconnect_then_as_a_restart_when_the_new_process_shows(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    old = Publisher(ctx)
    async with running(ctx, old.endpoint, old.replay_endpoint) as rig:
        await old.wait_subscribed()
        await old.pages(5)
        await rig.settle(4)
        await old.aclose()  # the process dies: its blocks go at once, before any new process exists
        await eventually(lambda: rig.index.resyncs() == [(0, "disconnect")])
        await asyncio.sleep(0.3)
        messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
        assert any("disconnected" in m for m in messages), messages
        assert not any("restarted" in m for m in messages), messages
        new = Publisher(ctx, port=old.port, replay_port=old.replay_port)
        try:
            await new.pages(2)  # before kvlb reconnects: the catch-up brings them
            await rig.settle(1)
            assert rig.index.timeline() == [1, 2, 3, 4, 5, "disconnect", 1, 2]

            def restarted() -> list[str]:
                messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
                return [m for m in messages if "restarted" in m]

            # the catch-up logs the restart once its replay is over, which can be a loop turn after
            # the replayed batches are applied
            await eventually(lambda: bool(restarted()), seen=lambda: caplog.messages)
            assert len(restarted()) == 1 and "it had reached 4" in restarted()[0], caplog.messages
        finally:
            await new.aclose()
