"""The fleet's drains on one clock, read incrementally (2026-12-01, h-fleetfollow2).

Real :class:`~balancer.fleet.drain_sync.DrainSync` objects (one per balancer) on a private
``redis-server``. Before this change, the removal time of a drain kept after its replica's removal
was the removing balancer's wall clock and the prune compared it with the pruning balancer's: a skew
of S seconds moved the prune by S. And every sync read the whole ``<prefix>:drained`` hash
(``HGETALL``), at each change message and every ``redis.policy_poll_s``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis_cluster import RedisClusterProcs
from redis_server import RedisServer

from balancer import strict_json
from balancer.config import RedisConfig
from balancer.fleet.drain_sync import FULL_READ_EVERY_SYNCS, MAX_CHANGE_LOG, DrainSync
from balancer.fleet.runtime import redis_client
from balancer.health.book import DrainNote, HealthBook
from balancer.metrics import Metrics
from balancer.types import ReplicaId

PREFIX = "dc"
KEYS = [
    f"{PREFIX}:drained",
    f"{PREFIX}:drained:version{{{PREFIX}:drained}}",
    f"{PREFIX}:drained:changes{{{PREFIX}:drained}}",
]
NOTE = DrainNote(by="ops", caller="anonymous@127.0.0.1", at_wall_ts=1_796_000_000.0, reason="disk swap")
R1 = ReplicaId("web-1")
DAY_S = 86_400.0


def skewed(offset_s: float) -> Any:
    """A wall clock ``offset_s`` away from the host's (the balancer's ``wall_clock``)."""
    return lambda: time.time() + offset_s


def balancer(client: Any, keep_s: float, *listed: ReplicaId, clock_offset_s: float = 0.0) -> DrainSync:
    book = HealthBook(drain_keep_s=keep_s)
    for replica in listed:
        book.add(replica, probe_ok=True, now=0.0)
    metrics = Metrics.create(CollectorRegistry())
    wall = skewed(clock_offset_s)
    return DrainSync(client, book, key_prefix=PREFIX, poll_s=0.1, metrics=metrics, wall_clock=wall)


async def redis_now(client: Any) -> float:
    seconds, micros = await client.time()
    return int(seconds) + int(micros) / 1e6


async def hgetall_calls(client: Any) -> int:
    """``HGETALL``s the server ran (``INFO commandstats``): whole reads of the hash."""
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_hgetall", {}).get("calls", 0))


@pytest.mark.redis
async def test_the_keep_time_counts_on_redis_clock_whatever_the_balancers_clocks_say(
    redis_server: RedisServer,
) -> None:
    """A is 10 days behind, B 10 days ahead. A removes the drained replica: the removal time is
    Redis's, so B (20 days past A's clock) keeps it for the keep time, and A (10 days before it)
    prunes it once the keep time is over. Before, B pruned it at once and A would have waited 10
    days."""
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await client.delete(*KEYS)
    keep_s = 1.5
    try:
        a = balancer(client, keep_s, R1, clock_offset_s=-10 * DAY_S)
        b = balancer(client, keep_s, clock_offset_s=10 * DAY_S)  # B never listed it
        await a.sync()
        assert await a.commit(R1, NOTE)
        await a.sync()
        a.health.remove(R1, now=1.0, wall=a._wall_clock())  # what the discovery passes
        await a.mark_removed(R1)
        stored = strict_json.loads(await client.hget(KEYS[0], R1))
        assert abs(stored["removed_at_wall_ts"] - await redis_now(client)) < 1.0  # not A's clock
        await b.sync()
        assert await client.hget(KEYS[0], R1) is not None  # B, 20 days past A's clock, keeps it
        assert [kept.replica for kept in b.kept_drains()] == [R1]
        assert b.redis_clock_offset_s == pytest.approx(-10 * DAY_S, abs=5.0)
        listing = b.kept_listing()[0]
        assert listing.expires_at_wall_ts == pytest.approx(stored["removed_at_wall_ts"] + keep_s)
        await a.sync()
        assert await client.hget(KEYS[0], R1) is not None  # within the keep time on Redis's clock
        await asyncio.sleep(keep_s + 0.3)
        await a.sync()  # A, 10 days behind, prunes it once the keep time is over on Redis's clock
        assert await client.hget(KEYS[0], R1) is None
    finally:
        await client.delete(*KEYS)
        await client.aclose()


@pytest.mark.redis
async def test_a_sync_reads_only_what_changed_and_the_whole_hash_when_it_must(
    redis_server: RedisServer,
) -> None:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await client.delete(*KEYS)
    entry = strict_json.dumps(NOTE.to_json())
    try:
        a = balancer(client, 60.0, R1)
        b = balancer(client, 60.0, R1)
        await client.hset(KEYS[0], mapping={"": "1", "other": entry})  # only older releases wrote it
        await b.sync()  # its first: the whole hash, and the change log starts
        assert b.full_reads == 1 and "other" in b.mirror.entries
        assert await client.hget(KEYS[1], "version") == "1"
        before = await hgetall_calls(client)
        for _ in range(20):
            await b.sync()  # nothing changed: no whole read
        assert await hgetall_calls(client) == before and b.full_reads == 1

        # a drain through A reaches B through the change log, without a whole read
        assert await a.commit(R1, NOTE)
        await b.sync()
        assert b.health.replicas[R1].draining and b.health.replicas[R1].drain == NOTE
        assert await hgetall_calls(client) == before
        assert await a.commit(R1, None)  # and the undrain
        await b.sync()
        assert not b.health.replicas[R1].draining and await hgetall_calls(client) == before

        # a balancer of an older release writes (no version) and publishes: the message makes B
        # read the whole hash; written without a message, the periodic whole read finds it
        await client.hset(KEYS[0], R1, entry)
        b.on_message()
        await b.sync()
        assert b.health.replicas[R1].draining and b.full_reads == 2
        await client.hdel(KEYS[0], R1)
        for _ in range(FULL_READ_EVERY_SYNCS - 1):
            await b.sync()
        assert b.health.replicas[R1].draining  # not seen yet: bounded by the periodic read
        await b.sync()
        assert not b.health.replicas[R1].draining and b.full_reads == 3

        # Redis lost the keys: B seeds its drains (a new epoch), A reads the whole hash once
        await b.commit(R1, NOTE)
        await b.sync()
        await client.delete(*KEYS)
        await b.sync()  # the seed
        assert await client.hget(KEYS[0], R1) == entry
        reads = a.full_reads
        await a.sync()
        assert a.health.replicas[R1].draining and a.full_reads == reads + 1
        assert "other" not in a.mirror.entries  # gone with the lost keys, not kept from before

        # more writes than the change log keeps since B read it: B reads the whole hash once
        await b.sync()
        reads = b.full_reads
        for i in range(0, MAX_CHANGE_LOG + 8, 512):  # undrains of ids never drained: logged changes
            await asyncio.gather(*(a.commit(ReplicaId(f"gone-{j}"), None) for j in range(i, i + 512)))
        assert await client.zcard(KEYS[2]) == MAX_CHANGE_LOG
        await b.sync()
        assert b.full_reads == reads + 1
        await a.commit(ReplicaId("other"), None)
        await b.sync()  # then the change log again
        assert b.full_reads == reads + 1 and "other" not in b.mirror.entries
        registry = b._metrics.registry
        counted = {
            reason: registry.get_sample_value("kvlb_redis_drain_whole_reads_total", {"reason": reason})
            for reason in ("first", "epoch", "trimmed", "changes", "unversioned", "periodic")
        }
        # epoch: the sync that found the keys gone (and seeded), then the one that read the seed
        assert counted == {
            "first": 1.0, "epoch": 2.0, "trimmed": 1.0, "changes": 0.0, "unversioned": 1.0, "periodic": 1.0
        }  # fmt: skip
    finally:
        await client.delete(*KEYS)
        await client.aclose()


@pytest.mark.redis
async def test_the_drains_scripts_run_on_a_redis_cluster(redis_cluster: RedisClusterProcs) -> None:
    """The three keys of a drain script share one slot (a hash tag): on a 3-master Redis Cluster a
    drain, its removal mark and the change log's read work as on one server (without the hash tag:
    ``CROSSSLOT``, every drain refused)."""
    client = redis_client(RedisConfig(url=redis_cluster.url, cluster=True), decode=True)
    try:
        a = balancer(client, 60.0, R1)
        b = balancer(client, 60.0, R1)
        await a.sync()  # the seed
        assert await a.commit(R1, NOTE)
        await b.sync()
        await b.sync()
        assert b.health.replicas[R1].draining and b.full_reads == 1  # the second: the change log
        a.health.remove(R1, now=1.0, wall=time.time())
        await a.mark_removed(R1)
        b.health.remove(R1)  # B's discovery dropped it too
        await b.sync()
        assert [kept.replica for kept in b.kept_drains()] == [R1] and b.full_reads == 1
        assert len({redis_cluster.master_port(key) for key in KEYS}) == 1
    finally:
        await client.delete(*KEYS)
        await client.aclose()
