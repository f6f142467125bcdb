"""A replay poll waiting on an engine whose health probe finds nothing listening ends at once (the
rig is :mod:`zmq_rig`; the probe is the real ``HealthProber`` against a real HTTP server).

The probe runs on the request loop; the ZMQ source on the ingest thread's loop
(``IngestThread``). When the probe's connection is refused, the prober tells the ingest
(``ThreadedIngest.engine_gone``, a ``call_soon_threadsafe`` hop): the poll in flight ends within
moments, logged as the engine having gone away (not as a silent replay endpoint), no poll starts
while it stays away, and polls resume at the first good probe. The publisher's disconnect, when it
comes during a stalled poll, drops the rank's blocks at once too (the SUB's monitor is watched while
a replay waits)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import zmq.asyncio
from aiohttp import web
from recording_index import RecordingIndex
from unstalled import Unstalled
from zmq_rig import (  # noqa: F401  (pytest fixtures)
    BLOCK,
    POLLING,
    REPLICA,
    TOPIC,
    Publisher,
    ctx_fixture,
    eventually,
)

from balancer.engines.sglang import SglangDecoder
from balancer.events import Resync
from balancer.health.book import BreakerConfig, HealthBook
from balancer.health.prober import HealthProber, ProbeSettings
from balancer.metrics import Metrics
from balancer.sources.ingest_thread import IngestThread, ThreadedIngest
from balancer.sources.pipeline import EventIngest
from balancer.sources.zmq_sub import ZmqEventSource

STALLED = dataclasses.replace(POLLING, replay_timeout_s=5.0)
"""Polls every 0.05-0.2 s; a poll the engine does not answer waits 5 s."""
CUT_BOUND_S = 0.5
"""Most seconds from the probe's verdict (or the publisher's disconnect) to the poll's end."""
LOGGER = "balancer.sources.zmq_sub"


def unstalled(thread: IngestThread) -> Unstalled:
    """Seconds from now, less a loaded machine's stall of this loop or of ``thread``'s (the ingest
    thread's), which would otherwise count as the cut's time."""
    return Unstalled(threads=[t for t in threading.enumerate() if t.name == thread.name])


class Health:
    """A real HTTP server on 127.0.0.1 answering ``/health`` 200 while it runs."""

    def __init__(self) -> None:
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", _ok)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        self.port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def thread() -> AsyncIterator[IngestThread]:
    made = IngestThread("kvlb-test-engine-gone", join_timeout_s=5.0)
    await made.start()
    try:
        yield made
    finally:
        await made.stop()


def abandoned(metrics: Metrics) -> float:
    labels = {"replica": REPLICA, "outcome": "abandoned"}
    return metrics.registry.get_sample_value("kvlb_events_replay_polls_total", labels) or 0.0


async def test_the_probe_ends_a_replay_poll_waiting_on_a_gone_engine(
    ctx: zmq.asyncio.Context, thread: IngestThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    publisher, health = Publisher(ctx), Health()
    metrics, index = Metrics.create(), RecordingIndex(REPLICA)
    assert thread.zmq is not None
    source = ZmqEventSource(
        REPLICA,
        publisher.endpoint,
        ctx=thread.zmq,
        decoder=SglangDecoder(block_size=BLOCK),
        metrics=metrics,
        topic=TOPIC,
        replay_endpoint=publisher.replay_endpoint,
        settings=STALLED,
    )
    ingest = ThreadedIngest(thread, EventIngest(index, metrics=metrics))  # type: ignore[arg-type]
    await ingest.add_replica(REPLICA, "sglang", [source])
    book = HealthBook(BreakerConfig(failure_threshold=10))
    book.add(REPLICA)
    try:
        url = await health.start()
        async with aiohttp.ClientSession() as session:
            prober = HealthProber(
                REPLICA,
                url,
                session=session,
                health=book,
                settings=ProbeSettings(interval_s=1.0, timeout_s=1.0),
                engine_watch=ingest,
            )
            assert await prober.probe_once()
            await ingest.start()
            await publisher.wait_subscribed()
            await publisher.pages(3)
            await eventually(lambda: source.status().last_seq == 2, timeout_s=5.0)
            publisher.replay_gate = asyncio.Event()  # never set: the engine stops answering replays
            asked = len(publisher.replay_requests)
            await eventually(lambda: len(publisher.replay_requests) > asked, timeout_s=5.0)  # a poll waits

            await health.stop()  # the engine's HTTP side is gone; its publisher is still connected
            assert not await prober.probe_once()
            verdict = unstalled(thread)
            assert book.routable(time.monotonic()) == []
            await eventually(lambda: abandoned(metrics) == 1, timeout_s=5.0)
            cut_s = verdict.seconds()
            assert cut_s < CUT_BOUND_S, cut_s
            messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
            assert any(
                "abandoned: the engine went away (its health probe: /health: ClientConnectorError)" in m
                for m in messages
            ), messages
            assert not any("did not answer" in m for m in messages), messages
            assert source.status().last_error is None

            stalled, publisher.replay_gate = publisher.replay_gate, asyncio.Event()
            stalled.set()  # the replay server takes the next request (and stalls it again)
            await asyncio.sleep(0.05)
            asked = len(publisher.replay_requests)
            await asyncio.sleep(0.6)  # three poll intervals or more: no poll while the engine is away
            assert len(publisher.replay_requests) == asked
            assert not any(isinstance(e, Resync) for e in index.events)  # its publisher is connected

            await health.start()  # back: polls resume (and wait again on the stalled replay socket)
            assert await prober.probe_once()
            await eventually(lambda: len(publisher.replay_requests) > asked, timeout_s=5.0)

            closed = unstalled(thread)
            await publisher.aclose()  # the publisher's process goes: its connection drops
            await eventually(lambda: Resync(0, "disconnect") in index.events, timeout_s=5.0)
            assert closed.seconds() < CUT_BOUND_S
            messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
            assert any("abandoned: the engine went away (its publisher disconnected)" in m for m in messages)
    finally:
        await ingest.aclose()
        await health.stop()
        await publisher.aclose()


async def test_a_replica_removed_while_a_replay_poll_waits_leaves_at_once(
    ctx: zmq.asyncio.Context, thread: IngestThread
) -> None:
    """Removal (discovery, a pool reload) cancels the source's task on the ingest loop: a poll
    waiting on a stalled replay socket does not hold it (unchanged by h-replaycancel: checked)."""
    publisher = Publisher(ctx)
    metrics, index = Metrics.create(), RecordingIndex(REPLICA)
    assert thread.zmq is not None
    source = ZmqEventSource(
        REPLICA,
        publisher.endpoint,
        ctx=thread.zmq,
        decoder=SglangDecoder(block_size=BLOCK),
        metrics=metrics,
        topic=TOPIC,
        replay_endpoint=publisher.replay_endpoint,
        settings=STALLED,
    )
    ingest = ThreadedIngest(thread, EventIngest(index, metrics=metrics))  # type: ignore[arg-type]
    await ingest.add_replica(REPLICA, "sglang", [source])
    try:
        await ingest.start()
        await publisher.wait_subscribed()
        await publisher.pages(3)
        await eventually(lambda: source.status().last_seq == 2, timeout_s=5.0)
        publisher.replay_gate = asyncio.Event()  # never set
        asked = len(publisher.replay_requests)
        await eventually(lambda: len(publisher.replay_requests) > asked, timeout_s=5.0)  # a poll waits
        started = unstalled(thread)
        await ingest.remove_replica(REPLICA)
        assert started.seconds() < CUT_BOUND_S
        assert REPLICA not in ingest.status()
    finally:
        await ingest.aclose()
        await publisher.aclose()
