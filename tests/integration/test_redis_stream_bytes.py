"""The applied-event stream's byte bound (``stream_max_bytes``) against a real private ``redis-server``
and a real 3 + 3 Redis Cluster (the ``redis_target`` parameter).

Before 2026-12-01 (h-streambytes) the stream was bounded in entries only: 10,000 entries of up to
512 blocks each, about 430 MB per key space for 16-token blocks. Each append now also trims the
oldest entries until the fields of the rest fit in ``stream_max_bytes``; the sizes live in the
``evbytes`` list, in the key space's slot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import pytest
from kvlb_harness import metric_value, shared_deepseek, wait_for
from redis_cluster import RedisTarget
from redis_server import RedisServer, fresh_settings
from test_redis_fleet import completion, fleet, holding_all
from test_redis_index import HASHER

from balancer.events import Removed, Stored
from balancer.fleet.snapshots import SnapshotKeeper
from balancer.index.redis.client import RedisClient
from balancer.index.redis.index import RedisIndex
from balancer.index.redis.mirror import Mirror, MirrorSettings
from balancer.index.redis.schema import RedisIndexSettings
from balancer.metrics import Metrics
from balancer.types import EngineHash, ReplicaId

pytestmark = pytest.mark.redis

A = ReplicaId("a")


@pytest.fixture
async def text_client(redis_target: RedisTarget) -> AsyncIterator[RedisClient]:
    conn = redis_target.client(decode=True)
    yield conn
    await conn.aclose()


@pytest.fixture
async def raw_client(redis_target: RedisTarget) -> AsyncIterator[RedisClient]:
    conn = redis_target.client(decode=False)
    yield conn
    await conn.aclose()


def settings_of(max_bytes: int, maxlen: int = 10_000) -> RedisIndexSettings:
    return dataclasses.replace(fresh_settings(100_000, stream_maxlen=maxlen), stream_max_bytes=max_bytes)


def store(first: int, blocks: int) -> Stored:
    """``blocks`` new blocks in one chain (about ``8 × blocks`` bytes of tokens in the entry)."""
    hashes = tuple(EngineHash(first + i) for i in range(blocks))
    return Stored(0, None, hashes, bytes(4 * HASHER.block_size * blocks), HASHER.block_size)


async def retained_bytes(raw_client: RedisClient, stream: str) -> list[int]:
    """The size of each retained entry, as the bound counts it: its fields' names and values."""
    entries = await raw_client.xrange(stream)
    return [sum(len(k) + len(v) for k, v in fields.items()) for _id, fields in entries]


async def test_the_stream_keeps_within_its_bytes(text_client: RedisClient, raw_client: RedisClient) -> None:
    """200 entries of about 1.2 kB under a bound of 20,000 B: the stream keeps the newest entries
    that fit (16 or so), every trim is counted, and the sizes list follows the stream."""
    settings = settings_of(20_000)
    writer = RedisIndex(text_client, HASHER, settings)
    for i in range(200):
        await writer.apply(A, [store(1000 * i + 1, 64)], float(i))
    sizes = await retained_bytes(raw_client, writer.keys.stream)
    assert sum(sizes) <= 20_000
    assert sum(sizes) + max(sizes) > 20_000  # as many as fit: one more would not
    assert 10 <= len(sizes) < 200
    counters = await writer.counters()
    assert counters["stream_entries"] == 200
    assert counters["stream_byte_trims"] == 200 - len(sizes) == writer.stream_byte_trims
    assert await text_client.llen(writer.keys.stream_sizes) == len(sizes)
    first, *_ = await text_client.lrange(writer.keys.stream_sizes, 0, 0)
    oldest = await raw_client.xrange(writer.keys.stream, count=1)
    assert first.split()[0] == oldest[0][0].decode()  # the list's head is the stream's oldest entry


async def test_drops_and_receipts_are_bounded_too(text_client: RedisClient, raw_client: RedisClient) -> None:
    """``DROP`` and ``DROP_BLOCKS`` append through the same bound (and count what they trim)."""
    settings = settings_of(6_000)
    writer = RedisIndex(text_client, HASHER, settings)
    for i in range(10):
        await writer.apply(A, [store(1000 * i + 1, 64)], float(i))  # about 1.2 kB each
    keys = HASHER.request_keys(list(range(8 * HASHER.block_size)))
    before = writer.stream_byte_trims
    await writer.apply(ReplicaId("b"), [store(900_001, 8)], 0.0)
    await writer.drop_blocks(ReplicaId("b"), keys)
    await writer.drop_replica(A)
    sizes = await retained_bytes(raw_client, writer.keys.stream)
    assert sum(sizes) <= 6_000
    assert writer.stream_byte_trims > before
    assert (await writer.counters())["stream_byte_trims"] == writer.stream_byte_trims


async def test_the_newest_entry_stays_whatever_its_size(
    text_client: RedisClient, raw_client: RedisClient
) -> None:
    settings = settings_of(1_000)
    writer = RedisIndex(text_client, HASHER, settings)
    await writer.apply(A, [store(1, 64)], 0.0)  # 1.2 kB: over the bound alone
    await writer.apply(A, [store(1001, 128)], 1.0)
    sizes = await retained_bytes(raw_client, writer.keys.stream)
    assert len(sizes) == 1 and sizes[0] > 1_000
    assert (await writer.counters())["stream_entries"] == 2


async def test_a_mirror_behind_the_byte_trim_rebuilds(
    text_client: RedisClient, raw_client: RedisClient
) -> None:
    """A mirror whose position the byte bound trimmed sees the numbers jump and rebuilds, as after a
    trim by ``stream_maxlen`` (partial: the first store is gone from the stream)."""
    settings = settings_of(8_000)
    writer = RedisIndex(text_client, HASHER, settings)
    mirror = Mirror(raw_client, HASHER, settings, time.monotonic, MirrorSettings(read_count=7, block_ms=50))
    assert await mirror.warm_start() == 0
    await writer.apply(A, [store(1, 4)], 0.0)
    assert await mirror.poll(block_ms=10) == 1
    for i in range(40):  # under a count bound of 10,000 nothing would be trimmed
        await writer.apply(A, [store(1000 * (i + 1), 64)], float(i))
    assert await text_client.xlen(writer.keys.stream) < 40
    await mirror.poll(block_ms=10)
    assert mirror.counters.resyncs == 1
    assert mirror.partial
    assert mirror.last_number == (await writer.counters())["stream_entries"] == 41


@pytest.mark.faults_long  # 10-15 s a target: 5,000 appends to fill
async def test_a_bound_lowered_a_lot_is_reached_in_one_append(
    text_client: RedisClient, raw_client: RedisClient
) -> None:
    """A restart with a much lower bound: the next append trims the stream down to it at once. Until
    2026-12-01 (h-streamreal) one call popped 4,096 entries at most, one at a time, so 5,000 small
    entries took two appends (and 64 MiB to 1 MiB three, of 26-35 ms of script each under load)."""
    high = RedisIndex(text_client, HASHER, settings_of(1 << 20))
    for first in range(0, 5_000, 100):  # one block an entry, about 150 B: 0.75 MB, no trim
        appends = [high.apply(ReplicaId(f"r{k}"), [store(first + k + 1, 1)], 0.0) for k in range(100)]
        await asyncio.gather(*appends)
    assert await text_client.xlen(high.keys.stream) == 5_000
    assert high.stream_byte_trims == 0
    low = RedisIndex(text_client, HASHER, dataclasses.replace(high.settings, stream_max_bytes=10_000))
    await low.apply(A, [store(900_001, 1)], 1.0)
    sizes = await retained_bytes(raw_client, low.keys.stream)
    assert sum(sizes) <= 10_000 < sum(sizes) + max(sizes)  # as many as fit, after one append
    assert low.stream_byte_trims == 5_001 - len(sizes)
    assert await text_client.llen(low.keys.stream_sizes) == len(sizes)


async def test_entries_of_an_older_release_are_trimmed_with_the_listed_ones(
    text_client: RedisClient, raw_client: RedisClient
) -> None:
    """During a roll an older balancer appends with ``MAXLEN ~`` alone and lists no size: its
    entries go uncounted, and go once a trim passes a listed entry after them."""
    settings = settings_of(8_000)
    writer = RedisIndex(text_client, HASHER, settings)
    for i in range(3):
        await writer.apply(A, [store(1000 * i + 1, 64)], float(i))
    old_ids = []
    for _ in range(3):  # what the older release's APPLY appends (no epoch before h-fleetfollow)
        number = await text_client.hincrby(writer.keys.counters, "stream_entries", 1)
        fields = {"r": "old", "n": number, "e": b"\x90" + bytes(2_000)}
        old_ids.append(await raw_client.xadd(writer.keys.stream, fields, maxlen=10_000, approximate=True))
    for i in range(3, 30):
        await writer.apply(A, [store(1000 * i + 1, 64)], float(i))
    retained = {entry_id for entry_id, _ in await raw_client.xrange(writer.keys.stream)}
    assert not retained & set(old_ids)
    assert sum(await retained_bytes(raw_client, writer.keys.stream)) <= 8_000


async def test_a_sizes_list_of_another_type_is_repaired(
    text_client: RedisClient, raw_client: RedisClient
) -> None:
    settings = settings_of(8_000)
    writer = RedisIndex(text_client, HASHER, settings)
    await text_client.set(writer.keys.stream_sizes, "garbage")
    for i in range(20):
        await writer.apply(A, [store(1000 * i + 1, 64)], float(i))
    assert (await writer.counters())["wrongtype_evbytes"] == 1
    assert writer.repaired_keys == 1
    assert sum(await retained_bytes(raw_client, writer.keys.stream)) <= 8_000


async def test_the_count_bound_still_holds_under_a_large_byte_bound(
    text_client: RedisClient, raw_client: RedisClient
) -> None:
    """The sizes list never outgrows ``stream_maxlen`` (the stream trimmed to it exactly)."""
    settings = settings_of(1 << 30, maxlen=100)
    writer = RedisIndex(text_client, HASHER, settings)
    for i in range(150):
        await writer.apply(A, [Removed(0, (EngineHash(i + 1),))], float(i))
    assert await text_client.xlen(writer.keys.stream) == 100
    assert await text_client.llen(writer.keys.stream_sizes) == 100
    assert (await writer.counters()).get("stream_byte_trims", 0) == 0


async def test_the_snapshot_keeper_writes_by_bytes(text_client: RedisClient, raw_client: RedisClient) -> None:
    """With ``every_bytes`` the snapshot follows the bytes of the entries read, so a warm start finds
    a snapshot younger than the oldest entry a byte bound keeps (here 30 entries would be far below
    ``every_entries``)."""
    settings = settings_of(40_000)
    writer = RedisIndex(text_client, HASHER, settings)
    mirror = Mirror(raw_client, HASHER, settings, time.monotonic, MirrorSettings(read_count=64, block_ms=50))
    await mirror.warm_start()
    keeper = SnapshotKeeper(
        raw_client, owner="me", interval_s=3600, every_entries=2_500, every_bytes=10_000, ttl_s=5,
        metrics=Metrics.create(),
    )  # fmt: skip
    keeper.add(mirror, writer.keys)
    await keeper.tick()  # takes the lease
    for i in range(30):
        await writer.apply(A, [store(1000 * i + 1, 64)], float(i))
        await mirror.poll(block_ms=10)
        await keeper.tick()
    assert 2 <= keeper.written <= 4  # about 36 kB read: one snapshot per 10 kB
    late = Mirror(raw_client, HASHER, settings, time.monotonic, MirrorSettings(read_count=64, block_ms=50))
    await late.warm_start()
    assert late.counters.snapshots_loaded == 1 and not late.partial


async def test_a_balancer_counts_its_byte_trims_in_its_metric(redis_server: RedisServer) -> None:
    """``kvlb_redis_stream_byte_trimmed_entries_total{space}`` on a real balancer with
    ``redis.stream_max_bytes`` at its floor (1 MiB): another writer fills the stream to just under
    the bound, then the balancer's own appends (its engines' events) trim and count."""
    async with fleet(
        RedisTarget("server", redis_server.url), shared_deepseek(), balancers=1,
        redis__stream_max_bytes=1 << 20,
    ) as f:  # fmt: skip
        (a,) = f.balancers
        runtime, _ = await holding_all(a)
        space = runtime._spaces[0]
        assert space.index.settings.stream_max_bytes == 1 << 20
        pad = RedisIndex.from_url(redis_server.url, space.index.hasher, space.index.settings)
        sizes = pad.keys.stream_sizes
        block = space.index.hasher.block_size

        async def held() -> int:
            first, last = await pad.client.lindex(sizes, 0), await pad.client.lindex(sizes, -1)
            return int(last.split()[2]) - int(first.split()[1]) if first and last else 0

        try:
            first = 10**9
            for _ in range(200):  # whole segments of 512 blocks, about 8 kB each
                if await held() >= (1 << 20) - 40_000:
                    break
                hashes = tuple(EngineHash(first + i) for i in range(2048))
                await pad.apply(
                    ReplicaId("pad"), [Stored(0, None, hashes, bytes(4 * block * 2048), block)], 0.0
                )
                first += 2048
            for _ in range(2_000):  # then entries of about 70 B
                if await held() >= (1 << 20) - 300:
                    break
                await pad.apply(ReplicaId("pad"), [Removed(0, (EngineHash(7),))], 0.0)
            assert (1 << 20) - 300 <= await held() <= 1 << 20
            assert pad.stream_byte_trims == 0
            suffix = iter(range(100_000, 101_000))

            async def counted() -> bool:
                await f.post(a, "/v1/completions", completion([next(suffix)] * 8))  # 2 new blocks
                async with f.session.get(a.url + "/metrics") as response:
                    text = await response.text()
                return (
                    metric_value(text, "kvlb_redis_stream_byte_trimmed_entries_total", space=space.name) >= 1
                )

            await wait_for("the balancer's appends to trim for bytes", counted, timeout_s=15)
            assert (await pad.counters())["stream_byte_trims"] >= 1
            assert await held() <= 1 << 20
        finally:
            await pad.aclose()
