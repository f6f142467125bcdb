"""The fault scenarios of the suite: the replica faults of :mod:`loadtests.faults.scenarios` plus the
Redis ones (fleet mode), and the runner that starts a private ``redis-server`` for those (I/O).

The Redis scenarios run two ``kvlb serve`` sharing a ``redis-server`` (append-only file) reached
through a :class:`~loadtests.faults.tcp_proxy.DelayProxy`; the load goes to the first, every kvlb
still running is checked.
The cluster scenario runs them on a private 3-master, 3-replica Redis Cluster
(:mod:`redis_cluster`, ``redis.cluster: true``) instead.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from redis_cluster import RedisClusterProcs, start_cluster
from redis_server import RedisServer, start_server

from loadtests.bench.overhead.report import metric_value
from loadtests.faults.load import Load
from loadtests.faults.rig import FaultRig
from loadtests.faults.scenarios import (
    CONVERGE_LIMIT_S,
    FAULT_TIMEOUTS,
    MEASURE_LIMIT_S,
    REPLICA_SCENARIOS,
    Inject,
    Result,
    Scenario,
    Verify,
    run_in_fleet,
)
from loadtests.faults.tcp_proxy import DelayProxy

__all__ = ["CONVERGE_LIMIT_S", "MEASURE_LIMIT_S", "SCENARIOS", "Result", "Scenario", "run"]

FLEET_TIMING = {"lease_ttl_s": 2.0, "tick_s": 0.5, "socket_timeout_s": 1.0}
"""FaultRig mode in the suite: a dead kvlb's leases are taken over within about 2.5 s."""
TAKEOVER_LIMIT_S = FLEET_TIMING["lease_ttl_s"] + 2 * FLEET_TIMING["tick_s"]
"""How long after a SIGKILL the survivor must hold the dead kvlb's leases (3 s). The dead kvlb renewed
them at most ``tick_s`` before it died, so they expire at most ``lease_ttl_s`` after the kill (its
membership too: heartbeat and renewals share a tick), and the survivor's next tick comes at most
``tick_s`` after that; one more ``tick_s`` for a tick that runs late on a loaded machine."""


async def run(scenario: Scenario, tmp: Path, scale: float = 1.0) -> Result:
    top: dict[str, Any] = {"timeouts": dict(FAULT_TIMEOUTS)}
    if not scenario.redis:
        return await run_in_fleet(scenario, tmp, scale, top, {})
    if scenario.cluster:
        cluster = await asyncio.to_thread(start_cluster, tmp / "cluster")
        top["redis"] = {"url": cluster.url, "cluster": True, **FLEET_TIMING}
        try:
            return await run_in_fleet(scenario, tmp, scale, top, {"cluster": cluster})
        finally:
            await asyncio.to_thread(cluster.stop)
    data_dir = tmp / "redis"
    data_dir.mkdir()
    server = await asyncio.to_thread(start_server, None, data_dir)
    proxy = DelayProxy(server.port)
    await proxy.start()
    top["redis"] = {"url": f"redis://127.0.0.1:{proxy.port}/0", **FLEET_TIMING}
    context: dict[str, Any] = {"redis": server, "proxy": proxy, "redis_dir": data_dir}
    try:
        return await run_in_fleet(scenario, tmp, scale, top, context)
    finally:
        await proxy.stop()
        await asyncio.to_thread(context["redis"].stop)  # the one running now (a scenario may restart it)


# ------------------------------------------------------------------------------------ Redis faults


async def kvlb_killed(f: FaultRig, hold_s: float, load: Load) -> str:
    """SIGKILL the second kvlb (no hand-over): the first takes its leases over when they expire. The
    recovery is that takeover (the inject returns once the first holds them all, within
    :data:`TAKEOVER_LIMIT_S`): until then nobody ingests those replicas, and an index that matches
    the engines then does so by chance (block counts that happen to agree)."""
    held = await _leases(f, f.others[0].info["url"])
    f.checked = [f.url]
    f.context["taken_over"] = held
    f.context["gaps_before"] = await _gap_resyncs(f, held)
    killed_at = time.monotonic()
    await f.others[0].kill()
    while not set(held) <= set(await _leases(f, f.url)):
        waited_s = time.monotonic() - killed_at
        assert waited_s < TAKEOVER_LIMIT_S, f"kvlb-0 took {held} over not within {waited_s:.2f} s"
        await asyncio.sleep(0.05)
    takeover_s = time.monotonic() - killed_at
    return (
        f"kvlb-1 SIGKILLed holding {len(held)} lease(s): {', '.join(sorted(held)) or '-'}; "
        f"kvlb-0 held them {takeover_s:.2f} s later"
    )


async def _gap_resyncs(f: FaultRig, replicas: list[str]) -> dict[str, float]:
    """``kvlb_events_resyncs_total{reason="gap"}`` of each of ``replicas`` on the first kvlb."""
    async with f.session.get(f.url + "/metrics") as response:
        text = await response.text()
    return {r: metric_value(text, "kvlb_events_resyncs_total", replica=r, reason="gap") for r in replicas}


async def lost_at_the_kill(f: FaultRig) -> str | None:
    """Events kvlb-1 consumed and never wrote are lost for good: TRT-LLM's drain forgets what it
    returned (kvlb-1 died between a drain and its write), or SGLang's replay no longer holds them.
    The survivor then sees an event gap and resyncs the rank, and the exact match waits for the
    engine's cache to turn over (as after ``trtllm_overflow``): such a run is held to ``within``."""
    before: dict[str, float] = f.context["gaps_before"]
    after = await _gap_resyncs(f, f.context["taken_over"])
    gaps = sorted(r for r, count in after.items() if count > before[r])
    if not gaps:
        return None
    return f"{', '.join(gaps)} resynced on an event gap after the takeover (events lost at the kill)"


async def redis_restarted(f: FaultRig, hold_s: float, load: Load) -> str:
    """SIGKILL redis-server; start it again on the same port and data (append-only file)."""
    server: RedisServer = f.context["redis"]
    f.checked = [f.url, *(other.info["url"] for other in f.others)]
    await asyncio.to_thread(server.kill)
    await asyncio.sleep(hold_s)
    f.context["redis"] = await asyncio.to_thread(start_server, server.port, f.context["redis_dir"])
    return "redis-server SIGKILLed, restarted from its append-only file"


async def redis_slow(f: FaultRig, hold_s: float, load: Load) -> str:
    """Every Redis round trip delayed by 2 × 150 ms through the proxy (under the 1 s socket timeout)."""
    proxy: DelayProxy = f.context["proxy"]
    f.checked = [f.url, *(other.info["url"] for other in f.others)]
    proxy.delay_s = 0.15
    await asyncio.sleep(hold_s * 2)
    proxy.delay_s = 0.0
    return "Redis round trips +300 ms"


SGLANG_SPACE_KEY = "kvlb:{sim-test/4/plain}:ctr"
"""A key of the SGLang replicas' key space in the fault rig (slot 9294, the second master's range,
with the shared policy ``kvlb:policy``)."""
TRTLLM_SPACE_KEY = "kvlb:{sim-test/4/trtllm}:ctr"
"""A key of the TRT-LLM replica's key space (slot 14346, the third master's range, with the member
set ``kvlb:members``)."""


def kill_master(space_key: str, label: str) -> Inject:
    """SIGKILL the cluster master serving ``space_key``'s key space; the inject returns once its
    replica is promoted and every live node says ``cluster_state:ok``."""

    async def inject(f: FaultRig, hold_s: float, load: Load) -> str:
        cluster: RedisClusterProcs = f.context["cluster"]
        f.checked = [f.url, *(other.info["url"] for other in f.others)]
        before = await _stream_entries(cluster, space_key)
        killed_at = time.monotonic()
        old = await asyncio.to_thread(cluster.kill_master_of, space_key)
        new_port = await asyncio.to_thread(cluster.wait_promoted, space_key, old.port)
        promoted_s = time.monotonic() - killed_at
        f.context["promoted"] = (before, new_port)
        return (
            f"master :{old.port} of the {label} key space SIGKILLed; replica :{new_port} promoted "
            f"after {promoted_s:.2f} s (stream at entry {before})"
        )

    return inject


def followed(space_key: str) -> Verify:
    """Every kvlb follows the new topology: Redis up again, and new batches of the key space written
    through the promoted master (its stream goes on past the number seen at the kill)."""

    async def verify(f: FaultRig) -> str:
        cluster: RedisClusterProcs = f.context["cluster"]
        before, new_port = f.context["promoted"]
        deadline = time.monotonic() + 10.0
        while True:
            after = await _stream_entries(cluster, space_key)
            ups = [await _metric(f, url, "kvlb_redis_up") for url in f.checked]
            if after > before and all(up == 1.0 for up in ups):
                break
            assert time.monotonic() < deadline, f"stream {before} -> {after}, kvlb_redis_up {ups}"
            await asyncio.sleep(0.1)
        assert cluster.master_port(space_key) == new_port
        return f"{after - before} entries since, through :{new_port}; kvlb_redis_up 1 on {len(ups)} kvlb"

    return verify


async def _metric(f: FaultRig, url: str, name: str) -> float | None:
    async with f.session.get(url + "/metrics") as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith((name + " ", name + '{worker="')):  # one process, or one --workers worker
            return float(line.rpartition(" ")[2])
    return None


async def _stream_entries(cluster: RedisClusterProcs, space_key: str) -> int:
    """The number of the key space's last stream entry (``ctr.stream_entries``)."""

    def read() -> int:
        with cluster.node(cluster.master_port(space_key)).client() as client:
            return int(client.hget(space_key, "stream_entries") or 0)

    return await asyncio.to_thread(read)


async def _leases(f: FaultRig, url: str) -> list[str]:
    async with f.session.get(url + "/admin/fleet") as response:
        fleet_view = (await response.json())["fleet"] or {}
    leases = fleet_view.get("leases", [])
    return [str(name) for name in leases]


SCENARIOS = {
    **REPLICA_SCENARIOS,
    **{
        s.name: s
        for s in (
            Scenario(
                "kvlb_killed",
                "kvlb instance killed while holding leases",
                kvlb_killed,
                redis=True,
                kvlbs=2,
                # measured from the takeover (the inject waits for it, TAKEOVER_LIMIT_S): the target
                inexact=lost_at_the_kill,
            ),
            Scenario(
                "redis_restarted",
                "Redis killed and restarted",
                redis_restarted,
                redis=True,
                kvlbs=2,
                # the blocks matched over 2 s in 2 of 10 runs (2.10 s where the counts said 1.15 s):
                # docs/reliability.md, "Open points"; both are measured and reported
                criterion="counts",
            ),
            Scenario(
                "cluster_master_killed",
                "Redis Cluster master killed (replica promoted)",
                kill_master(SGLANG_SPACE_KEY, "SGLang"),
                redis=True,
                cluster=True,
                kvlbs=2,
                converge_limit_s=5.0,
                verify=followed(SGLANG_SPACE_KEY),
            ),
            Scenario(
                "cluster_master_killed_trtllm",
                "Redis Cluster master of the TRT-LLM key space and the member set killed",
                kill_master(TRTLLM_SPACE_KEY, "TRT-LLM"),
                redis=True,
                cluster=True,
                kvlbs=2,
                converge_limit_s=5.0,
                verify=followed(TRTLLM_SPACE_KEY),
            ),
            Scenario(
                "redis_slow",
                "Redis slow (+300 ms per round trip)",
                redis_slow,
                redis=True,
                kvlbs=2,
            ),
        )
    },
}
