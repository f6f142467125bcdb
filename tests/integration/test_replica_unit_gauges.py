"""The per-unit replica load gauges (``kvlb_replica_inflight_seqs``, ...) on a live emulated fleet: a
real :class:`~balancer.app.Balancer` in front of two emulated SGLang replicas on 127.0.0.1, its
``/metrics`` scraped over HTTP. Nothing is mocked.

Checked: every figure of the deprecated ``kvlb_replica_load{kind}`` has its gauge named by its unit,
with the same value, while a request is in flight (engine stalled: queued in the engine, not at its
first token); and a replica that leaves its pool (file discovery) takes the series of both away, also
when it leaves between two steps of a scrape's refresh (``balancer.api.http.refresh_steps``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
import zmq.asyncio
from kvlb_harness import MODEL, replica_entry, settings_for, shared_deepseek, wait_for, wait_ready
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from balancer.api import http
from balancer.app import Balancer
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

DEPRECATED = "kvlb_replica_load"
BY_UNIT = {
    "inflight": "kvlb_replica_inflight_seqs",
    "peer_inflight": "kvlb_replica_peer_inflight_seqs",
    "pending_prefill_tokens": "kvlb_replica_pending_prefill_tokens",
    "decode_blocks": "kvlb_replica_decode_blocks",
    "waiting": "kvlb_replica_waiting_seqs",
    "kv_usage": "kvlb_replica_kv_usage_ratio",
}
"""Each kind of the deprecated gauge and the metric that replaces it (written out here, not taken from
``balancer.metrics``, so a wrong table there fails)."""
STALL_S = 0.6
TIME_SCALE = 4.0
"""The emulator's steps 4 times slower: the request's 64 tokens decode for about half a second."""
PROMPT = list(range(4000, 4040))
"""40 token ids: 10 blocks of the emulator's 4-token pages."""


def load_figures(text: str) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    """``(replica, kind) → value`` of the deprecated gauge, and of the per-unit gauges (by the kind
    each replaces), in one ``/metrics`` text."""
    old: dict[tuple[str, str], float] = {}
    new: dict[tuple[str, str], float] = {}
    kind_of = {name: kind for kind, name in BY_UNIT.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == DEPRECATED:
                old[(sample.labels["replica"], sample.labels["kind"])] = sample.value
            elif sample.name in kind_of:
                assert set(sample.labels) == {"replica"}, sample
                new[(sample.labels["replica"], kind_of[sample.name])] = sample.value
    return old, new


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path) -> AsyncIterator[tuple[Balancer, aiohttp.ClientSession, Path, Replica]]:
    """r0 in the pool's settings, r1 for file discovery to find (the file yielded, empty at first)."""
    zctx = zmq.asyncio.Context()
    replicas: list[Replica] = []
    balancer: Balancer | None = None
    replica_file = tmp_path / "replicas.yaml"
    replica_file.write_text("pools: []\n")
    try:
        for index in range(2):
            config = ReplicaConfig(
                name=f"r{index}", engine="sglang", profile=get_profile("cpu-test"), time_scale=TIME_SCALE
            )
            replica = Replica(config, shared_deepseek(), zctx)
            await replica.start()
            replicas.append(replica)
        settings = settings_for(
            replicas[:1],
            discovery__kind="file",
            discovery__file=str(replica_file),
            discovery__reload_interval_s=0.1,
            scrape_interval_s=0.1,
        )
        balancer = Balancer(settings, tokenizers={MODEL: shared_deepseek()})
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)
            yield balancer, session, replica_file, replicas[1]
    finally:
        if balancer is not None:
            await balancer.stop()
        for replica in reversed(replicas):
            await replica.stop()
        zctx.destroy(linger=0)


async def test_the_unit_gauges_carry_the_load_figures_and_leave_with_their_replica(tmp_path: Path) -> None:
    async with fleet(tmp_path) as (balancer, session, replica_file, r1):

        async def get(path: str) -> Any:
            async with session.get(balancer.url + path) as response:
                assert response.status == 200, await response.text()
                return await response.json() if path != "/metrics" else await response.text()

        async def post(url: str, body: Any) -> None:
            async with session.post(url, json=body) as response:
                assert response.status == 200, await response.text()
                await response.read()

        replica_file.write_text(
            yaml.safe_dump({"pools": [{"model": MODEL, "replicas": [replica_entry(r1)]}]})
        )

        async def routable() -> bool:
            views = {v["id"]: v for v in (await get("/admin/replicas"))["replicas"]}
            return "r1" in views and views["r1"]["routable"]

        await wait_for("r1 discovered and routable", routable, timeout_s=10)
        await post(balancer.url + "/admin/replicas/r0/drain", {})  # every request goes to r1
        await post(r1.url + "/admin/faults", {"stall_s": STALL_S})
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 64, "n": 2, "temperature": 0, "stream": True}
        request = asyncio.create_task(post(balancer.url + "/v1/completions", body))
        try:
            seen: dict[str, tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]] = {}

            async def loaded() -> bool:
                # the request held on r1 and the engine's queue scraped: every kind but peer_inflight
                text = await get("/metrics")
                seen["last"] = old, _ = load_figures(text)
                return old.get(("r1", "inflight")) == 2 and old.get(("r1", "waiting"), 0) > 0

            await wait_for("a request of n = 2 in flight on r1 and in its engine's queue", loaded)
            old, new = seen["last"]
            assert new == old
            assert {kind for replica, kind in old if replica == "r1"} == set(BY_UNIT) - {"peer_inflight"}
            assert {kind for replica, kind in old if replica == "r0"} == set(BY_UNIT) - {"peer_inflight"}
            assert old[("r1", "pending_prefill_tokens")] == len(PROMPT), old
            assert 0 <= old[("r1", "kv_usage")] <= 1, old

            async def decoding() -> bool:
                text = await get("/metrics")
                seen["last"] = old, _ = load_figures(text)
                return old.get(("r1", "decode_blocks"), 0) > 0

            await wait_for("the request decoding on r1", decoding, timeout_s=STALL_S + 5)
            old, new = seen["last"]
            assert new == old and old[("r1", "pending_prefill_tokens")] == 0, old
            await request
        finally:
            if not request.done():
                request.cancel()
            await asyncio.gather(request, return_exceptions=True)

        old, new = load_figures(await get("/metrics"))
        assert new == old and old[("r1", "inflight")] == 0, old

        replica_file.write_text("pools: []\n")

        state = balancer.state
        assert state is not None
        router = state.pools[MODEL].router

        async def removed() -> bool:  # its teardown's last step: the router's tables
            listed = {v["id"] for v in (await get("/admin/replicas"))["replicas"]}
            return "r1" not in listed and "r1" not in router.space_of

        await wait_for("r1 removed", removed, timeout_s=10)
        for _ in range(2):  # and not set again by a later scrape's refresh
            old, new = load_figures(await get("/metrics"))
            assert {replica for replica, _ in old} == {"r0"}, old
            assert {replica for replica, _ in new} == {"r0"}, new
            assert new == old
            await asyncio.sleep(0.2)


async def test_a_replica_removed_between_two_steps_of_a_refresh_stays_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http, "REFRESH_STEP_REPLICAS", 1)  # a step after each replica
    async with fleet(tmp_path) as (balancer, _session, replica_file, r1):
        state = balancer.state
        assert state is not None
        pool = state.pools[MODEL]
        replica_file.write_text(
            yaml.safe_dump({"pools": [{"model": MODEL, "replicas": [replica_entry(r1)]}]})
        )

        async def listed() -> bool:
            return "r1" in pool.replicas

        await wait_for("r1 discovered", listed, timeout_s=10)
        assert list(pool.replicas) == ["r0", "r1"]
        steps = http.refresh_steps(state)
        next(steps)  # r0's gauges set; r1's next
        replica_file.write_text("pools: []\n")

        async def removed() -> bool:
            return "r1" not in pool.replicas

        await wait_for("r1 removed", removed, timeout_s=10)
        for _ in steps:
            pass
        text = generate_latest(state.metrics.registry).decode()
        assert 'replica="r0"' in text
        assert 'replica="r1"' not in text  # not set again for a replica gone meanwhile
