"""An emulated SGLang engine (``replicas.sim``, its real PUB and replay ROUTER) that crashes and is
started again on the same ports, in front of the real ``ZmqEventSource``: its blocks leave the index
as soon as its publisher connection drops, before the new process exists (logged as disconnected);
the new process is logged as restarted once its first batches show it, and a kvlb source started
after the engine went quiet learns its cache from the replay socket without a new batch."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
import waiting
import zmq.asyncio
from emulated_replica import started
from recording_index import RecordingIndex
from unstalled import Unstalled

from balancer.engines.sglang import SglangDecoder
from balancer.events import Resync, Stored
from balancer.metrics import Metrics
from balancer.sources.pipeline import EventIngest
from balancer.sources.zmq_sub import ZmqEventSource
from balancer.types import ReplicaId
from loadtests.faults.procs import free_ports
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

REPLICA = ReplicaId("sgl-0")
PAGE = 4
LOGGER = "balancer.sources.zmq_sub"


eventually = functools.partial(waiting.eventually, timeout_s=10.0, poll_s=0.01)
"""The shared wait, with this file's longer deadline."""


@contextlib.asynccontextmanager
async def emulated(ports: list[int], zctx: zmq.asyncio.Context) -> AsyncIterator[Replica]:
    http, events, replay = ports
    config = ReplicaConfig(
        name="sgl",
        engine="sglang",
        profile=get_profile("cpu-test"),
        time_scale=20.0,
        page_size=PAGE,
        http_port=http,
        event_port=events,
        replay_port=replay,
    )
    async with started(config, zctx) as replica:
        yield replica


@contextlib.asynccontextmanager
async def ingesting(
    ports: list[int], ctx: zmq.asyncio.Context, started: list[EventIngest] | None = None
) -> AsyncIterator[RecordingIndex]:
    """The real source and pipeline over a recording index (the pipeline appended to ``started``)."""
    metrics, index = Metrics.create(), RecordingIndex(REPLICA)
    source = ZmqEventSource(
        REPLICA,
        f"tcp://127.0.0.1:{ports[1]}",
        ctx=ctx,
        decoder=SglangDecoder(block_size=PAGE),
        metrics=metrics,
        replay_endpoint=f"tcp://127.0.0.1:{ports[2]}",
    )
    ingest = EventIngest(index, metrics=metrics)  # type: ignore[arg-type]
    ingest.add_replica(REPLICA, "sglang", [source])
    if started is not None:
        started.append(ingest)
    await ingest.start()
    try:
        yield index
    finally:
        await ingest.aclose()


async def complete(session: aiohttp.ClientSession, replica: Replica, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    async with session.post(replica.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


def stored_pages(events: list[object]) -> int:
    return sum(len(e.engine_hashes) for e in events if isinstance(e, Stored))


async def test_a_crashed_engine_is_dropped_at_once_and_its_restart_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    ports = free_ports(3)
    zctx, ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
    try:
        async with aiohttp.ClientSession() as session, ingesting(ports, ctx) as index:
            async with emulated(ports, zctx) as replica:
                await complete(session, replica, list(range(100, 117)))
                await eventually(lambda: stored_pages(index.events) >= 4)
            stopped = Unstalled()  # the process is gone, and its cache with it
            await eventually(lambda: Resync(0, "disconnect") in index.events)
            assert stopped.seconds() < 1.0  # a loaded machine's stall of this loop not counted
            messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
            assert any("disconnected" in m for m in messages) and not any("restarted" in m for m in messages)
            seen = len(index.events)
            async with emulated(ports, zctx) as replica:  # a new process on the same ports
                await complete(session, replica, list(range(200, 217)))
                await eventually(lambda: stored_pages(index.events[seen:]) >= 4)
            messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
            assert sum("restarted" in m for m in messages) == 1, messages
            assert not any(isinstance(e, Resync) for e in index.events[seen:])  # dropped once, at the crash
    finally:
        ctx.destroy(linger=0)
        zctx.destroy(linger=0)


async def test_a_source_started_after_an_idle_engine_learns_its_cache_from_replay() -> None:
    ports = free_ports(3)
    zctx, ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
    try:
        async with aiohttp.ClientSession() as session, emulated(ports, zctx) as replica:
            await complete(session, replica, list(range(300, 317)))
            await complete(session, replica, list(range(400, 417)))
            await asyncio.sleep(0.2)  # the engine is idle from here on
            async with ingesting(ports, ctx) as index:
                await eventually(lambda: stored_pages(index.events) >= 8)
                assert stored_pages(index.events) == 8  # 2 × 4 full pages, no new batch needed
    finally:
        ctx.destroy(linger=0)
        zctx.destroy(linger=0)


async def test_replayed_batches_leave_the_lag_gauge_to_live_ones() -> None:
    """The SRE walk of 2026-12-01: a kvlb started after an engine went idle learned its cache from
    the replay socket, and the replayed batch's age (how long the engine had been idle) stayed as
    the replica's event lag (``kvlb_events_lag_seconds``, ``events.last_lag_s``) until its next live
    batch: 9.9 s on every idle replica of a fresh ``kvlb serve``, which ``KvlbIndexLagging``
    (> 5 s for 5 min) would have paged on. The lag is now measured on live batches only."""
    ports = free_ports(3)
    zctx, ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
    pipelines: list[EventIngest] = []
    try:
        async with aiohttp.ClientSession() as session, emulated(ports, zctx) as replica:
            await complete(session, replica, list(range(300, 317)))
            await asyncio.sleep(1.0)  # the engine is idle from here on
            async with ingesting(ports, ctx, pipelines) as index:
                await eventually(lambda: stored_pages(index.events) >= 4)
                await asyncio.sleep(0.1)
                assert pipelines[0].status()[REPLICA].last_lag_s is None  # replayed: no live batch yet
                await complete(session, replica, list(range(500, 517)))
                await eventually(lambda: stored_pages(index.events) >= 8)
                await asyncio.sleep(0.1)
                lag_s = pipelines[0].status()[REPLICA].last_lag_s
                assert lag_s is not None and lag_s < 0.5
    finally:
        ctx.destroy(linger=0)
        zctx.destroy(linger=0)
