"""MetricsScraper against real aiohttp servers on 127.0.0.1, feeding a real LoadTracker."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from waiting import eventually

from balancer.engines.registry import engine_spec
from balancer.engines.sglang_load import parse_sglang_prometheus
from balancer.engines.vllm import parse_vllm_prometheus
from balancer.load.scraper import MetricsScraper, ScrapeSettings
from balancer.load.tracker import LoadTracker
from balancer.metrics import Metrics
from balancer.types import ReplicaId

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
SGLANG_TEXT = (FIXTURES / "sglang-0.5.23-cpu.txt").read_text()
VLLM_TEXT = (FIXTURES / "vllm-0.32.0-cpu.txt").read_text()
REPLICA = ReplicaId("r0")
FAST = ScrapeSettings(interval_s=0.02, timeout_s=0.3)


class FakeEngine:
    """Serves canned bodies per path and counts hits; a path maps to (status, body) or a callable."""

    def __init__(self, routes: dict[str, Callable[[], tuple[int, str]]]) -> None:
        self.routes = routes
        self.hits: dict[str, int] = {}
        self.delay_s = 0.0
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        route = self.routes.get(request.path)
        if route is None:
            raise web.HTTPNotFound()
        status, body = route()
        return web.Response(status=status, text=body)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def serve(routes: dict[str, Callable[[], tuple[int, str]]]) -> tuple[FakeEngine, str]:
    engine = FakeEngine(routes)
    return engine, await engine.start()


def scraper_for(
    url: str, engine: str, session: aiohttp.ClientSession, tracker: LoadTracker, metrics: Metrics
) -> MetricsScraper:
    return MetricsScraper(
        REPLICA,
        url,
        engine,
        engine_spec(engine).scrape_targets,
        session=session,
        observe=tracker.observe,
        metrics=metrics,
        settings=FAST,
    )


async def test_sglang_falls_back_from_v1_loads_to_metrics(session: aiohttp.ClientSession) -> None:
    engine, url = await serve({"/metrics": lambda: (200, SGLANG_TEXT)})
    try:
        tracker, metrics = LoadTracker(), Metrics.create()
        scraper = scraper_for(url, "sglang", session, tracker, metrics)
        first = await scraper.scrape_and_observe()
        second = await scraper.scrape_and_observe()
        assert first == second == parse_sglang_prometheus(SGLANG_TEXT)
        assert engine.hits == {"/v1/loads": 1, "/metrics": 2}  # the 404 is remembered
        assert scraper.status().url == url + "/metrics"
        load = tracker.snapshot(time.monotonic()).of(REPLICA)
        assert (load.running_reqs, load.waiting_reqs, load.kv_usage) == (
            first.running_reqs,
            first.waiting_reqs,
            first.kv_usage,
        )
    finally:
        await engine.stop()


async def test_sglang_v1_loads_preferred(session: aiohttp.ClientSession) -> None:
    body = json.dumps(
        {"loads": [{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 4, "token_usage": 0.5}]}
    )
    engine, url = await serve({"/v1/loads": lambda: (200, body), "/metrics": lambda: (200, SGLANG_TEXT)})
    try:
        tracker, metrics = LoadTracker(), Metrics.create()
        await scraper_for(url, "sglang", session, tracker, metrics).scrape_and_observe()
        load = tracker.snapshot(time.monotonic()).of(REPLICA)
        assert (load.running_reqs, load.waiting_reqs, load.kv_usage) == (3, 4, 0.5)
        assert "/metrics" not in engine.hits
    finally:
        await engine.stop()


async def test_vllm_metrics(session: aiohttp.ClientSession) -> None:
    engine, url = await serve({"/metrics": lambda: (200, VLLM_TEXT)})
    try:
        tracker, metrics = LoadTracker(), Metrics.create()
        got = await scraper_for(url, "vllm", session, tracker, metrics).scrape_and_observe()
        assert got == parse_vllm_prometheus(VLLM_TEXT)
    finally:
        await engine.stop()


async def test_trtllm_iteration_stats_drain(session: aiohttp.ClientSession) -> None:
    drains = [
        [{"iter": 1, "numActiveRequests": 5, "numQueuedRequests": 2,
          "kvCacheStats": {"maxNumBlocks": 100, "usedNumBlocks": 30, "tokensPerBlock": 32}}],
        [],
    ]  # fmt: skip
    engine, url = await serve({"/metrics": lambda: (200, json.dumps(drains.pop(0)))})
    try:
        tracker, metrics = LoadTracker(), Metrics.create()
        scraper = scraper_for(url, "trtllm", session, tracker, metrics)
        busy = await scraper.scrape_and_observe()
        assert busy is not None and (busy.running_reqs, busy.waiting_reqs, busy.kv_usage) == (5, 2, 0.3)
        idle = await scraper.scrape_and_observe()  # empty drain: no iteration ran, nothing in flight
        assert idle is not None and (idle.running_reqs, idle.waiting_reqs, idle.kv_usage) == (0, 0, None)
        assert tracker.snapshot(time.monotonic()).of(REPLICA).running_reqs == 0
    finally:
        await engine.stop()


async def test_errors_are_counted_and_the_loop_goes_on(session: aiohttp.ClientSession) -> None:
    answers = [(500, "boom"), (200, "garbage that is not prometheus"), (200, VLLM_TEXT)]
    engine, url = await serve({"/metrics": lambda: answers.pop(0) if len(answers) > 1 else answers[0]})
    try:
        tracker, metrics = LoadTracker(), Metrics.create()
        scraper = scraper_for(url, "vllm", session, tracker, metrics)
        task = asyncio.create_task(scraper.run())
        try:
            await eventually(lambda: scraper.status().last is not None)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert metrics.registry.get_sample_value("kvlb_scrape_errors_total", {"replica": REPLICA}) == 2
        assert scraper.status().errors == 2 and scraper.status().last_error is None
    finally:
        await engine.stop()


async def test_timeout_and_connection_refused_count_as_errors(session: aiohttp.ClientSession) -> None:
    engine, url = await serve({"/metrics": lambda: (200, VLLM_TEXT)})
    engine.delay_s = 1.0
    try:
        tracker, metrics = LoadTracker(), Metrics.create()
        slow = scraper_for(url, "vllm", session, tracker, metrics)
        assert await slow.scrape_and_observe() is None
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        gone = scraper_for(f"http://127.0.0.1:{port}", "vllm", session, tracker, metrics)
        assert await gone.scrape_and_observe() is None
        assert metrics.registry.get_sample_value("kvlb_scrape_errors_total", {"replica": REPLICA}) == 2
        assert tracker.snapshot(time.monotonic()).of(REPLICA).running_reqs is None
    finally:
        await engine.stop()


async def test_out_of_range_figures_are_counted_logged_once_and_kept_in_the_status(
    session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A trtllm ``/metrics`` drain with a negative queue, three times (branch h-gauges): each counted,
    one warning (the log limiter holds the next two back), the last in the status; the running
    count of the same report reaches the tracker."""
    drain = [{"numActiveRequests": 4, "numQueuedRequests": -3, "kvCacheStats": {"usedNumBlocks": 1}}]
    engine, url = await serve({"/metrics": lambda: (200, json.dumps(drain))})
    try:
        tracker, metrics = LoadTracker(), Metrics.create()
        scraper = scraper_for(url, "trtllm", session, tracker, metrics)
        caplog.set_level("WARNING", logger="balancer.load.scraper")
        for _ in range(3):
            load = await scraper.scrape_and_observe()
            assert load is not None and load.waiting_reqs is None and load.running_reqs == 4
        labels = {"replica": REPLICA, "reason": "negative"}
        assert metrics.registry.get_sample_value("kvlb_scrape_rejected_values_total", labels) == 3
        held = metrics.registry.get_sample_value(
            "kvlb_log_suppressed_total", {"cause": "scrape_rejected_value"}
        )
        assert held == 2
        warnings = [r.getMessage() for r in caplog.records if "out of range" in r.getMessage()]
        assert warnings == [
            "replica r0: load report figures out of range, read as unknown: numQueuedRequests -3.0 (negative)"
        ]
        status = scraper.status()
        assert status.errors == 0 and status.rejected_values == 3 and status.last_rejection is not None
        assert (status.last_rejection.gauge, status.last_rejection.reason) == (
            "numQueuedRequests",
            "negative",
        )
        observed = tracker.snapshot(time.monotonic()).of(REPLICA)
        assert observed.running_reqs == 4 and observed.waiting_reqs is None
    finally:
        await engine.stop()
