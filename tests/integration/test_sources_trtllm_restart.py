"""A TRT-LLM engine that goes down and comes back, against the emulator's TRT-LLM personality over
real HTTP (``replicas.sim``) and the real ``TrtllmPoller``: its blocks are dropped as soon as a drain
is refused (the process is gone, its cache with it), before any new process exists; it is logged as
disconnected, then as restarted once the new process's ``created`` burst arrives."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import zmq.asyncio
from emulated_replica import started
from procs_free import free_port
from recording_index import RecordingIndex
from unstalled import Unstalled
from waiting import eventually

from balancer.engines.trtllm import SPEC as TRTLLM_SPEC
from balancer.engines.trtllm import TrtllmDecoder
from balancer.events import Resync, Stored
from balancer.metrics import Metrics
from balancer.sources.pipeline import EventIngest
from balancer.sources.trtllm_poll import PollSettings, TrtllmPoller
from balancer.sources.trtllm_relay import RelayPublisher, RelaySource, relay_endpoint
from balancer.types import ReplicaId
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

TRTLLM_DRAIN_PATH = TRTLLM_SPEC.drain_path or ""

REPLICA = ReplicaId("trt-0")
TPB = 8
FAST = PollSettings(
    min_interval_s=0.005, max_interval_s=0.05, error_backoff_initial_s=0.02, error_backoff_max_s=0.1
)
LOGGER = "balancer.sources.trtllm_poll"


@contextlib.asynccontextmanager
async def emulated(port: int, zctx: zmq.asyncio.Context) -> AsyncIterator[Replica]:
    config = ReplicaConfig(
        name="trt",
        engine="trtllm",
        profile=get_profile("cpu-test"),
        time_scale=20.0,
        page_size=TPB,
        http_port=port,
    )
    async with started(config, zctx) as replica:
        yield replica


def emulated_poller(
    session: aiohttp.ClientSession, port: int, metrics: Metrics, tap: RelayPublisher | None = None
) -> TrtllmPoller:
    """The poller of the emulated engine on ``port`` (:data:`FAST` polls), relaying to ``tap``."""
    return TrtllmPoller(
        REPLICA,
        f"http://127.0.0.1:{port}",
        path=TRTLLM_DRAIN_PATH,
        session=session,
        decoder=TrtllmDecoder(tokens_per_block=TPB),
        metrics=metrics,
        settings=FAST,
        tap=tap,
    )


async def complete(session: aiohttp.ClientSession, replica: Replica, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    async with session.post(replica.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


async def test_a_refused_drain_drops_the_engines_blocks_at_once_then_the_restart_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    port = free_port()
    zctx = zmq.asyncio.Context()
    metrics, index = Metrics.create(), RecordingIndex(REPLICA)
    try:
        async with aiohttp.ClientSession() as session:
            poller = emulated_poller(session, port, metrics)
            ingest = EventIngest(index, metrics=metrics)  # type: ignore[arg-type]
            ingest.add_replica(REPLICA, "trtllm", [poller])
            await ingest.start()
            try:
                async with emulated(port, zctx) as replica:
                    await complete(session, replica, list(range(100, 133)))
                    await eventually(lambda: any(isinstance(e, Stored) for e in index.events))
                stopped = Unstalled()  # the process is gone: nothing listens on its port
                await eventually(lambda: Resync(0, "disconnect") in index.events)
                dropped_after_s = stopped.seconds()  # a loaded machine's stall of this loop not counted
                messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
                assert any("disconnected" in m for m in messages), messages
                assert not any("restarted" in m for m in messages), messages
                assert dropped_after_s < 1.0
                assert (
                    metrics.registry.get_sample_value("kvlb_events_disconnects_total", {"replica": REPLICA})
                    == 1
                )
                seen = len(index.events)
                async with emulated(port, zctx) as replica:  # a new process on the same port
                    await complete(session, replica, list(range(200, 233)))
                    await eventually(lambda: any(isinstance(e, Stored) for e in index.events[seen:]))
                new = index.events[seen:]
                assert new[0] == Resync(0, "restart")  # the new process's ``created`` burst
                messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
                assert sum("restarted" in m for m in messages) == 1, messages
            finally:
                await ingest.aclose()
    finally:
        zctx.destroy(linger=0)


async def test_a_relay_follower_drops_the_engines_blocks_with_the_drainer(tmp_path: Path) -> None:
    """``kvlb serve --workers N``: worker 0 drains and relays; when its drain is refused the other
    workers (``RelaySource``) drop the same ranks at once, then take the new process's burst."""
    port = free_port()
    zctx = zmq.asyncio.Context()
    metrics, index, followed = Metrics.create(), RecordingIndex(REPLICA), RecordingIndex(REPLICA)
    endpoint = relay_endpoint(str(tmp_path), REPLICA)
    try:
        async with aiohttp.ClientSession() as session:
            poller = emulated_poller(
                session, port, metrics, tap=RelayPublisher(endpoint, zctx, replica=REPLICA, metrics=metrics)
            )
            follower = RelaySource(
                REPLICA,
                endpoint,
                ctx=zctx,
                decoder=TrtllmDecoder(tokens_per_block=TPB),
                metrics=Metrics.create(),
                max_message_bytes=1 << 20,
            )
            ingest = EventIngest(index, metrics=metrics)  # type: ignore[arg-type]
            ingest.add_replica(REPLICA, "trtllm", [poller])
            other = EventIngest(followed, metrics=Metrics.create())  # type: ignore[arg-type]
            other.add_replica(REPLICA, "trtllm", [follower])
            await other.start()
            await ingest.start()
            try:
                async with emulated(port, zctx) as replica:
                    await complete(session, replica, list(range(100, 133)))
                    await eventually(lambda: any(isinstance(e, Stored) for e in followed.events))
                await eventually(lambda: Resync(0, "disconnect") in followed.events)
                assert Resync(0, "disconnect") in index.events
                assert follower.status().resyncs >= 1
                seen = len(followed.events)
                async with emulated(port, zctx) as replica:
                    await complete(session, replica, list(range(200, 233)))
                    await eventually(lambda: any(isinstance(e, Stored) for e in followed.events[seen:]))
                assert followed.events[seen] == Resync(0, "restart")
            finally:
                await ingest.aclose()
                await other.aclose()
    finally:
        zctx.destroy(linger=0)
