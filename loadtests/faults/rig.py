"""A fleet under test: emulated replicas and one kvlb, all real processes, plus what a fault run
observes of them: the index against the engines' true caches, kvlb's counters, its memory (I/O).

**Convergence** means: for every replica, the blocks kvlb's index holds for it (``GET
/admin/replicas/{id}/blocks``, confirmed blocks only, as kvlb's block keys) are the blocks the
engine really caches (``GET /admin/blocks`` of the emulator: its pages, keyed the way kvlb keys
them, :mod:`loadtests.faults.blocks`), rank for rank. The block counts are compared too (the
criterion until 2026-11-30: near a full cache a stale index often has the engine's count), and both
times are reported. Under load both sides move, so one check reads, for every replica at once, its
engine, then kvlb's index of it, then its engine again, and counts only when each replica's two
engine readings agree (the same blocks; a replica whose engine moved is read again, a few times,
within the check).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.faults.blocks import (
    Listed,
    blocks_within,
    difference,
    engine_keys,
    index_keys,
    same_blocks,
)
from loadtests.faults.procs import BLOCK_SIZE, MODEL, Child, Sim, serve, sim, write_config
from loadtests.faults.tcp_proxy import DelayProxy

POLL_S = 0.05
BRACKET_TRIES = 3
"""Readings of one replica within one check while its engine moves (:meth:`FaultRig._bracket`)."""
TRAIL_MAX = 12
"""Readings :attr:`FaultRig.trail` keeps."""


@dataclass(frozen=True, slots=True)
class Reading:
    """One check of every checked kvlb's index against the engines (:meth:`FaultRig.read`)."""

    blocks_equal: bool
    """Every index holds exactly the engines' blocks (the same keys, rank for rank)."""
    blocks_within: bool
    """No index holds a block its engine lacks."""
    counts_equal: bool
    """Every index holds as many blocks as its engine."""
    counts_within: bool
    """No index holds more blocks than its engine."""
    text: str | None
    """The reading, when the engines stood still and it differed."""


UNSTEADY = Reading(False, False, False, False, None)
"""A check whose two engine readings differed (or an engine did not answer): it counts for nothing."""


@dataclass(frozen=True, slots=True)
class Convergence:
    """Seconds from the recovery until each criterion first held (``None``: not within the limit)."""

    within_s: float | None
    """The index holds no block an engine lacks (block keys)."""
    equal_s: float | None
    """The index holds exactly the engines' blocks (block keys)."""
    within_count_s: float | None
    """The index holds no more blocks than an engine (counts)."""
    equal_count_s: float | None
    """The index holds as many blocks as each engine (counts)."""
    checks: int = 0
    """Checks made until the blocks matched (or the limit)."""
    steady: int = 0
    """Of those, the ones that counted (the two engine readings agreed and kvlb answered)."""


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

    async def engine_listing(self) -> dict[str, Listed] | None:
        """Every engine's cached blocks (``GET /admin/blocks``, read at once); ``None`` when one did
        not answer."""
        try:
            listings = await asyncio.gather(*(self._get(s.url + "/admin/blocks") for s in self.sims))
        except (aiohttp.ClientError, TimeoutError):
            return None
        return {s.name: engine_keys(listing, MODEL) for s, listing in zip(self.sims, listings, strict=True)}

    async def index_listing(self, url: str | None = None) -> dict[str, Listed]:
        """The blocks one kvlb's index holds for every replica (``GET /admin/replicas/{id}/blocks``)."""
        base = (url or self.url) + "/admin/replicas/"
        views = await asyncio.gather(*(self._get(f"{base}{s.name}/blocks?limit=10000") for s in self.sims))
        return {s.name: index_keys(view) for s, view in zip(self.sims, views, strict=True)}

    async def _get(self, url: str) -> Any:
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as response:
            if response.status != 200:
                raise aiohttp.ClientError(f"GET {url}: {response.status} {await response.text()}")
            return await response.json()

    async def compare(self) -> tuple[bool, bool]:
        """``(equal, within)``: every checked kvlb's index holds exactly the engines' blocks / no
        block they lack (block keys, not counts)."""
        reading = await self.read()
        return reading.blocks_equal, reading.blocks_within

    async def read(self) -> Reading:
        """One check: for every replica at once, its engine, every checked kvlb's index of it, its
        engine again (:meth:`_bracket`)."""
        urls = self.checked or [self.url]
        brackets = await asyncio.gather(*(self._bracket(s, urls) for s in self.sims))
        if any(bracket is None for bracket in brackets):
            return UNSTEADY
        before = {s.name: bracket[0] for s, bracket in zip(self.sims, brackets, strict=True) if bracket}
        indexes = [
            {s.name: bracket[1][i] for s, bracket in zip(self.sims, brackets, strict=True) if bracket}
            for i in range(len(urls))
        ]
        pairs = [(index[name], engine) for index in indexes for name, engine in before.items()]
        reading = Reading(
            blocks_equal=all(same_blocks(i, e) for i, e in pairs),
            blocks_within=all(blocks_within(i, e) for i, e in pairs),
            counts_equal=all(i.count == e.count for i, e in pairs),
            counts_within=all(i.count <= e.count for i, e in pairs),
            text=None,
        )
        if reading.blocks_equal:
            return reading
        engines = {name: listed.count for name, listed in before.items()}
        kvlbs = " ".join(
            f"kvlb-{self._number(url)} {self._described(index, before)}"
            for url, index in zip(urls, indexes, strict=True)
        )
        return dataclasses.replace(reading, text=f"engines {engines} {kvlbs}")

    async def _bracket(self, replica: Sim, urls: list[str]) -> tuple[Listed, list[Listed]] | None:
        """``(engine, indexes)``: ``replica``'s cached blocks, and each kvlb's index of it read
        after them, when a second reading of the engine after those found the same blocks (it stood
        still meanwhile). When it moved, the second reading opens the next bracket, up to
        :data:`BRACKET_TRIES` in all; ``None`` when it moved in each or did not answer. One replica
        per bracket keeps it short: bracketing the whole fleet's readings at once (until 2026-11-30)
        took 0.11-0.13 s a check on a loaded machine after a Redis restart, the churning engines
        moved within nearly every one, and no check counted for 3-4 s. Until 2026-12-01 a replica
        had one try a check, so a check counted only when all three engines stood still within
        their one try: after a Redis restart at load 6-24, 1 in 14 to 3 in 8 of the checks made
        once kvlb had written its queued batches counted (11 diagnosed runs), and 13 of 26 with
        three tries (one run, load 24). A retry starts right after the engine changed, so it
        favours readings where kvlb's index has not caught up yet, never ones where it has."""
        try:
            before = engine_keys(await self._get(replica.url + "/admin/blocks"), MODEL)
            for _ in range(BRACKET_TRIES):
                views = await asyncio.gather(
                    *(self._get(f"{url}/admin/replicas/{replica.name}/blocks?limit=10000") for url in urls)
                )
                after = engine_keys(await self._get(replica.url + "/admin/blocks"), MODEL)
                if before == after:
                    return before, [index_keys(view) for view in views]
                before = after
        except (aiohttp.ClientError, TimeoutError):
            return None
        return None

    @staticmethod
    def _described(index: dict[str, Listed], engines: dict[str, Listed]) -> str:
        """Counts per replica, and for each replica whose blocks differ ``-lacked/+extra``."""
        counts = {name: listed.count for name, listed in index.items()}
        differ = {
            name: difference(listed, engines[name])
            for name, listed in index.items()
            if not same_blocks(listed, engines[name])
        }
        return f"{counts} blocks {differ}"

    def _number(self, url: str) -> int:
        """The kvlb's number (``kvlb-<n>``) of ``url``: 0 for the first, then :attr:`others` in order."""
        children = [self.kvlb, *self.others]
        return next((i for i, c in enumerate(children) if c.info.get("url") == url), -1)

    async def time_to_converge(self, since: float, limit_s: float) -> Convergence:
        """Seconds from ``since`` (monotonic) until the index is within the engines' caches and until
        it matches them, by block keys and by counts (:class:`Convergence`); ``None`` if not within
        ``limit_s``. Stops at the blocks' match (the counts match then too). The differing readings
        on the way are kept in :attr:`trail`."""
        deadline = since + limit_s
        times: dict[str, float] = {}
        self.trail = []
        last: str | None = None
        checks = steady = 0
        while time.monotonic() < deadline:
            reading = await self.read()
            checks += 1
            steady += reading is not UNSTEADY
            elapsed_s = time.monotonic() - since
            if reading.text is not None and reading.text != last:
                self.trail = [*self.trail, f"+{elapsed_s:.2f}s {reading.text}"][-TRAIL_MAX:]
                last = reading.text
            for name in ("blocks_within", "blocks_equal", "counts_within", "counts_equal"):
                if getattr(reading, name):
                    times.setdefault(name, elapsed_s)
            if reading.blocks_equal:
                break
            await asyncio.sleep(POLL_S)
        return Convergence(
            within_s=times.get("blocks_within"),
            equal_s=times.get("blocks_equal"),
            within_count_s=times.get("counts_within"),
            equal_count_s=times.get("counts_equal"),
            checks=checks,
            steady=steady,
        )

    async def divergence(self) -> str:
        engines = await self.engine_listing()
        if engines is None:
            return "an engine did not answer"
        index = await self.index_listing()
        counts = {name: listed.count for name, listed in engines.items()}
        return f"engines {counts} index {self._described(index, engines)}"

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
