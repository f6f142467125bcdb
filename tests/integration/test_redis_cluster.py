"""The cluster client against a real 3 + 3 Redis Cluster: built from ``redis.cluster``, and calls cut
by a topology reload fail only with Redis errors (the redis-py race ``FailoverSafeCluster`` contains).

The failover itself, under load with two ``kvlb serve``, is the fault scenario
``cluster_master_killed`` (``tests/faults``).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from redis_cluster import RedisClusterProcs

from balancer.config import RedisConfig
from balancer.fleet.runtime import redis_client
from balancer.index.redis.client import REDIS_ERRORS, FailoverSafeCluster, RedisClient

pytestmark = pytest.mark.redis

ROUNDS = 20


async def test_redis_cluster_setting_builds_a_cluster_client(redis_cluster: RedisClusterProcs) -> None:
    client = redis_client(RedisConfig(url=redis_cluster.url, cluster=True), decode=True)
    try:
        assert isinstance(client, FailoverSafeCluster)
        keys = [f"kvlb:{{space-{n}}}:ctr" for n in range(12)]
        for number, key in enumerate(keys):
            await client.hset(key, "n", number)
        assert [int(await client.hget(key, "n")) for key in keys] == list(range(12))
        masters = {redis_cluster.master_port(key) for key in keys}
        assert len(masters) == 3  # the client followed the slots to every master
    finally:
        await client.aclose()


async def test_calls_cut_by_a_topology_reload_fail_with_redis_errors(
    redis_cluster: RedisClusterProcs,
) -> None:
    """``aclose`` is what redis-py runs on ``CLUSTERDOWN`` and every few ``MOVED``: it disconnects
    connections in use too. Blocked ``XREAD`` s and plain calls running at that moment end in a
    result or a Redis error, never in ``AttributeError``/``RuntimeError`` from inside redis-py."""
    outcomes: Counter[str] = Counter()
    for round_number in range(ROUNDS):
        client = redis_client(RedisConfig(url=redis_cluster.url, cluster=True), decode=False)
        try:
            assert isinstance(client, FailoverSafeCluster)
            await client.initialize()

            async def call(client: RedisClient, blocking: bool) -> str:
                try:
                    if blocking:
                        await client.xread({"kvlb:{race}:events": "$"}, block=100)
                    else:
                        await client.get("kvlb:{race}:ctr")
                except REDIS_ERRORS as exc:
                    return type(exc).__name__
                return "ok"

            tasks = [asyncio.create_task(call(client, blocking=n % 2 == 0)) for n in range(6)]
            await asyncio.sleep(0.001 * (round_number % 10))
            await client.aclose()
            outcomes.update(await asyncio.gather(*tasks))  # anything else raises here
        finally:
            await client.aclose()
    assert sum(outcomes.values()) == 6 * ROUNDS
    assert outcomes["ok"] > 0, outcomes
