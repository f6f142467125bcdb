"""Ingestion leases against a real private ``redis-server`` and a real 3 + 3 Redis Cluster:
exclusivity, renewal, release, takeover after expiry, fencing of the old owner, and the stored last
sequence number."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis_cluster import RedisTarget
from redis_server import fresh_settings

from balancer.events import Stored
from balancer.index.hashing import BlockHasher
from balancer.index.redis.index import RedisIndex, StaleGenerationError
from balancer.index.redis.lease import IngestionLease, LeaseSettings
from balancer.types import EngineHash, ReplicaId

pytestmark = pytest.mark.redis

HASHER = BlockHasher("lease", 2)
R = ReplicaId("trtllm-0")


@pytest.fixture
async def index(redis_target: RedisTarget) -> AsyncIterator[RedisIndex]:
    client = redis_target.client(decode=True)
    yield RedisIndex(client, HASHER, fresh_settings())
    await client.aclose()


def lease(index: RedisIndex, owner: str, ttl_s: float = 10.0, renew_every_s: float = 3.0) -> IngestionLease:
    return IngestionLease(index.client, index.keys, R, owner, LeaseSettings(ttl_s, renew_every_s))


def block(n: int) -> Stored:
    return Stored(0, None, (EngineHash(n),), bytes([n % 256, 0, 0, 0]) * HASHER.block_size, HASHER.block_size)


async def test_one_holder_renew_release_and_takeover(index: RedisIndex) -> None:
    first, second = lease(index, "ingester-a"), lease(index, "ingester-b")
    grant = await first.acquire()
    assert grant.acquired and grant.generation == 1 and grant.last_seq is None
    assert not (await second.acquire()).acquired
    assert await second.renew() is False and await second.release() is False
    again = await first.acquire()  # re-acquiring one's own lease only refreshes it
    assert again.acquired and again.generation == 1
    assert await first.renew()
    await index.apply(R, [block(1)], 0.0, generation=grant.generation, seq=41)
    assert await first.release()
    assert await first.holder() is None
    taken = await second.acquire()
    assert taken.acquired and taken.generation == 2 and taken.last_seq == 41
    assert await second.holder() == "ingester-b"
    with pytest.raises(StaleGenerationError):  # the old owner is fenced off the index
        await index.apply(R, [block(2)], 0.0, generation=grant.generation, seq=42)
    result = await index.apply(R, [block(2)], 0.0, generation=taken.generation, seq=42)
    assert result.stored_blocks == 1
    assert (await second.acquire()).last_seq == 42


async def test_an_expired_lease_is_taken_over_and_the_old_owner_learns_it(index: RedisIndex) -> None:
    old, new = (
        lease(index, "old", ttl_s=0.2, renew_every_s=0.05),
        lease(index, "new", ttl_s=5.0, renew_every_s=1.0),
    )
    assert (await old.acquire()).acquired
    stop = asyncio.Event()
    keeper = asyncio.create_task(old.keep(stop))
    await asyncio.sleep(0.4)  # renewals keep it alive past its ttl
    assert not (await new.acquire()).acquired
    stop.set()
    await asyncio.wait_for(keeper, 2)
    assert not old.lost.is_set()
    for _ in range(100):  # bounded: the ttl is 0.2 s
        if (await new.acquire()).acquired:
            break
        await asyncio.sleep(0.05)
    assert await new.holder() == "new"
    stop = asyncio.Event()
    keeper = asyncio.create_task(old.keep(stop))
    await asyncio.wait_for(old.lost.wait(), 2)  # its next renewal finds the lease gone
    await asyncio.wait_for(keeper, 2)
    assert await new.holder() == "new"


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        LeaseSettings(ttl_s=1.0, renew_every_s=1.0)
