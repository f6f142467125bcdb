"""The TRT-LLM relay of ``kvlb serve --workers N`` (:mod:`balancer.sources.trtllm_relay`) with real
ZMQ ``ipc://`` sockets, the real ``TrtllmPoller`` and the emulator's TRT-LLM personality over HTTP:
a worker that joins after bodies were relayed, or whose drainer restarted, catches up on every body
the drainer kept, in order and once; past the history's bound the catch-up is ``partial``."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import waiting
import zmq.asyncio
from procs_free import free_port
from recording_index import RecordingIndex
from test_sources_trtllm_restart import REPLICA, TPB, complete, emulated, emulated_poller

from balancer.engines.trtllm import TrtllmDecoder
from balancer.metrics import REPLAY_OUTCOMES, Metrics
from balancer.sources.base import EventSource
from balancer.sources.pipeline import EventIngest
from balancer.sources.trtllm_relay import RelayPublisher, RelaySource, relay_endpoint

eventually = functools.partial(waiting.eventually, timeout_s=10.0, poll_s=0.01)
"""The shared wait, with this file's longer deadline."""


def replays(metrics: Metrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "kvlb_events_replays_total", {"replica": REPLICA, "outcome": outcome}
    )
    return value or 0.0


def outcomes(metrics: Metrics) -> dict[str, float]:
    """The follower's catch-ups by outcome."""
    return {outcome: replays(metrics, outcome) for outcome in REPLAY_OUTCOMES}


@contextlib.asynccontextmanager
async def ingesting(source: EventSource, metrics: Metrics) -> AsyncIterator[RecordingIndex]:
    """``source`` feeding an index of its own until the block exits."""
    index = RecordingIndex(REPLICA)
    ingest = EventIngest(index, metrics=metrics)  # type: ignore[arg-type]
    ingest.add_replica(REPLICA, "trtllm", [source])
    await ingest.start()
    try:
        yield index
    finally:
        await ingest.aclose()


@contextlib.asynccontextmanager
async def drainer(
    session: aiohttp.ClientSession, port: int, endpoint: str, zctx: zmq.asyncio.Context, **history: int
) -> AsyncIterator[tuple[RecordingIndex, RelayPublisher, Metrics]]:
    """Worker 0's side: a poller that relays every body it drains; closed (sockets and all) on exit,
    as when that worker dies."""
    metrics = Metrics.create()
    relay = RelayPublisher(endpoint, zctx, replica=REPLICA, metrics=metrics, **history)
    poller = emulated_poller(session, port, metrics, tap=relay)
    async with ingesting(poller, metrics) as index:
        yield index, relay, metrics


@contextlib.asynccontextmanager
async def follower(
    endpoint: str, zctx: zmq.asyncio.Context
) -> AsyncIterator[tuple[RecordingIndex, RelaySource, Metrics]]:
    """Another worker's side: a relay source feeding its own index."""
    metrics = Metrics.create()
    source = RelaySource(
        REPLICA,
        endpoint,
        ctx=zctx,
        decoder=TrtllmDecoder(tokens_per_block=TPB),
        metrics=metrics,
        max_message_bytes=1 << 20,
    )
    async with ingesting(source, metrics) as index:
        yield index, source, metrics


async def test_a_follower_that_joins_after_the_first_bodies_catches_up_on_every_one(tmp_path: Path) -> None:
    """Before the catch-up, a worker whose relay SUB was not connected when worker 0 relayed a body
    never learned its blocks (nothing re-sends them): worker 1 after a restart, or a first drain
    that binds the PUB and sends at once."""
    port, zctx = free_port(), zmq.asyncio.Context()
    endpoint = relay_endpoint(str(tmp_path), REPLICA)
    try:
        async with (
            aiohttp.ClientSession() as session,
            emulated(port, zctx) as replica,
            drainer(session, port, endpoint, zctx) as (drained, relay, _),
        ):
            for start in (100, 200, 300):
                await complete(session, replica, list(range(start, start + 33)))
            await eventually(lambda: len(drained.pages()) >= 12)
            assert relay.published >= 1
            async with follower(endpoint, zctx) as (followed, source, metrics):
                await eventually(lambda: followed.pages() == drained.pages())
                # counted once the answer's end marker is read, which may come after the ingest
                # applied its bodies (a loaded machine: 2 runs of 113 saw the pages first)
                await eventually(lambda: replays(metrics, "filled") >= 1, seen=lambda: outcomes(metrics))
                await complete(session, replica, list(range(400, 433)))  # then live, each body once
                await eventually(lambda: len(drained.pages()) >= 16 and followed.pages() == drained.pages())
                assert len(followed.pages()) == len(set(followed.pages()))
                assert source.status().decode_errors == 0
            async with follower(endpoint, zctx) as (again, _, _):  # a worker restarted: all again
                await eventually(lambda: again.pages() == drained.pages())
    finally:
        zctx.destroy(linger=0)


async def test_a_restarted_drainer_is_followed_from_its_new_numbering(tmp_path: Path) -> None:
    """Worker 0 dies and a new one drains the same engine: its bodies are numbered from 0 again under
    a new incarnation; the follower (connected throughout) catches up on them instead of taking
    them for duplicates of the old numbering."""
    port, zctx = free_port(), zmq.asyncio.Context()
    endpoint = relay_endpoint(str(tmp_path), REPLICA)
    try:
        async with (
            aiohttp.ClientSession() as session,
            emulated(port, zctx) as replica,
            follower(endpoint, zctx) as (followed, _, metrics),
        ):
            async with drainer(session, port, endpoint, zctx) as (first, _, _):
                for start in (100, 200):
                    await complete(session, replica, list(range(start, start + 33)))
                await eventually(lambda: len(first.pages()) >= 8 and followed.pages() == first.pages())
            before = list(followed.pages())
            async with drainer(session, port, endpoint, zctx) as (second, _, _):
                for start in (300, 400):
                    await complete(session, replica, list(range(start, start + 33)))
                await eventually(lambda: len(second.pages()) >= 8)
                await eventually(lambda: followed.pages() == before + second.pages())
                # counted after the answer's end marker (inside: the drainer's exit closes its socket)
                await eventually(lambda: replays(metrics, "filled") >= 1, seen=lambda: outcomes(metrics))
    finally:
        zctx.destroy(linger=0)


async def test_the_history_is_bounded_and_a_catch_up_past_it_is_partial(tmp_path: Path) -> None:
    port, zctx = free_port(), zmq.asyncio.Context()
    endpoint = relay_endpoint(str(tmp_path), REPLICA)
    try:
        async with (
            aiohttp.ClientSession() as session,
            emulated(port, zctx) as replica,
            drainer(session, port, endpoint, zctx, history_bodies=2) as (drained, relay, drained_metrics),
        ):
            for start in (100, 200, 300, 400):  # one request's body relayed before the next: 4 bodies
                relayed = relay.published
                await complete(session, replica, list(range(start, start + 33)))
                await eventually(lambda before=relayed: relay.published > before)
            kept, kept_bytes = relay.kept()
            assert kept == 2 and kept_bytes > 0
            trimmed = drained_metrics.registry.get_sample_value(
                "kvlb_events_relay_history_trimmed_total", {"replica": REPLICA}
            )
            assert trimmed == relay.published - 2
            async with follower(endpoint, zctx) as (followed, _, metrics):
                await eventually(lambda: replays(metrics, "partial") >= 1)
                await eventually(lambda: len(followed.pages()) > 0)
                assert set(followed.pages()) < set(drained.pages())  # only the newest bodies
                assert followed.pages() == drained.pages()[-len(followed.pages()) :]
    finally:
        zctx.destroy(linger=0)
