"""The fault scenarios of the suite: the replica faults of :mod:`loadtests.faults.scenarios` plus the
Redis ones (fleet mode), and the runner that starts a private ``redis-server`` for those (I/O).

The Redis scenarios run two ``kvlb serve`` sharing a ``redis-server`` (append-only file) reached
through a :class:`tcp_proxy.DelayProxy`; the load goes to the first, every kvlb still running is checked.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from redis_server import RedisServer, start_server
from tcp_proxy import DelayProxy

from loadtests.faults.load import Load
from loadtests.faults.rig import FaultRig
from loadtests.faults.scenarios import (
    CONVERGE_LIMIT_S,
    FAULT_TIMEOUTS,
    MEASURE_LIMIT_S,
    REPLICA_SCENARIOS,
    Result,
    Scenario,
    run_in_fleet,
)

__all__ = ["CONVERGE_LIMIT_S", "MEASURE_LIMIT_S", "SCENARIOS", "Result", "Scenario", "run"]

FLEET_TIMING = {"lease_ttl_s": 2.0, "tick_s": 0.5, "socket_timeout_s": 1.0}
"""FaultRig mode in the suite: a dead kvlb's leases are taken over within about 2.5 s."""


async def run(scenario: Scenario, tmp: Path, scale: float = 1.0) -> Result:
    top: dict[str, Any] = {"timeouts": dict(FAULT_TIMEOUTS)}
    if not scenario.redis:
        return await run_in_fleet(scenario, tmp, scale, top, {})
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
    """SIGKILL the second kvlb (no hand-over): the first takes its leases over when they expire."""
    held = await _leases(f, f.others[0].info["url"])
    f.checked = [f.url]
    await f.others[0].kill()
    return f"kvlb-1 SIGKILLed holding {len(held)} lease(s): {', '.join(sorted(held)) or '-'}"


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
                "kvlb_killed", "kvlb instance killed while holding leases", kvlb_killed, redis=True, kvlbs=2
            ),
            Scenario(
                "redis_restarted",
                "Redis killed and restarted",
                redis_restarted,
                redis=True,
                kvlbs=2,
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
