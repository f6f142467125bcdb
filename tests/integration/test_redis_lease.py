"""Ingestion leases against a real private ``redis-server`` and a real 3 + 3 Redis Cluster:
exclusivity, renewal, release, takeover after expiry, fencing of the old owner, and the stored last
sequence number."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis_cluster import RedisTarget
from redis_server import RedisServer, fresh_settings

from balancer.events import Stored
from balancer.fleet.writer import FencedWriter
from balancer.index.hashing import BlockHasher
from balancer.index.redis.index import RedisIndex, StaleGenerationError
from balancer.index.redis.lease import IngestionLease, LeaseSettings
from balancer.metrics import Metrics
from balancer.types import EngineHash, ReplicaId
from loadtests.faults.tcp_proxy import DelayProxy

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


async def test_a_lease_taken_back_while_our_write_is_answered_finds_that_write_ours(
    redis_server: RedisServer,
) -> None:
    """Redis back after an outage longer than the TTL: the writer's retried write lands, and the
    lease manager takes the lease back before the write's answer arrives. Redis then holds that
    write's positions, not the holding's last answered ones; it is still our own write (in flight),
    so the lease is taken back, not given up (which would resync a TRT-LLM replica). The writer's
    Redis client goes through a proxy that, once the writer has connected and written once, holds
    each chunk 0.4 s, so the answer is late."""
    proxy = DelayProxy(redis_server.port)
    await proxy.start()
    slow = aioredis.Redis.from_url(f"redis://127.0.0.1:{proxy.port}/0", decode_responses=True)
    direct = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        settings = fresh_settings()
        index = RedisIndex(slow, HASHER, settings)
        keys = RedisIndex(direct, HASHER, settings).keys
        ours = IngestionLease(direct, keys, R, "me", LeaseSettings(ttl_s=5, renew_every_s=1))
        grant = await ours.acquire()
        writer = FencedWriter(index, metrics=Metrics.create(), on_lost=lambda replica, generation: None)
        writer.hold(R, ours, grant.generation, {}, writes=grant.writes, applied=grant.applied)
        holding = writer.holdings[R]
        await writer.apply_at(R, [block(1)], 0.0, {0: 6})  # connected, scripts loaded
        proxy.delay_s = 0.4
        write = asyncio.create_task(writer.apply_at(R, [block(2)], 0.0, {0: 7}))
        for _ in range(100):  # landed in Redis; the answer is still in the proxy
            if holding.writing is not None and await direct.hget(keys.applied_seq, R) == holding.writing:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the write did not land")
        assert not write.done()
        await direct.delete(keys.lease(R))  # expired while Redis was away
        back = await ours.acquire()
        assert back.acquired and back.generation == grant.generation + 1
        assert back.applied != holding.applied  # the old check gave the lease up here
        assert holding.wrote_last(back.applied)
        assert not holding.wrote_last("0:7@9")  # someone else's positions are not ours
        await write
        assert holding.applied == back.applied and holding.writing is None
    finally:
        await slow.aclose()
        await direct.aclose()
        await proxy.stop()


async def test_an_expired_lease_taken_back_by_its_holder_keeps_the_generation_it_writes_with(
    index: RedisIndex,
) -> None:
    """Redis back after an outage longer than the TTL: the holder takes its own lease back with the
    generation its writer still uses (nobody took the lease since), so the writer's next write,
    the batches queued during the outage, lands at once instead of being refused as stale and sent
    again (after a restart under load that redo cost up to 0.7 s a replica). Had another owner taken
    the lease meanwhile, the generation is bumped as for any new holder, and the old one is fenced."""
    ours = lease(index, "me")
    grant = await ours.acquire()
    metrics = Metrics.create()
    writer = FencedWriter(index, metrics=metrics, on_lost=lambda replica, generation: None)
    writer.hold(R, ours, grant.generation, {}, writes=grant.writes, applied=grant.applied)
    await writer.apply_at(R, [block(1)], 0.0, {0: 6})
    await index.client.delete(index.keys.lease(R))  # expired while Redis was away
    back = await ours.acquire(keep_generation=grant.generation)
    assert back.acquired and back.generation == grant.generation
    assert await index.client.hget(index.keys.generations, R) == str(grant.generation)
    await writer.apply_at(R, [block(2)], 0.0, {0: 7})  # the write queued during the outage
    stale = metrics.registry.get_sample_value("kvlb_redis_stale_writes_total")
    assert stale == 0  # landed at once: not fenced, not redone
    assert writer.holdings[R].writes == 2 and writer.holdings[R].generation == grant.generation

    await index.client.delete(index.keys.lease(R))  # expired again; another owner takes it and goes
    other = await lease(index, "other").acquire()
    assert other.generation == grant.generation + 1
    await index.client.delete(index.keys.lease(R))
    again = await ours.acquire(keep_generation=grant.generation)  # no longer the stored one: bumped
    assert again.acquired and again.generation == grant.generation + 2
    with pytest.raises(StaleGenerationError):
        await index.apply(R, [block(3)], 0.0, generation=grant.generation, seq=8)
    with pytest.raises(StaleGenerationError):  # nor the other owner's
        await index.apply(R, [block(3)], 0.0, generation=other.generation, seq=8)


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        LeaseSettings(ttl_s=1.0, renew_every_s=1.0)


async def test_retire_deletes_the_position_unless_another_holds_the_lease_and_tolerates_garbage(
    index: RedisIndex,
) -> None:
    holder, late = lease(index, "holder"), lease(index, "late")
    grant = await holder.acquire()
    await index.apply(R, [block(1)], 0.0, generation=grant.generation, seq=7)
    assert not await late.retire()  # not its lease (its discovery dropped the replica late): no effect
    assert await index.client.hget(index.keys.applied_seq, R) == "7"
    assert await holder.retire()
    assert await holder.holder() is None
    assert await index.client.hget(index.keys.applied_seq, R) is None
    assert await index.client.hget(index.keys.generations, R) is None  # gone, the pool's floor kept it:
    assert await index.client.hget(index.keys.counters, "gen_floor") == str(grant.generation)
    with pytest.raises(StaleGenerationError):  # so the old generation stays fenced
        await index.apply(R, [block(2)], 0.0, generation=grant.generation, seq=8)
    again = await late.acquire()  # the same id found again: a new replica, without positions
    assert again.acquired and again.applied == "" and again.generation == grant.generation + 1
    with pytest.raises(StaleGenerationError):
        await index.apply(R, [block(2)], 0.0, generation=grant.generation, seq=8)
    await index.client.delete(index.keys.applied_seq)
    await index.client.set(index.keys.applied_seq, "garbage")
    assert await late.retire()  # garbage over `seq` is deleted and counted, the lease still goes
    assert await late.holder() is None
    assert await index.client.hget(index.keys.counters, "wrongtype_seq") == "1"
    await index.client.hset(index.keys.applied_seq, R, "9")  # a position whose lease expired unseen:
    assert not await holder.retire()  # nobody holds the lease, so the position goes all the same
    assert await index.client.hget(index.keys.applied_seq, R) is None


async def test_churned_replica_ids_leave_no_generation_or_position_and_stay_fenced(index: RedisIndex) -> None:
    """Pods renamed at every rollout: each id is leased, written, dropped and retired. ``gen`` and
    ``seq`` end empty (one pool-wide floor in the counters instead), an id found again starts above
    every generation it had, and each old life's generation is refused."""
    old: list[tuple[ReplicaId, int]] = []
    for step in range(30):
        replica = ReplicaId(f"pod-{step % 10}-{step}" if step < 20 else f"pod-{step % 10}")
        holder = IngestionLease(index.client, index.keys, replica, f"b{step % 2}", LeaseSettings())
        grant = await holder.acquire()
        assert grant.acquired and grant.applied == ""
        await index.apply(replica, [block(step + 1)], 0.0, generation=grant.generation, seq=step)
        await index.drop_replica(replica)  # as the lease manager does before retiring
        assert await holder.retire()
        old.append((replica, grant.generation))
        assert await index.client.hlen(index.keys.generations) == 0
        assert await index.client.hlen(index.keys.applied_seq) == 0
    floor = int(await index.client.hget(index.keys.counters, "gen_floor"))
    assert floor == max(generation for _, generation in old) + 1  # the drop's bump, the largest
    for replica, generation in old:
        with pytest.raises(StaleGenerationError):
            await index.apply(replica, [block(99)], 0.0, generation=generation, seq=99)
    # Also after garbage over `gen` was once repaired (a missing field is then taken as the writer's
    # own, unless its generation is at or below the floor: a retired one)
    await index.client.set(index.keys.generations, "garbage")
    fresh = IngestionLease(index.client, index.keys, ReplicaId("pod-new"), "b0", LeaseSettings())
    assert (await fresh.acquire()).generation == floor + 1  # (the acquire repaired `gen`)
    assert await index.client.hget(index.keys.counters, "wrongtype_gen") == "1"
    for replica, generation in old:
        with pytest.raises(StaleGenerationError):
            await index.apply(replica, [block(99)], 0.0, generation=generation, seq=99)
    assert await index.client.hkeys(index.keys.generations) == ["pod-new"]  # nothing written back
