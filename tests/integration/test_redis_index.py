"""``RedisIndex`` against a real private ``redis-server`` and a real 3 + 3 Redis Cluster (the
``redis_target`` parameter): equivalence with ``MemoryIndex``, fencing, batching, pools on different
cluster masters, memory per block (single server only).

The differential test drives both indexes with the same seeded random batches (several events per
``apply``, parents defined inside and outside the batch, second handles, removals, clears, drops,
speculative entries with expiry, a tiny LRU budget) and requires identical results after every step.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis_cluster import RedisClusterProcs, RedisTarget
from redis_server import RedisServer, fresh_settings

from balancer.events import Cleared, KvEvent, Removed, Resync, Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.memory import MemoryIndex
from balancer.index.redis.client import RedisClient
from balancer.index.redis.index import RedisIndex, StaleGenerationError
from balancer.index.redis.schema import RedisIndexSettings
from balancer.metrics import Metrics
from balancer.types import EngineHash, ReplicaId

pytestmark = pytest.mark.redis

BS = 2
HASHER = BlockHasher("diff", BS)
REPLICAS = [ReplicaId(name) for name in ("r0", "r1", "r2")]
Path = tuple[int, ...]


@pytest.fixture
async def client(redis_target: RedisTarget) -> AsyncIterator[RedisClient]:
    conn = redis_target.client(decode=True)
    yield conn
    await conn.aclose()


@pytest.fixture
async def server_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    conn = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    yield conn
    await conn.aclose()


def make_index(client: RedisClient, settings: RedisIndexSettings | None = None) -> RedisIndex:
    return RedisIndex(client, HASHER, settings or fresh_settings())


def engine_hash(path: Path, handle: int) -> EngineHash:
    return EngineHash(hash((path, handle, "diff")) & 0xFFFF_FFFF_FFFF_FFFF)


def tokens(path: Sequence[int]) -> list[int]:
    return [letter + 1 for letter in path for _ in range(BS)]


def random_path(rng: random.Random) -> Path:
    return tuple(rng.randrange(4) for _ in range(rng.randint(1, 5)))


def random_event(rng: random.Random) -> KvEvent:
    rank = rng.randrange(2)
    path = random_path(rng)
    handle = 0 if rng.random() < 0.8 else 1
    kind = rng.random()
    if kind < 0.6:
        split = rng.randrange(len(path))
        parent = None if split == 0 else engine_hash(path[:split], handle)
        ehs = tuple(engine_hash(path[: i + 1], handle) for i in range(split, len(path)))
        size = BS if rng.random() < 0.97 else BS * 2
        return Stored(rank, parent, ehs, pack_tokens(tokens(path[split:])), size)
    if kind < 0.9:
        ends = {len(path), rng.randint(1, len(path))}
        return Removed(rank, tuple(engine_hash(path[:n], handle) for n in sorted(ends)))
    return Cleared(rank) if kind < 0.95 else Resync(rank, "gap")


async def compare_matches(
    memory: MemoryIndex, redis_index: RedisIndex, rng: random.Random, now: float
) -> None:
    for _ in range(3):
        keys = HASHER.request_keys(tokens(random_path(rng)))
        among = None if rng.random() < 0.5 else rng.sample(REPLICAS, rng.randint(0, 3))
        want = await memory.match(keys, among, now)
        got = await redis_index.match(keys, among, now)
        assert got.blocks == want.blocks
        assert got.request_blocks == want.request_blocks


async def compare_stats(memory: MemoryIndex, redis_index: RedisIndex) -> None:
    want, got = await memory.stats(), await redis_index.stats()
    assert (got.unique_blocks, got.held_blocks) == (want.unique_blocks, want.held_blocks)
    assert got.blocks_by_replica == want.blocks_by_replica
    assert got.speculative_entries == want.speculative_entries


@pytest.mark.parametrize(
    ("seed", "capacity", "writers"),
    [(1, 100_000, 1), (2, 100_000, 1), (3, 6, 1), (4, 9, 1), (5, 20, 1), (6, 100_000, 2), (7, 9, 2)],
)
async def test_same_results_as_memory_index(
    client: RedisClient, seed: int, capacity: int, writers: int
) -> None:
    """With two writers on one pool, each one's parent hints go stale and must be caught."""
    rng = random.Random(seed)
    memory = MemoryIndex.with_capacity(HASHER, capacity)
    settings = fresh_settings(capacity)
    indexes = [make_index(client, settings) for _ in range(writers)]
    now = 0.0
    for _ in range(150):
        now += rng.choice((0.0, 0.1, 0.5))
        action = rng.random()
        redis_index = rng.choice(indexes)
        if action < 0.75:
            replica = rng.choice(REPLICAS)
            batch = [random_event(rng) for _ in range(rng.randint(1, 5))]
            want = await memory.apply(replica, batch, now)
            got = await redis_index.apply(replica, batch, now)
            assert asdict(got) == asdict(want)
        elif action < 0.9:
            replica = rng.choice(REPLICAS)
            keys = HASHER.request_keys(tokens(random_path(rng)))
            ttl_s = rng.choice((0.0, 0.3, 1.0))
            await memory.add_speculative(replica, keys, ttl_s, now)
            await redis_index.add_speculative(replica, keys, ttl_s, now)
        elif action < 0.95:
            replica = rng.choice(REPLICAS)
            assert await redis_index.drop_replica(replica) == await memory.drop_replica(replica)
        await compare_matches(memory, redis_index, rng, now)
        await compare_stats(memory, redis_index)
    if writers > 1:
        assert sum(index.hint_retries for index in indexes) > 0  # the retry path ran


def chain(first: int, blocks: int, parent: int | None = None, base_hash: int = 0) -> Stored:
    ehs = tuple(EngineHash(base_hash + first + i) for i in range(blocks))
    parent_hash = None if parent is None else EngineHash(parent)
    return Stored(0, parent_hash, ehs, pack_tokens(list(range(first * BS, (first + blocks) * BS))), BS)


async def test_stale_generation_is_rejected_whole_and_counted(client: RedisClient) -> None:
    index = make_index(client)
    a = ReplicaId("a")
    assert await index.generation(a) == 0
    await index.apply(a, [chain(0, 3)], 0.0, generation=0)
    assert await index.drop_replica(a) == 3
    assert await index.generation(a) == 1
    with pytest.raises(StaleGenerationError) as caught:
        await index.apply(a, [chain(0, 3)], 1.0, generation=0)
    assert (caught.value.expected, caught.value.current) == (0, 1)
    assert (await index.stats()).unique_blocks == 0  # nothing of the stale batch landed
    assert (await index.counters())["stale_generation"] == 1
    result = await index.apply(a, [chain(0, 3)], 2.0, generation=1)
    assert result.stored_blocks == 3
    keys = HASHER.request_keys(list(range(3 * BS)))
    assert (await index.match(keys, None, 2.0)).blocks == {a: 3}


async def test_generations_are_per_replica(client: RedisClient) -> None:
    index = make_index(client)
    a, b = ReplicaId("a"), ReplicaId("b")
    await index.drop_replica(a)
    assert (await index.apply(b, [chain(0, 2)], 0.0, generation=0)).stored_blocks == 2
    with pytest.raises(StaleGenerationError):
        await index.apply(a, [], 0.0, generation=0)  # an empty batch is fenced too


async def test_batch_resolves_parents_inside_and_outside_itself(client: RedisClient) -> None:
    index = make_index(client)
    a = ReplicaId("a")
    await index.apply(a, [chain(0, 2)], 0.0)  # engine hashes 0, 1
    batch: list[KvEvent] = [
        chain(2, 2, parent=1),  # parent from Redis
        chain(4, 2, parent=3),  # parent from this batch
        Removed(0, (EngineHash(5),)),
        chain(6, 1, parent=5),  # parent removed earlier in this batch: skipped
        Cleared(0),
        chain(8, 1, parent=0),  # rank cleared earlier in this batch: skipped
    ]
    result = await index.apply(a, batch, 1.0)
    assert (result.stored_blocks, result.removed_blocks, result.skipped_unknown_parent) == (4, 1, 2)
    keys = HASHER.request_keys(list(range(8 * BS)))
    assert (await index.match(keys, None, 1.0)).blocks == {a: 0}  # the clear came last


async def test_other_pools_are_untouched(client: RedisClient) -> None:
    one, two = make_index(client), make_index(client)
    a = ReplicaId("a")
    await one.apply(a, [chain(0, 4)], 0.0)
    keys = HASHER.request_keys(list(range(4 * BS)))
    assert (await two.match(keys, None, 0.0)).blocks == {}
    await two.drop_replica(a)
    assert (await one.match(keys, None, 0.0)).blocks == {a: 4}
    names = [name async for name in client.scan_iter(match="*")]
    assert all(name.startswith((one.keys.prefix, two.keys.prefix)) for name in names)
    assert any("{" + one.settings.pool + "}" in name for name in names)


async def test_redis_memory_per_held_block(server_client: aioredis.Redis) -> None:
    """Bytes of Redis memory per held block, measured with ``INFO memory`` (printed with -s)."""
    client = server_client
    index = make_index(client)
    replicas, chains, chain_blocks = 4, 40, 32
    before = (await client.info("memory"))["used_memory"]
    for r in range(replicas):
        batch = [chain(c * chain_blocks, chain_blocks, base_hash=r << 32) for c in range(chains)]
        await index.apply(ReplicaId(f"replica-{r}"), batch, 0.0)
    stats = await index.stats()
    after = (await client.info("memory"))["used_memory"]
    assert stats.held_blocks == replicas * chains * chain_blocks
    assert stats.unique_blocks == chains * chain_blocks  # every replica holds the same chains
    per_held = (after - before) / stats.held_blocks
    per_unique = (after - before) / stats.unique_blocks
    print(f"redis bytes per held block {per_held:.0f}, per unique block {per_unique:.0f}")
    assert 16 < per_held < 2000


def pools_on_distinct_masters(cluster: RedisClusterProcs, count: int) -> list[str]:
    """``count`` pool names whose ``{pool}`` hash tags are served by ``count`` different masters."""
    chosen: dict[int, str] = {}
    for n in range(200):
        name = f"spread-{n}"
        master = cluster.master_port("kvlb:{" + name + "}:ctr")
        chosen.setdefault(master, name)
        if len(chosen) == count:
            return list(chosen.values())
    raise AssertionError(f"no {count} pools on distinct masters among 200 names")


async def test_pools_on_different_cluster_masters_stay_apart(redis_cluster: RedisClusterProcs) -> None:
    """Three pools on three masters: each pool's keys live on its own master only, each answers
    only from its own keys, and a drop in one leaves the others alone."""
    client = RedisTarget("cluster", redis_cluster.url, redis_cluster).client(decode=True)
    try:
        await _pools_stay_apart(redis_cluster, client)
    finally:
        await client.aclose()


async def _pools_stay_apart(redis_cluster: RedisClusterProcs, client: RedisClient) -> None:
    names = pools_on_distinct_masters(redis_cluster, 3)
    indexes = [make_index(client, RedisIndexSettings(pool=name, capacity_blocks=1000)) for name in names]
    a = ReplicaId("a")
    for number, index in enumerate(indexes):
        await index.apply(a, [chain(100 * number, 3 + number)], 0.0)
    masters = [redis_cluster.master_port(index.keys.counters) for index in indexes]
    assert len(set(masters)) == 3, masters
    assert len({key_slot(index.keys.counters.encode()) for index in indexes}) == 3
    for index, port in zip(indexes, masters, strict=True):
        with redis_cluster.node(port).client() as node:
            names_here = node.keys("*")
        assert names_here and all(index.keys.prefix in name for name in names_here), names_here
        assert (await index.stats()).held_blocks == 3 + indexes.index(index)
    await indexes[0].drop_replica(a)
    assert [(await index.stats()).held_blocks for index in indexes] == [0, 4, 5]


async def test_parent_hints_dropped_at_the_cap_are_exported(redis_server: RedisServer) -> None:
    """The writer's parent hints keep ``parent_hints_per_cache`` a cache, oldest out first; each one
    dropped is counted and exported as ``kvlb_redis_parent_hints_dropped_total{space}`` (they went
    uncounted). A dropped hint costs ``APPLY`` a retry, never a wrong key: the chain still stores."""
    settings = dataclasses.replace(fresh_settings(), parent_hints_per_cache=4)
    index = RedisIndex.from_url(redis_server.url, HASHER, settings)
    metrics = Metrics.create()
    metrics.parent_hints_dropped.source = lambda: {settings.pool: index.hints_dropped}
    a = ReplicaId("a")
    try:
        assert (await index.apply(a, [chain(0, 3)], 0.0)).stored_blocks == 3
        assert (
            metrics.registry.get_sample_value(
                "kvlb_redis_parent_hints_dropped_total", {"space": settings.pool}
            )
            == 0
        )
        assert (await index.apply(a, [chain(3, 7, parent=2)], 1.0)).stored_blocks == 7
        assert index.hints_dropped == 6  # 10 blocks stored, 4 hinted
        assert (await index.apply(a, [chain(0, 2, parent=1, base_hash=100)], 2.0)).stored_blocks == 2
        sample = metrics.registry.get_sample_value
        assert sample("kvlb_redis_parent_hints_dropped_total", {"space": settings.pool}) == 8
    finally:
        await index.aclose()
