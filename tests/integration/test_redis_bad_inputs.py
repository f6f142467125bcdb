"""Issue #17: garbage written into kvlb's Redis namespace (real ``redis-server``).

* defect 2: an undecodable stream entry is skipped once (counted), never re-read; one that carried
  an entry number rebuilds the mirror;
* defect 6: a wrong-typed lease, ``seq`` or ``gen`` key is detected, counted and repaired on the next
  write, and the writer keeps its lease.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis_server import RedisServer, fresh_settings
from test_redis_index import HASHER, random_event
from test_redis_mirror import assert_same_matches

from balancer.fleet.writer import FencedWriter
from balancer.index.redis.index import RedisIndex
from balancer.index.redis.lease import IngestionLease, LeaseSettings
from balancer.index.redis.mirror import Mirror, MirrorSettings
from balancer.metrics import Metrics
from balancer.types import ReplicaId

pytestmark = pytest.mark.redis

A = ReplicaId("r0")


@pytest.fixture
async def text_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    conn = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    yield conn
    await conn.aclose()


@pytest.fixture
async def raw_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    conn = aioredis.Redis.from_url(redis_server.url, decode_responses=False)
    yield conn
    await conn.aclose()


async def write(writer: RedisIndex, rng: random.Random, batches: int) -> None:
    for step in range(batches):
        await writer.apply(A, [random_event(rng) for _ in range(3)], float(step))


async def poll_until_idle(mirror: Mirror) -> None:
    for _ in range(5):
        await mirror.poll(block_ms=5)


@pytest.mark.parametrize("numbered", [False, True], ids=["garbage", "numbered-garbage"])
async def test_an_undecodable_stream_entry_is_skipped_once(
    text_client: aioredis.Redis, raw_client: aioredis.Redis, numbered: bool
) -> None:
    """``XADD <events> * garbage x`` made ``poll`` re-read the same entry forever (defect 2)."""
    settings = fresh_settings()
    writer = RedisIndex(text_client, HASHER, settings)
    rng = random.Random(17)
    mirror = Mirror(raw_client, HASHER, settings, time.monotonic, MirrorSettings(read_count=4))
    await mirror.warm_start()
    await write(writer, rng, 5)
    number = (await writer.counters())["stream_entries"] + 1
    bad = {"r": "r0", "n": number, "e": b"\xc1garbage"} if numbered else {"garbage": "x"}
    await text_client.xadd(writer.keys.stream, bad)  # type: ignore[arg-type]
    if numbered:
        await text_client.hincrby(writer.keys.counters, "stream_entries", 1)
    await poll_until_idle(mirror)  # the bad entry is the last one: it used to be read again and again
    skipped = mirror.counters.decode_errors
    assert 1 <= skipped <= 2  # once, and once more by the rebuild's replay
    await write(writer, rng, 5)
    await poll_until_idle(mirror)
    assert mirror.counters.decode_errors == skipped
    assert mirror.counters.resyncs == (1 if numbered else 0)
    assert mirror.last_number == (await writer.counters())["stream_entries"]
    assert mirror.partial == numbered  # the skipped entry's batch is unknown to the mirror
    if not numbered:
        await assert_same_matches(writer, [mirror], rng)
    late = Mirror(raw_client, HASHER, settings, time.monotonic, MirrorSettings(read_count=4))
    await late.warm_start()  # a warm start skips it too
    assert late.last_number == mirror.last_number


@pytest.mark.parametrize("kind", ["lease", "seq", "gen", "ctr"])
async def test_a_wrong_typed_key_is_repaired_and_the_lease_kept(
    text_client: aioredis.Redis, kind: str
) -> None:
    """Garbage (a LIST) over the lease, ``seq``, ``gen`` or ``ctr`` key cost the writer its lease with
    WRONGTYPE (defect 6): now the next renewal or write deletes it, counts it and goes on."""
    index = RedisIndex(text_client, HASHER, fresh_settings())
    keys = index.keys
    lease = IngestionLease(text_client, keys, A, "me", LeaseSettings(ttl_s=5, renew_every_s=1))
    lost: list[ReplicaId] = []
    writer = FencedWriter(
        index, metrics=Metrics.create(), on_lost=lambda replica, generation: lost.append(replica)
    )
    grant = await lease.acquire()
    assert grant.acquired
    writer.hold(A, lease, grant.generation, {}, writes=grant.writes, applied=grant.applied)
    rng = random.Random(6)
    await writer.apply_at(A, [random_event(rng) for _ in range(3)], 0.0, {0: 1})
    key = {"lease": keys.lease(A), "seq": keys.applied_seq, "gen": keys.generations, "ctr": keys.counters}[
        kind
    ]
    await text_client.delete(key)
    await text_client.rpush(key, "garbage")  # type: ignore[misc]

    assert await lease.renew()  # the renewal repairs a garbage lease and keeps it ours
    other = IngestionLease(text_client, keys, A, "other", LeaseSettings(ttl_s=5, renew_every_s=1))
    assert not (await other.acquire()).acquired
    for seq in (2, 3):
        await writer.apply_at(A, [random_event(rng) for _ in range(3)], 0.0, {0: seq})
    assert not lost and await lease.holder() == "me"
    assert lease.repaired_keys + other.repaired_keys + index.repaired_keys == 1
    counters = await index.counters()
    assert counters[f"wrongtype_{kind}"] == 1
    assert await text_client.type(key) == ("string" if kind == "lease" else "hash")
    grant = await lease.acquire()  # positions and generation are in Redis again
    assert grant.acquired and grant.positions == {0: 3}
    assert grant.generation == writer.holdings[A].generation
