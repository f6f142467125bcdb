"""The health prober against a real HTTP server on 127.0.0.1: a probe that times out once leaves the
replica routable, two in a row take it out, a 503 or a refused connection take it out at once, and
a good probe puts it back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from balancer.health.book import BreakerConfig, HealthBook
from balancer.health.prober import HealthProber, ProbeSettings
from balancer.types import ReplicaId

A = ReplicaId("a")
TIMEOUT_S = 0.2
"""The probe timeout where a probe is meant to time out (a ``slow`` replica does not answer)."""
PATIENT_S = 10.0
"""The probe timeout where a probe is meant to pass or fail on its answer: on a loaded 2-core CI
machine a good probe once took over 0.2 s (2026-12-01), which made it a timeout."""


class Scripted:
    """A replica whose ``/health`` answers as told: ``ok``, ``slow`` (past the probe's timeout) or
    ``503``."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def health(self, request: web.Request) -> web.Response:
        if self.mode == "slow":
            await asyncio.sleep(PATIENT_S * 3)  # past every timeout here; cancelled at stop
        return web.Response(status=503 if self.mode == "503" else 200)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def replica() -> AsyncIterator[Scripted]:
    made = Scripted()
    try:
        yield made
    finally:
        await made.stop()


async def test_timeouts_503_and_refusals(replica: Scripted) -> None:
    url = await replica.start()
    health = HealthBook(BreakerConfig(failure_threshold=10, probe_timeouts_to_drop=2))
    health.add(A)
    async with aiohttp.ClientSession() as session:
        # two probers of one replica and one health book: ``quick`` for the probes meant to time
        # out, ``prober`` for those judged on their answer
        quick, prober = (
            HealthProber(
                A,
                url,
                session=session,
                health=health,
                settings=ProbeSettings(interval_s=1.0, timeout_s=timeout_s),
            )
            for timeout_s in (TIMEOUT_S, PATIENT_S)
        )
        assert await prober.probe_once() and health.routable(0.0) == [A]
        replica.mode = "slow"
        assert not await quick.probe_once()
        assert health.routable(0.0) == [A]  # one timeout: kept
        assert not await quick.probe_once()
        assert health.routable(0.0) == []  # two in a row: out
        replica.mode = "ok"
        assert await prober.probe_once() and health.routable(0.0) == [A]
        replica.mode = "503"
        assert not await prober.probe_once() and health.routable(0.0) == []
        replica.mode = "ok"
        assert await prober.probe_once() and health.routable(0.0) == [A]
        await replica.stop()  # nothing listens: refused
        assert not await prober.probe_once() and health.routable(0.0) == []
        assert health.replicas[A].probe_timeouts == 0


class Watch:
    """Records what the prober tells the replica's event sources (the ingest's side of the seam)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def engine_gone(self, replica: ReplicaId, why: str) -> None:
        self.calls.append(f"gone {replica}: {why}")

    def engine_back(self, replica: ReplicaId) -> None:
        self.calls.append(f"back {replica}")


async def test_the_engine_watch_hears_of_nothing_listening_once_and_of_the_next_good_probe(
    replica: Scripted,
) -> None:
    """A refused connection is the engine gone (said once per spell); a timeout or a 503 is not (an
    engine that is there, hung or unhealthy); the first good probe after it says it is back."""
    url = await replica.start()
    health = HealthBook(BreakerConfig(failure_threshold=10, probe_timeouts_to_drop=1))
    health.add(A)
    watch = Watch()
    async with aiohttp.ClientSession() as session:
        prober = HealthProber(
            A,
            url,
            session=session,
            health=health,
            # its good probes must pass on a loaded machine, its one timeout costs this
            settings=ProbeSettings(interval_s=1.0, timeout_s=1.0),
            engine_watch=watch,
        )
        assert await prober.probe_once()
        replica.mode = "slow"
        assert not await prober.probe_once()
        replica.mode = "503"
        assert not await prober.probe_once()
        assert watch.calls == []
        await replica.stop()
        assert not await prober.probe_once()
        assert not await prober.probe_once()
        assert watch.calls == ["gone a: its health probe: /health: ClientConnectorError"]
        replica.mode = "ok"
        await replica.start()
        assert await prober.probe_once()
        assert await prober.probe_once()
        assert watch.calls[1:] == ["back a"]
