"""Issue #17: every index script declares every key it touches (real ``redis-server``).

The scripts reach every key through one ``call`` that refuses a key not in ``KEYS``, so the contract
suite, the Redis index tests and the Cluster runs (which exercise every path) prove the declaration
at run time. Here: the refusal itself, the check-before-write (a call whose keys moved writes
nothing and asks to be retried), and that no script reaches Redis another way.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis_server import RedisServer, fresh_settings

from balancer.events import Removed, Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.redis import scripts
from balancer.index.redis.index import RedisIndex
from balancer.index.redis.schema import RedisKeys, cache_id
from balancer.types import EngineHash, ReplicaId

pytestmark = pytest.mark.redis

BS = 4
HASHER = BlockHasher("declared", BS)
A = ReplicaId("a")
SCRIPTS = {
    name: getattr(scripts, name)
    for name in ("APPLY", "SPECULATE", "DROP", "CLEAR_STEP", "EXPIRE", "EVICT", "COMPACT", "MATCH", "STATS")
}


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    conn = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    yield conn
    await conn.aclose()


def stored(first: int, blocks: int, parent: int | None = None) -> Stored:
    tokens = pack_tokens(range(first * BS, (first + blocks) * BS))
    ehs = tuple(EngineHash(first + i) for i in range(blocks))
    return Stored(0, None if parent is None else EngineHash(parent), ehs, tokens, BS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_script_reaches_redis_only_through_the_checking_call(name: str) -> None:
    text = SCRIPTS[name]
    assert text.startswith(scripts.PRELUDE)
    # the one `redis.call` with a key is inside `call`, after its check of `D` (the declared keys);
    # the other is the stream's epoch, `TIME`, which names no key
    assert len(re.findall(r"redis\.(p?call)\(", text)) - text.count("redis.call('TIME')") == 1
    wrapper = text[text.index("local function call(") :]
    assert wrapper.index("if not D[key] then error(") < wrapper.index("redis.call(")


async def test_an_undeclared_key_is_refused_by_the_script(client: aioredis.Redis) -> None:
    keys = RedisKeys(fresh_settings())
    match = client.register_script(scripts.MATCH)
    with pytest.raises(ResponseError, match="undeclared key"):
        # a MATCH over one block whose ``b:`` key is not declared
        await match(keys=keys.fixed, args=[keys.prefix, "0", -1, "00000000000000aa"])


async def test_apply_whose_keys_moved_writes_nothing_and_asks_for_a_retry(client: aioredis.Redis) -> None:
    index = RedisIndex(client, HASHER, fresh_settings())
    await index.apply(A, [stored(1, 3)], now=0.0)
    before = await client.dump(index.keys.engine_map(cache_id(A, 0)))
    lru_before = await client.zrange(index.keys.lru, 0, -1)
    # Removing engine hash 1 releases its block: a call that declares the map but not that block
    # (the caller's read is stale) must refuse before writing anything.
    apply = client.register_script(scripts.APPLY)
    mk = index.keys.engine_map(cache_id(A, 0))
    args = [index.keys.prefix, A, "", 100, 99, 512, 0, 0, b"", "", 0, "R", 0, "0000000000000001"]
    reply = await apply(
        keys=[*index.keys.fixed, index.keys.ranks(A), index.keys.speculative(A), mk], args=args
    )
    assert reply[0] == scripts.RETRY
    assert await client.dump(mk) == before
    assert await client.zrange(index.keys.lru, 0, -1) == lru_before
    # the index's own call reads the keys first, so the same removal goes through
    result = await index.apply(A, [Removed(0, (EngineHash(1),))], now=1.0)
    assert result.removed_blocks == 1
    assert index.key_retries == 0
    await index.aclose()


async def test_eviction_declares_its_victims_and_finishes_past_a_moved_head(client: aioredis.Redis) -> None:
    """A writer's victims are read before its call; blocks another writer added in between are left
    to the ``EVICT`` round that follows, and the pool ends within its capacity."""
    settings = fresh_settings(capacity_blocks=64)
    one, two = RedisIndex(client, HASHER, settings), RedisIndex(client, HASHER, settings)
    for i in range(12):
        await (one if i % 2 else two).apply(ReplicaId(f"r{i % 3}"), [stored(100 * i + 1, 16)], now=float(i))
        assert await client.zcard(one.keys.lru) <= settings.capacity_blocks
    stats = await one.stats()
    assert stats.unique_blocks <= settings.capacity_blocks
    counters = await one.counters()
    assert counters["evicted_blocks"] == 12 * 16 - stats.unique_blocks
    await one.aclose()
    await two.aclose()
