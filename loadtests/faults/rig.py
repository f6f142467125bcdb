"""A fleet under test: emulated replicas and one kvlb, all real processes, plus what a fault run
observes of them: the index against the engines' true caches, kvlb's counters, its memory (I/O).

**Convergence** means: for every replica, the blocks kvlb's index holds for it (``GET
/admin/replicas``, confirmed blocks only) equal the full blocks the engine really caches (``GET
/admin/stats`` of the emulator, summed over DP ranks). Under load both move, so one check reads the
engines, then kvlb, then the engines again, and counts only when the two engine readings agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.faults.procs import BLOCK_SIZE, Child, Sim, serve, sim, write_config
from loadtests.faults.tcp_proxy import DelayProxy

POLL_S = 0.05
TRAIL_MAX = 12
"""Readings :attr:`FaultRig.trail` keeps."""


@dataclass
class FaultRig:
    sims: list[Sim]
    kvlb: Child
    session: aiohttp.ClientSession
    tmp: Path
    url: str = ""
    notes: list[str] = field(default_factory=list)
    others: list[Child] = field(default_factory=list)
    """Further kvlb instances (fleet mode: they share Redis with ``kvlb``)."""
    checked: list[str] = field(default_factory=list)
    """The kvlb URLs whose index must converge (default: ``url``)."""
    context: dict[str, Any] = field(default_factory=dict)
    """What a scenario needs besides (the Redis server, the proxy in front of it)."""
    replay_proxies: dict[str, DelayProxy] = field(default_factory=dict)
    """Replica name → the proxy kvlb reaches its replay socket through (to partition it)."""
    trail: list[str] = field(default_factory=list)
    """The last :meth:`time_to_converge`'s readings that differed, as ``+t.tt s engines {...} kvlb-i
    {...}`` lines (at most :data:`TRAIL_MAX`, the newest kept): which replica diverged, from when, how."""

    def replica(self, name: str) -> Sim:
        return next(s for s in self.sims if s.name == name)

    async def fault(self, name: str, **body: Any) -> dict[str, Any]:
        """``POST /admin/faults`` on one emulated replica."""
        async with self.session.post(self.replica(name).url + "/admin/faults", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"POST /admin/faults on {name}: {await response.text()}")
            result: dict[str, Any] = await response.json()
            return result

    async def engine_blocks(self) -> dict[str, int] | None:
        out: dict[str, int] = {}
        for replica in self.sims:
            try:
                async with self.session.get(
                    replica.url + "/admin/stats", timeout=aiohttp.ClientTimeout(total=1)
                ) as r:
                    stats = await r.json()
            except (aiohttp.ClientError, TimeoutError):
                return None
            out[replica.name] = sum(rank["num_cached_tokens"] for rank in stats["ranks"]) // BLOCK_SIZE
        return out

    async def index_blocks(self, url: str | None = None) -> dict[str, int]:
        async with self.session.get((url or self.url) + "/admin/replicas") as response:
            views = (await response.json())["replicas"]
        return {view["id"]: int(view["index"]["blocks"]) for view in views}

    async def compare(self) -> tuple[bool, bool]:
        """``(equal, within)``: every checked kvlb's index holds exactly the engines' block counts /
        at most them."""
        equal, within, _ = await self._compare()
        return equal, within

    async def _compare(self) -> tuple[bool, bool, str | None]:
        """:meth:`compare`, and the reading as text when the engines stood still and it differed."""
        before = await self.engine_blocks()
        urls = self.checked or [self.url]
        indexes = [await self.index_blocks(url) for url in urls]
        after = await self.engine_blocks()
        if before is None or after is None or before != after:
            return False, False, None
        equal = all(index == before for index in indexes)
        within = all(index.get(name, 0) <= count for index in indexes for name, count in before.items())
        if equal:
            return True, True, None
        pairs = zip(urls, indexes, strict=True)
        kvlbs = " ".join(f"kvlb-{self._number(url)} {index}" for url, index in pairs)
        return False, within, f"engines {before} {kvlbs}"

    def _number(self, url: str) -> int:
        """The kvlb's number (``kvlb-<n>``) of ``url``: 0 for the first, then :attr:`others` in order."""
        children = [self.kvlb, *self.others]
        return next((i for i, c in enumerate(children) if c.info.get("url") == url), -1)

    async def time_to_converge(self, since: float, limit_s: float) -> tuple[float | None, float | None]:
        """Seconds from ``since`` (monotonic) until the index is within the engines' caches (no block
        the engines lack) and until it matches them exactly; ``None`` if not within ``limit_s``.
        The differing readings on the way are kept in :attr:`trail`."""
        deadline = since + limit_s
        within_s: float | None = None
        self.trail = []
        last: str | None = None
        while time.monotonic() < deadline:
            equal, within, reading = await self._compare()
            if reading is not None and reading != last:
                self.trail = [*self.trail, f"+{time.monotonic() - since:.2f}s {reading}"][-TRAIL_MAX:]
                last = reading
            if within and within_s is None:
                within_s = time.monotonic() - since
            if equal:
                return within_s, time.monotonic() - since
            await asyncio.sleep(POLL_S)
        return within_s, None

    async def divergence(self) -> str:
        return f"engines {await self.engine_blocks()} index {await self.index_blocks()}"

    async def metrics(self) -> dict[str, float]:
        """Sums of kvlb's counters by family (labels added up)."""
        async with self.session.get(self.url + "/metrics") as response:
            text = await response.text()
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            head, _, value = line.rpartition(" ")
            name = head.split("{", 1)[0]
            with contextlib.suppress(ValueError):
                totals[name] = totals.get(name, 0.0) + float(value)
        return totals

    async def restart_replica(self, name: str) -> None:
        """Start a killed replica again on its own ports (a fresh process: empty cache, seq 0)."""
        replica = self.replica(name)
        await replica.start("replicas")
        await self.wait_routable(name)

    async def wait_routable(self, name: str, timeout_s: float = 10.0, url: str | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            async with self.session.get((url or self.url) + "/admin/replicas") as response:
                views = (await response.json())["replicas"]
            if any(v["id"] == name and v["routable"] for v in views):
                return
            await asyncio.sleep(POLL_S)
        raise RuntimeError(f"{name} never became routable again")


@contextlib.asynccontextmanager
async def fault_rig(
    tmp: Path,
    engines: tuple[str, ...] = ("sglang", "sglang", "trtllm"),
    *,
    time_scale: float = 0.5,
    sim_args: dict[str, tuple[str, ...]] | None = None,
    kvlbs: int = 1,
    replay_proxies: tuple[str, ...] = (),
    **top: Any,
) -> AsyncIterator[FaultRig]:
    """Replicas ``r0``, ``r1``... (one per engine) and ``kvlbs`` ready kvlb instances in front of them
    (more than one only with ``redis`` settings in ``top``: each gets its own ``instance_id``); kvlb
    reaches the replay socket of each SGLang replica named in ``replay_proxies`` through a proxy."""
    sims = [
        sim(f"r{i}", engine, tmp, *(sim_args or {}).get(f"r{i}", ()), time_scale=time_scale)
        for i, engine in enumerate(engines)
    ]
    children: list[Child] = []
    proxies: dict[str, DelayProxy] = {}
    try:
        for s in sims:
            if s.name in replay_proxies:
                proxies[s.name] = DelayProxy(s.replay_port)
                await proxies[s.name].start()
                s.replay_via = proxies[s.name].port
        await asyncio.gather(*(s.start("replicas") for s in sims))
        for number in range(kvlbs):
            extra = dict(top)
            if "redis" in top:
                extra["redis"] = {**top["redis"], "instance_id": f"kvlb-{number}"}
            config = write_config(tmp, sims, name=f"kvlb-{number}", **extra)
            children.append(serve(tmp, config, f"kvlb-{number}"))
        await asyncio.gather(*(child.start("serving") for child in children))
        async with aiohttp.ClientSession() as session:
            first = children[0]
            running = FaultRig(
                sims, first, session, tmp, url=first.info["url"], others=children[1:], replay_proxies=proxies
            )
            for child in children:
                await _wait_ready(running, child.info["url"])
            yield running
    finally:
        await asyncio.gather(*(child.stop() for child in children))
        await asyncio.gather(*(s.stop() for s in sims))
        await asyncio.gather(*(proxy.stop() for proxy in proxies.values()))


async def _wait_ready(f: FaultRig, url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with f.session.get(url + "/readyz") as response:
            if response.status == 200:
                for s in f.sims:
                    await f.wait_routable(s.name, url=url)
                return
        await asyncio.sleep(POLL_S)
    raise RuntimeError(f"kvlb at {url} not ready:\n{f.kvlb.log_tail()}")
