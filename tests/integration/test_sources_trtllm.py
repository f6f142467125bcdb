"""TrtllmPoller against a real aiohttp server on 127.0.0.1 serving a draining ``POST /kv_cache_events``.

The fake engine answers with the JSON of docs/reference/engine-events.md §4.4
(``created``/``stored``/``removed``, ``event_id``, ``window_size``) and forgets what it returned, as
trtllm-serve does. The poller decodes with the real ``TrtllmDecoder``; the sink records what
``index.apply`` received.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from procs_free import free_port
from prometheus_client import generate_latest
from recording_index import RecordingIndex
from waiting import eventually

from balancer.engines.trtllm import SPEC as TRTLLM_SPEC
from balancer.engines.trtllm import TrtllmDecoder
from balancer.events import Removed, Resync, Stored
from balancer.metrics import Metrics
from balancer.sources.base import IngestBatch
from balancer.sources.pipeline import EventIngest
from balancer.sources.trtllm_poll import PollSettings, TrtllmPoller
from balancer.types import EngineHash, ReplicaId

TRTLLM_DRAIN_PATH = TRTLLM_SPEC.drain_path or ""

REPLICA = ReplicaId("trt-0")
TPB = 4
FAST = PollSettings(
    min_interval_s=0.005,
    max_interval_s=0.04,
    request_timeout_s=2.0,
    error_backoff_initial_s=0.01,
    error_backoff_max_s=0.04,
    disabled_retry_s=0.03,
)


def created(event_id: int) -> dict[str, Any]:
    data = {"type": "created", "num_blocks_per_cache_level": [1000, 0]}
    return {"event_id": event_id, "data": data, "window_size": 4096}


def block(block_hash: int, first_token: int, count: int = TPB) -> dict[str, Any]:
    tokens = [
        {"type": "unique_token", "token_id": first_token + i, "token_extra_id": 0} for i in range(count)
    ]
    return {"type": "stored_block", "block_hash": block_hash, "tokens": tokens, "cache_salt": None,
            "cache_level": 0, "priority": 35, "mm_keys": []}  # fmt: skip


def stored(event_id: int, parent: int | None, *blocks: dict[str, Any]) -> dict[str, Any]:
    data = {"type": "stored", "parent_hash": parent, "blocks": list(blocks)}
    return {"event_id": event_id, "data": data, "window_size": 4096}


def removed(event_id: int, *hashes: int) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "data": {"type": "removed", "block_hashes": list(hashes)},
        "window_size": 4096,
    }


class FakeEngine:
    """trtllm-serve's drain: returns every pending event once."""

    def __init__(self) -> None:
        self.pending: list[Any] = []
        self.fail_next = 0
        self.enabled = True
        self.raw_body: bytes | None = None
        self.drains = 0
        self.runner: web.AppRunner | None = None
        self.answer_gate: asyncio.Event | None = None
        """When set to an event, a drain that took events answers only once it is set: the events
        are gone from the engine while the answer is on its way."""
        self.held = asyncio.Event()
        """Set when a drain took events and waits for ``answer_gate``."""

    async def kv_cache_events(self, request: web.Request) -> web.StreamResponse:
        self.drains += 1
        if not self.enabled:
            raise web.HTTPNotFound()
        if self.fail_next:
            self.fail_next -= 1
            return web.Response(status=500, text="engine busy")
        if self.raw_body is not None:
            body, self.raw_body = self.raw_body, None
            return web.Response(body=body, content_type="application/json")
        events, self.pending = self.pending, []
        if events and self.answer_gate is not None:
            self.held.set()
            await self.answer_gate.wait()
        return web.json_response(events)

    async def start(self, port: int = 0) -> int:
        app = web.Application()
        app.router.add_post("/kv_cache_events", self.kv_cache_events)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        return int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine()
    yield fake
    await fake.stop()


class Rig:
    def __init__(self, poller: TrtllmPoller, index: RecordingIndex, metrics: Metrics) -> None:
        self.poller, self.index, self.metrics = poller, index, metrics

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.index.events if isinstance(e, kind)]


@contextlib.asynccontextmanager
async def polling(
    session: aiohttp.ClientSession, port: int, settings: PollSettings = FAST
) -> AsyncIterator[Rig]:
    async with ingesting(session, port, settings) as (_, rig):
        yield rig


async def test_drains_events_once_in_order(session: aiohttp.ClientSession, engine: FakeEngine) -> None:
    port = await engine.start()
    engine.pending = [created(0), stored(1, None, block(11, 100), block(12, 104), block(13, 108, count=2))]
    async with polling(session, port) as rig:
        await eventually(lambda: len(rig.of(Stored)) == 1)
        assert engine.pending == []
        engine.pending = [removed(2, 12), stored(3, 11, block(14, 200))]
        await eventually(lambda: len(rig.of(Stored)) == 2)
        await asyncio.sleep(0.05)  # more polls: nothing is delivered twice
        first, second = rig.of(Stored)
        assert rig.index.events[0] == Resync(0, "restart")  # ``created`` opens a stream
        assert (first.parent, first.engine_hashes) == (None, (11, 12))  # partial block 13 dropped
        assert (second.parent, second.engine_hashes) == (11, (14,))
        assert rig.of(Removed) == [Removed(0, (EngineHash(12),))]
        assert len(rig.index.events) == 4
        assert rig.poller.status().messages >= 2


async def test_survives_server_errors(session: aiohttp.ClientSession, engine: FakeEngine) -> None:
    port = await engine.start()
    engine.fail_next = 3
    engine.pending = [created(0), stored(1, None, block(21, 1))]
    async with polling(session, port) as rig:
        await eventually(lambda: len(rig.of(Stored)) == 1)
        assert rig.poller.status().transport_errors == 3
        assert engine.drains >= 4


async def test_connection_refused_then_engine_appears(
    session: aiohttp.ClientSession, engine: FakeEngine
) -> None:
    port = free_port()
    async with polling(session, port) as rig:
        await eventually(lambda: rig.poller.status().transport_errors >= 3)
        assert rig.index.events == []
        engine.pending = [created(0), stored(1, None, block(31, 7))]
        await engine.start(port)
        await eventually(lambda: len(rig.of(Stored)) == 1)
        assert rig.of(Stored)[0].engine_hashes == (31,)


async def test_events_disabled_404_logs_once(
    session: aiohttp.ClientSession, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    port = await engine.start()
    engine.enabled = False
    with caplog.at_level(logging.WARNING, logger="balancer.sources.trtllm_poll"):
        async with polling(session, port) as rig:
            await eventually(lambda: engine.drains >= 4)
            assert rig.poller.status().disabled
            engine.enabled = True
            engine.pending = [created(0), stored(1, None, block(41, 9))]
            await eventually(lambda: len(rig.of(Stored)) == 1)
            assert not rig.poller.status().disabled
    warnings = [r for r in caplog.records if "404" in r.getMessage()]
    assert len(warnings) == 1


async def test_decoder_resyncs_flow_through_and_count_gaps(
    session: aiohttp.ClientSession, engine: FakeEngine
) -> None:
    port = await engine.start()
    engine.pending = [created(0), stored(1, None, block(51, 0))]
    async with polling(session, port) as rig:
        await eventually(lambda: len(rig.of(Stored)) == 1)
        engine.pending = [stored(5, 51, block(52, 4))]  # ids 2..4 were lost in the engine buffer
        await eventually(lambda: len(rig.of(Stored)) == 2)
        assert rig.of(Resync) == [Resync(0, "restart"), Resync(0, "gap")]
        assert rig.metrics.registry.get_sample_value("kvlb_events_seq_gaps_total", {"replica": REPLICA}) == 1
        assert rig.poller.status().gaps == 1
        gap_resyncs = {"replica": REPLICA, "reason": "gap"}
        assert rig.metrics.registry.get_sample_value("kvlb_events_resyncs_total", gap_resyncs) == 1


async def test_bad_body_is_counted_and_polling_goes_on(
    session: aiohttp.ClientSession, engine: FakeEngine
) -> None:
    port = await engine.start()
    engine.raw_body = b"{not json"
    engine.pending = [created(0), stored(1, None, block(61, 0))]
    async with polling(session, port) as rig:
        await eventually(lambda: len(rig.of(Stored)) == 1)
        labels = {"replica": REPLICA, "engine": "trtllm", "reason": "json"}
        assert rig.metrics.registry.get_sample_value("kvlb_events_decode_errors_total", labels) == 1
        assert rig.poller.status().decode_errors == 1


async def test_a_drain_over_the_byte_limit_is_dropped_and_the_gap_resyncs(
    session: aiohttp.ClientSession, engine: FakeEngine
) -> None:
    """``limits.event_message_bytes`` caps a drain body: a larger one is read no further than the
    limit, counted as a transport error, and the next drain's ``event_id`` gap resyncs."""
    port = await engine.start()
    engine.pending = [created(0), stored(1, None, block(71, 0))]
    settings = dataclasses.replace(FAST, max_body_bytes=4096)
    async with polling(session, port, settings) as rig:
        await eventually(lambda: len(rig.of(Stored)) == 1)
        big = [stored(2 + n, None, block(100 + n, 4 * n)) for n in range(40)]
        engine.raw_body = json.dumps(big).encode()
        assert len(engine.raw_body) > 4096
        await eventually(lambda: rig.poller.status().transport_errors == 1)
        engine.pending = [stored(42, None, block(99, 0))]
        await eventually(lambda: len(rig.of(Stored)) == 2)
        assert rig.of(Resync) == [Resync(0, "restart"), Resync(0, "gap")]
        assert rig.of(Stored)[1].engine_hashes == (99,)


async def test_partial_hashes_forgotten_at_the_cap_are_exported(
    session: aiohttp.ClientSession, engine: FakeEngine
) -> None:
    """The decoder's memory of partial-block hashes drops its oldest past ``max_partial_hashes``;
    each one dropped is counted in ``kvlb_events_decoder_forgotten_total{replica}`` (it was only in
    ``TrtllmDecoder.partial_overflow``, which nothing exported)."""
    port = await engine.start()
    partials = [stored(1 + n, None, block(200 + n, 8 * n, count=2)) for n in range(5)]
    engine.pending = [created(0), *partials, stored(6, None, block(81, 0))]
    decoder = TrtllmDecoder(tokens_per_block=TPB, max_partial_hashes=2)
    async with ingesting(session, port, decoder=decoder) as (_, rig):
        forgotten = {"replica": REPLICA}
        assert rig.metrics.registry.get_sample_value("kvlb_events_decoder_forgotten_total", forgotten) == 0
        await eventually(lambda: len(rig.of(Stored)) == 1)
        assert decoder.partial_overflow == 3
        assert rig.metrics.registry.get_sample_value("kvlb_events_decoder_forgotten_total", forgotten) == 3
        scraped = generate_latest(rig.metrics.registry).decode()
        assert f'kvlb_events_decoder_forgotten_total{{replica="{REPLICA}"}} 3.0' in scraped


async def test_interval_adapts_to_traffic(session: aiohttp.ClientSession, engine: FakeEngine) -> None:
    port = await engine.start()
    poller = TrtllmPoller(
        REPLICA,
        f"http://127.0.0.1:{port}",
        path=TRTLLM_DRAIN_PATH,
        session=session,
        decoder=TrtllmDecoder(tokens_per_block=TPB),
        metrics=Metrics.create(),
        settings=PollSettings(min_interval_s=0.01, max_interval_s=0.08),
    )
    got: list[IngestBatch] = []
    engine.pending = [created(0)]
    delays = [await poller.poll_once(got.append)]
    delays += [await poller.poll_once(got.append) for _ in range(5)]
    engine.pending = [stored(1, None, block(71, 0))]
    delays.append(await poller.poll_once(got.append))
    assert delays == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.08, 0.08, 0.01])
    assert [type(e) for batch in got for e in batch.events] == [Resync, Stored]


@contextlib.asynccontextmanager
async def ingesting(
    session: aiohttp.ClientSession,
    port: int,
    settings: PollSettings = FAST,
    decoder: TrtllmDecoder | None = None,
) -> AsyncIterator[tuple[EventIngest, Rig]]:
    """A running EventIngest with one poller."""
    metrics, index = Metrics.create(), RecordingIndex(REPLICA)
    metrics.init_replica(REPLICA, "trtllm", replays=False)
    poller = TrtllmPoller(
        REPLICA,
        f"http://127.0.0.1:{port}/",
        path=TRTLLM_DRAIN_PATH,
        session=session,
        decoder=decoder or TrtllmDecoder(tokens_per_block=TPB),
        metrics=metrics,
        settings=settings,
    )
    ingest = EventIngest(index, metrics=metrics)  # type: ignore[arg-type]
    ingest.add_replica(REPLICA, "trtllm", [poller])
    await ingest.start()
    try:
        yield ingest, Rig(poller, index, metrics)
    finally:
        await ingest.aclose()


async def test_a_graceful_stop_applies_the_drain_under_way(
    session: aiohttp.ClientSession, engine: FakeEngine
) -> None:
    """A hand-over (``remove_replica`` with ``drain_s``) that caught a drain after the engine gave its
    events up used to cancel it: the events were lost and the hand-over still reported clean, so the
    next holder took the replica without a resync and kept the removed block (the index held more
    than the engine: the ``cluster_master_killed`` fault, 2026-11-30). The drain now delivers first."""
    port = await engine.start()
    engine.pending = [created(0), stored(1, None, block(41, 1), block(42, 5))]
    async with ingesting(session, port) as (ingest, rig):
        await eventually(lambda: len(rig.of(Stored)) == 1)
        engine.answer_gate = asyncio.Event()
        engine.pending = [removed(2, 42)]
        await asyncio.wait_for(engine.held.wait(), 5.0)
        stopping = asyncio.create_task(ingest.remove_replica(REPLICA, drop_index=False, drain_s=5.0))
        await asyncio.sleep(0.1)  # the hand-over waits for the drain, which the engine answers now
        assert not stopping.done()
        engine.answer_gate.set()
        assert await asyncio.wait_for(stopping, 5.0) is True
        assert rig.of(Removed) == [Removed(0, (EngineHash(42),))]
        drains = engine.drains
        await asyncio.sleep(0.1)
        assert engine.drains == drains  # no drain after the stop


async def test_a_drain_that_outlasts_the_graceful_stop_makes_it_unclean(
    session: aiohttp.ClientSession, engine: FakeEngine
) -> None:
    """A drain still unanswered when ``drain_s`` runs out is cancelled: its events are lost, so the
    stop is not clean (the next holder resyncs the replica)."""
    port = await engine.start()
    engine.pending = [created(0), stored(1, None, block(51, 1))]
    async with ingesting(session, port) as (ingest, rig):
        await eventually(lambda: len(rig.of(Stored)) == 1)
        engine.answer_gate = asyncio.Event()
        engine.pending = [removed(2, 51)]
        await asyncio.wait_for(engine.held.wait(), 5.0)
        assert await ingest.remove_replica(REPLICA, drop_index=False, drain_s=0.2) is False
        assert rig.of(Removed) == []
        engine.answer_gate.set()


async def test_a_graceful_stop_after_a_timed_out_drain_is_unclean(
    session: aiohttp.ClientSession, engine: FakeEngine
) -> None:
    """A drain that timed out may have emptied the engine's buffer: until a drain answers, a stop
    is not clean."""
    port = await engine.start()
    engine.pending = [created(0), stored(1, None, block(61, 1))]
    settings = dataclasses.replace(
        FAST, request_timeout_s=0.1, error_backoff_initial_s=5.0, error_backoff_max_s=5.0
    )
    metrics, index = Metrics.create(), RecordingIndex(REPLICA)
    poller = TrtllmPoller(
        REPLICA, f"http://127.0.0.1:{port}/", path=TRTLLM_DRAIN_PATH, session=session,
        decoder=TrtllmDecoder(tokens_per_block=TPB), metrics=metrics, settings=settings,
    )  # fmt: skip
    ingest = EventIngest(index, metrics=metrics)  # type: ignore[arg-type]
    ingest.add_replica(REPLICA, "trtllm", [poller])
    await ingest.start()
    try:
        await eventually(lambda: any(isinstance(e, Stored) for e in index.events))
        engine.answer_gate = asyncio.Event()
        engine.pending = [removed(2, 61)]
        await eventually(lambda: poller.status().transport_errors >= 1)  # timed out, backing off
        assert await ingest.remove_replica(REPLICA, drop_index=False, drain_s=1.0) is False
        engine.answer_gate.set()
    finally:
        await ingest.aclose()
