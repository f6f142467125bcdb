"""Discovery wired into the running service: a real :class:`~balancer.app.Balancer` adds and removes
replicas found by Kubernetes discovery (the fake API server on 127.0.0.1) and, with Redis, by file
discovery (a real ``redis-server``). The replicas are the real emulator on real sockets.

Checked: a discovered replica becomes routable, serves a request and its KV events reach the index;
once it leaves, it is out of ``/admin/replicas``, its blocks are gone from the index, its per-replica
tasks are stopped, and requests keep succeeding on the static replica. With Redis, the balancer that
held the discovered replica's ingestion lease releases it. A request still in flight on a replica when
it leaves brings none of its series back into ``/metrics`` (nor its receipt window into the router)
when it ends: with pods renamed at each rollout, that was one set of series per removed replica.
"""

from __future__ import annotations

import asyncio
import copy
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml
import zmq.asyncio
from fake_kube_api import NAMESPACE, PODS, SLICES, FakeKubeApi, fixture, serving
from kvlb_harness import (
    MODEL,
    metric_value,
    replica_entry,
    settings_for,
    shared_deepseek,
    wait_for,
    wait_ready,
)
from redis_server import RedisServer

from balancer.app import Balancer
from balancer.fleet.runtime import space_name
from balancer.index.redis.schema import RedisIndexSettings, RedisKeys
from balancer.types import ReplicaId
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

PROMPT = list(range(3000, 3032))
"""32 token ids: 8 full blocks of the emulator's 4-token pages."""


@dataclass
class Setup:
    static: Replica
    extra: Replica
    balancer: Balancer
    session: aiohttp.ClientSession

    async def get(self, path: str) -> Any:
        async with self.session.get(self.balancer.url + path) as response:
            assert response.status == 200, await response.text()
            return await response.json() if path != "/metrics" else await response.text()

    async def views(self) -> dict[str, dict[str, Any]]:
        return {v["id"]: v for v in (await self.get("/admin/replicas"))["replicas"]}

    async def complete(self, suffix: list[int]) -> str:
        body = {"model": MODEL, "prompt": PROMPT + suffix, "max_tokens": 2, "temperature": 0}
        async with self.session.post(self.balancer.url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            await response.read()
            return response.headers["x-kvlb-replica"]

    async def drain(self, replica: str, on: bool) -> None:
        verb = "drain" if on else "undrain"
        async with self.session.post(f"{self.balancer.url}/admin/replicas/{replica}/{verb}") as response:
            assert response.status == 200, await response.text()

    async def held_blocks(self) -> float:
        return metric_value(await self.get("/metrics"), "kvlb_index_blocks", kind="held")


@asynccontextmanager
async def two_replicas(**overrides: Any) -> AsyncIterator[tuple[Replica, Replica, Any]]:
    """Replica r0 (static, in ``pools``) and r1 (for discovery to find), and the settings."""
    zctx = zmq.asyncio.Context()
    replicas: list[Replica] = []
    try:
        for index in range(2):
            config = ReplicaConfig(name=f"r{index}", engine="sglang", profile=get_profile("cpu-test"))
            replica = Replica(config, shared_deepseek(), zctx)
            await replica.start()
            replicas.append(replica)
        # no speculative entries: only the engines' events fill the index
        settings = settings_for(replicas[:1], limits__speculative_ttl_s=0.001, **overrides)
        yield replicas[0], replicas[1], settings
    finally:
        for replica in reversed(replicas):
            await replica.stop()
        zctx.destroy(linger=0)


@asynccontextmanager
async def balancer_over(static: Replica, extra: Replica, settings: Any) -> AsyncIterator[Setup]:
    balancer = Balancer(settings, tokenizers={MODEL: shared_deepseek()})
    try:
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)
            yield Setup(static, extra, balancer, session)
    finally:
        await balancer.stop()


async def serve_on_discovered(setup: Setup) -> None:
    """r1 is routable: with r0 drained a request goes to r1, and r1's events reach the index."""

    async def routable() -> bool:
        view = (await setup.views()).get("r1")
        return view is not None and view["routable"]

    await wait_for("r1 listed and routable", routable, timeout_s=10)
    await setup.drain("r0", True)
    assert await setup.complete([1, 2, 3]) == "r1"

    async def indexed() -> bool:
        return int((await setup.views())["r1"]["index"]["blocks"]) >= 8

    await wait_for("r1's 8 blocks in the index", indexed)
    assert await setup.held_blocks() >= 8


async def check_removed(setup: Setup) -> None:
    """r1 is gone everywhere; r0 serves again."""

    state = setup.balancer.state
    lifecycle = setup.balancer.replicas
    assert state is not None and lifecycle is not None
    r1 = ReplicaId("r1")
    router = state.pools[MODEL].router

    async def gone() -> bool:
        # Routing stops at the first step of the teardown; the router's tables are the last.
        return "r1" not in await setup.views() and r1 not in router.space_of

    await wait_for("r1 removed from /admin/replicas and the router", gone, timeout_s=10)
    assert await setup.held_blocks() == 0  # r0 was drained: every held block was r1's
    assert r1 not in router.space_of and r1 not in state.health.replicas and r1 not in state.scrapers
    assert r1 not in state.ingest_status() and r1 not in lifecycle.discovered
    assert all(r1 not in s.table.stats().blocks_by_replica for s in router.spaces.values())
    await setup.drain("r0", False)
    await wait_ready(setup.session, setup.balancer.url)
    for i in range(3):
        assert await setup.complete([50 + i]) == "r0"


# ------------------------------------------------------------------------------------- Kubernetes


def engine_pod(replica: Replica, uid: str) -> dict[str, Any]:
    """The pod of an emulated replica on 127.0.0.1, its ports in the kvlb.io/ annotations."""
    info = replica.describe()
    pod = fixture("pod-sglang-0.json")
    pod["metadata"].update(name=replica.config.name, uid=uid)
    pod["metadata"]["annotations"] = {
        "kvlb.io/engine": "sglang",
        "kvlb.io/model": MODEL,
        "kvlb.io/block-size": str(replica.config.block_size),
        "kvlb.io/port": replica.url.rsplit(":", 1)[1],
        "kvlb.io/event-port": info["events"][0].rsplit(":", 1)[1],
        "kvlb.io/replay-port": info["replay"][0].rsplit(":", 1)[1],
    }
    pod["status"]["podIP"] = "127.0.0.1"
    pod["status"]["podIPs"] = [{"ip": "127.0.0.1"}]
    return pod


def engine_slice(*pods: tuple[str, str]) -> dict[str, Any]:
    """The fixture EndpointSlice with one ready endpoint on 127.0.0.1 per ``(pod, uid)``."""
    slice_obj = fixture("endpointslice-sglang.json")
    template = slice_obj["endpoints"][0]
    slice_obj["endpoints"] = []
    for name, uid in pods:
        endpoint = copy.deepcopy(template)
        endpoint["addresses"] = ["127.0.0.1"]
        endpoint["targetRef"].update(name=name, uid=uid)
        slice_obj["endpoints"].append(endpoint)
    return slice_obj


async def test_kubernetes_discovery_adds_then_removes_a_replica() -> None:
    async with serving(FakeKubeApi(token=None)) as kube:
        discovery = {
            "discovery__kind": "kubernetes",
            "discovery__namespace": NAMESPACE,
            "discovery__api_url": kube.url,
            "discovery__backoff_max_s": 0.2,
        }
        async with (
            two_replicas(**discovery) as (static, extra, settings),
            balancer_over(static, extra, settings) as setup,
        ):
            assert "r1" not in await setup.views()
            kube.put(PODS, engine_pod(extra, "uid-r1"))
            kube.put(SLICES, engine_slice(("r1", "uid-r1")))
            await serve_on_discovered(setup)
            kube.put(SLICES, engine_slice())  # the pod left the Service
            await check_removed(setup)
            assert setup.balancer.replicas is not None
            assert setup.balancer.replicas.discovery is not None
            assert setup.balancer.replicas.discovery.status()["removed"] == 1
            scraped = await setup.get("/metrics")  # the caps of the objects it keeps, exported
            assert 'kvlb_discovery_objects_over_cap_total{bound="count"} 0.0' in scraped
            assert 'kvlb_discovery_objects_over_cap_total{bound="bytes"} 0.0' in scraped


async def test_a_request_ending_after_its_replica_left_brings_back_no_series(tmp_path: Path) -> None:
    """r1 is removed by file discovery while a request routed to it waits in its stalled engine; the
    request then ends (200, with its usage): its counters go under ``replica="(removed)"`` and no
    series names r1 again (before the fix: 61 came back per replica so removed, in the churn soak)."""
    replica_file = tmp_path / "replicas.yaml"
    discovery = {
        "discovery__kind": "file",
        "discovery__file": str(replica_file),
        "discovery__reload_interval_s": 0.1,
    }
    async with (
        two_replicas(**discovery) as (static, extra, settings),
        balancer_over(static, extra, settings) as setup,
    ):
        replica_file.write_text(
            yaml.safe_dump({"pools": [{"model": MODEL, "replicas": [replica_entry(extra)]}]})
        )
        await serve_on_discovered(setup)
        async with setup.session.post(extra.url + "/admin/faults", json={"stall_s": 4.0}) as response:
            assert response.status == 200, await response.text()
        request = asyncio.create_task(setup.complete([7, 8, 9]))

        async def in_flight() -> bool:
            return await _open_requests(setup, extra) > 0

        await wait_for("a request waiting on r1", in_flight)
        replica_file.write_text("pools: []\n")
        router = setup.balancer.state.pools[MODEL].router if setup.balancer.state else None
        assert router is not None

        async def removed() -> bool:
            return ReplicaId("r1") not in router.space_of and not re.search(
                r'replica="r1"', await setup.get("/metrics")
            )

        await wait_for("r1 removed, its series gone", removed, timeout_s=10)
        assert not request.done()  # still waiting in the stalled engine
        assert await request == "r1"
        text = await setup.get("/metrics")
        assert not re.search(r'replica="r1"', text), [
            line for line in text.splitlines() if 'replica="r1"' in line
        ]
        assert metric_value(text, "kvlb_http_requests_total", replica="(removed)", status="200") == 1
        assert router.receipts.stats(ReplicaId("r1")).receipts == 0
        await check_removed(setup)


async def _open_requests(setup: Setup, replica: Replica) -> int:
    async with setup.session.get(replica.url + "/admin/stats") as response:
        return int((await response.json())["open_requests"])


# ------------------------------------------------------------------------------------- Redis fleet


@pytest.mark.redis
async def test_fleet_releases_the_lease_of_a_removed_replica(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    replica_file = tmp_path / "replicas.yaml"
    fast = {"redis__lease_ttl_s": 1.5, "redis__tick_s": 0.25, "redis__policy_poll_s": 0.25}
    discovery = {
        "discovery__kind": "file",
        "discovery__file": str(replica_file),
        "discovery__reload_interval_s": 0.1,
    }
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    async with two_replicas(redis__url=redis_server.url, **fast, **discovery) as (static, extra, settings):
        keys = RedisKeys(
            RedisIndexSettings(
                pool=space_name(MODEL, extra.config.block_size, "plain"), key_prefix=settings.redis.key_prefix
            )
        )
        async with balancer_over(static, extra, settings) as setup:
            fleet = setup.balancer.fleet
            assert fleet is not None
            replica_file.write_text(
                yaml.safe_dump({"pools": [{"model": MODEL, "replicas": [replica_entry(extra)]}]})
            )

            async def leased() -> bool:
                return "r1" in fleet.status()["leases"]

            await wait_for("this balancer to take r1's lease", leased, timeout_s=10)
            assert await client.get(keys.lease("r1")) == fleet.instance
            await serve_on_discovered(setup)
            replica_file.write_text("pools: []\n")
            await check_removed(setup)
            assert "r1" not in fleet.status()["leases"]
            assert await client.get(keys.lease("r1")) is None
            assert await client.get(keys.lease("r0")) == fleet.instance  # the static one is untouched
    await client.aclose()


# ------------------------------------------------------------------------------------------- File


async def test_a_siblings_drain_of_a_replica_not_discovered_yet_applies_when_it_comes(tmp_path: Path) -> None:
    """With ``--workers N`` each worker discovers replicas on its own: a drain taken by a worker that
    already knows a new replica is replayed (``x-kvlb-sibling``) to one that does not yet. Before
    2026-12-01 that worker answered 404 and then added the replica undrained, and kept routing to it
    (seen in the runtime walk). Now it keeps the drain and the replica arrives drained."""
    listed = tmp_path / "replicas.yaml"
    listed.write_text("pools: []\n")
    overrides = {
        "discovery__kind": "file",
        "discovery__file": str(listed),
        "discovery__reload_interval_s": 0.1,
    }
    async with (
        two_replicas(**overrides) as (static, extra, settings),
        balancer_over(static, extra, settings) as setup,
    ):
        url = f"{setup.balancer.url}/admin/replicas/r1/drain"
        async with setup.session.post(url, headers={"x-kvlb-sibling": "1"}) as response:
            assert response.status == 200, await response.text()
        fresh = tmp_path / "replicas.yaml.new"
        fresh.write_text(yaml.safe_dump({"pools": [{"model": MODEL, "replicas": [replica_entry(extra)]}]}))
        fresh.replace(listed)

        async def listed_r1() -> bool:
            return "r1" in await setup.views()

        await wait_for("r1 discovered", listed_r1, timeout_s=10)
        r1 = (await setup.views())["r1"]
        assert r1["health"]["draining"] and not r1["routable"], r1
        assert r1["health"]["drain"]["by"] == "admin", r1
