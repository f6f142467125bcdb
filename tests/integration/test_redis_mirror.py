"""The applied-event stream and ``Mirror`` against a real private ``redis-server`` and a real 3 + 3
Redis Cluster (the ``redis_target`` parameter).

A writer ``RedisIndex`` applies seeded random batches (and drops); one mirror tails the stream
while the writes happen, another starts afterwards from the retained stream. Both must answer every
match exactly as the writer's Redis index does.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import AsyncIterator

import pytest
from redis_cluster import RedisTarget
from redis_server import fresh_settings
from test_redis_index import BS, HASHER, REPLICAS, random_event, random_path, tokens

from balancer.errors import EventDecodeError
from balancer.events import Cleared, KvEvent, Removed, Resync, Stored
from balancer.fleet.space_mirror import SpaceMirror
from balancer.index.hashing import pack_tokens
from balancer.index.locked import LockedPrefixTable
from balancer.index.redis.client import RedisClient
from balancer.index.redis.index import RedisIndex
from balancer.index.redis.mirror import Mirror, MirrorSettings
from balancer.index.redis.schema import RedisIndexSettings
from balancer.index.redis.stream import decode_batch, decode_entry, encode_batch
from balancer.index.snapshot import load_table
from balancer.index.table import PrefixTable
from balancer.sources.ingest_thread import IngestThread
from balancer.types import EngineHash, ReplicaId

pytestmark = pytest.mark.redis


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


def make_mirror(raw_client: RedisClient, settings: RedisIndexSettings) -> Mirror:
    return Mirror(raw_client, HASHER, settings, time.monotonic, MirrorSettings(read_count=7, block_ms=50))


async def write_random(writer: RedisIndex, rng: random.Random, batches: int) -> None:
    for step in range(batches):
        if rng.random() < 0.05:
            await writer.drop_replica(rng.choice(REPLICAS))
        else:
            batch = [random_event(rng) for _ in range(rng.randint(1, 5))]
            await writer.apply(rng.choice(REPLICAS), batch, float(step))


async def assert_same_matches(writer: RedisIndex, mirrors: list[Mirror], rng: random.Random) -> None:
    for _ in range(200):
        keys = HASHER.request_keys(tokens(random_path(rng)))
        among = None if rng.random() < 0.5 else rng.sample(REPLICAS, rng.randint(1, 3))
        want = await writer.match(keys, among, 0.0)
        for mirror in mirrors:
            got = await mirror.match(keys, among, 0.0)
            assert got.blocks == want.blocks
    want_stats = await writer.stats()
    for mirror in mirrors:
        got_stats = await mirror.stats()
        assert (got_stats.unique_blocks, got_stats.held_blocks) == (
            want_stats.unique_blocks,
            want_stats.held_blocks,
        )
        assert got_stats.blocks_by_replica == want_stats.blocks_by_replica


@pytest.mark.parametrize(("seed", "capacity"), [(11, 100_000), (12, 12)])
async def test_two_mirrors_converge_with_the_writer(
    text_client: RedisClient, raw_client: RedisClient, seed: int, capacity: int
) -> None:
    settings = fresh_settings(capacity)
    writer = RedisIndex(text_client, HASHER, settings)
    rng = random.Random(seed)
    tailing = make_mirror(raw_client, settings)
    stop = asyncio.Event()
    task = asyncio.create_task(tailing.run(stop))
    await asyncio.wait_for(tailing.ready.wait(), 5)
    await write_random(writer, rng, 120)
    entries = (await writer.counters())["stream_entries"]
    late = make_mirror(raw_client, settings)
    assert await late.warm_start() == entries
    for _ in range(200):  # bounded wait for the tailing mirror to catch up
        if tailing.last_number == entries:
            break
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert tailing.last_number == entries and tailing.counters.resyncs == 0
    assert not late.partial and not tailing.partial
    await assert_same_matches(writer, [tailing, late], rng)


async def test_a_trimmed_stream_makes_a_lagging_mirror_rebuild(
    text_client: RedisClient, raw_client: RedisClient
) -> None:
    settings = fresh_settings(100_000, stream_maxlen=10)
    writer = RedisIndex(text_client, HASHER, settings)
    mirror = make_mirror(raw_client, settings)
    assert await mirror.warm_start() == 0 and mirror.ready.is_set()
    a = ReplicaId("a")
    first = Stored(0, None, (EngineHash(1),), bytes(4 * HASHER.block_size), HASHER.block_size)
    await writer.apply(a, [first], 0.0)
    assert await mirror.poll(block_ms=10) == 1
    for i in range(400):  # MAXLEN ~ trims whole stream nodes (100 entries each)
        await writer.apply(a, [Removed(0, (EngineHash(1000 + i),))], 0.0)
    assert await text_client.xlen(writer.keys.stream) < 400
    await mirror.poll(block_ms=10)
    assert mirror.counters.resyncs == 1
    assert mirror.partial  # the first store was trimmed away: the copy no longer knows it
    assert mirror.last_number == (await writer.counters())["stream_entries"]


async def test_no_stream_when_disabled(text_client: RedisClient) -> None:
    writer = RedisIndex(text_client, HASHER, fresh_settings(100_000, stream_maxlen=0))
    first = Stored(0, None, (EngineHash(1),), bytes(4 * HASHER.block_size), HASHER.block_size)
    await writer.apply(ReplicaId("a"), [first], 0.0)
    await writer.drop_replica(ReplicaId("a"))
    assert await text_client.exists(writer.keys.stream) == 0


def test_batch_codec_round_trips_every_event_kind() -> None:
    events: list[KvEvent] = [
        Stored(
            1, None, (EngineHash(2**64 - 1), EngineHash(7)), b"\x01\x00\x00\x00" * 8, 4, 0, "lora", "salt"
        ),
        Stored(0, EngineHash(7), (EngineHash(8),), b"\x02\x00\x00\x00" * 5, 4, 1),
        Removed(3, (EngineHash(8), EngineHash(9))),
        Cleared(2),
        Resync(1, "gap"),
    ]
    assert decode_batch(encode_batch(events)) == events
    entry = decode_entry(b"5-1", {b"r": b"rep", b"n": b"3", b"e": encode_batch(events)})
    assert (entry.entry_id, entry.number, entry.replica, entry.events, entry.dropped) == (
        "5-1",
        3,
        "rep",
        events,
        False,
    )
    assert decode_entry("6-0", {b"r": b"rep", b"n": b"4", b"d": b"1"}).dropped
    with pytest.raises(EventDecodeError):
        decode_batch(b"\x91\x92\x09\x00")  # an unknown event tag
    with pytest.raises(EventDecodeError):
        decode_entry(b"7-0", {b"n": b"1"})


async def test_a_mirror_on_an_ingest_thread_hands_each_table_it_builds_to_the_readers_loop(
    redis_target: RedisTarget, text_client: RedisClient
) -> None:
    """Fleet mode's arrangement (``SpaceMirror``): the mirror tails and applies on an ingest thread,
    with a client used there only; each table it builds (the warm start, then a resync after a jump
    in entry numbers) is installed on the reader's loop, and ``ready`` follows the first install."""
    settings = fresh_settings(100_000)
    writer = RedisIndex(text_client, HASHER, settings)
    a = ReplicaId("a")
    path = tokens((0, 1, 2, 3))  # four blocks
    keys = HASHER.request_keys(path)
    thread = IngestThread("kvlb-test-mirror")
    await thread.start()
    client = redis_target.client(decode=False)  # used on the ingest thread's loop only
    installed: list[tuple[PrefixTable, str]] = []

    def install(table: PrefixTable) -> None:
        installed.append((table, threading.current_thread().name))

    mirror = Mirror(client, HASHER, settings, time.monotonic, MirrorSettings(block_ms=50))
    handle = SpaceMirror(thread, mirror, install, "test")
    here = threading.current_thread().name

    async def applied(number: int) -> None:
        for _ in range(5000):  # bounded: 5 s
            if handle.last_number >= number:
                return
            await asyncio.sleep(0.001)
        raise AssertionError(f"the mirror applied {handle.last_number} of {number} entries")

    try:
        await handle.start()
        await asyncio.wait_for(handle.ready.wait(), 5)
        assert [name for _, name in installed] == [here]
        first = installed[0][0]
        assert isinstance(first, LockedPrefixTable) and first is mirror.table

        hashes = tuple(EngineHash(1000 + i) for i in range(len(keys)))
        stored = Stored(0, None, hashes, pack_tokens(path), BS)
        await writer.apply(a, [stored], 0.0)
        await applied(1)
        assert first.match(keys, None, 0.0).blocks == {a: len(keys)}  # applied into the read table
        assert mirror.thread == "kvlb-test-mirror"

        # a jump in entry numbers: the mirror rebuilds, and the new table reaches this loop
        await text_client.hincrby(writer.keys.counters, "stream_entries", 5)
        await writer.apply(a, [Removed(0, (EngineHash(1000),))], 0.0)
        await applied(7)
        for _ in range(5000):
            if len(installed) == 2:
                break
            await asyncio.sleep(0.001)
        assert handle.counters.resyncs == 1
        (second, name) = installed[1]
        assert second is mirror.table and second is not first and name == here
        assert second.match(keys, None, 0.0).blocks.get(a, 0) == 0  # its first block is gone
    finally:
        await handle.aclose()
        await thread.call(client.aclose)
        await thread.stop()
    assert not any(t.name == "kvlb-test-mirror" for t in threading.enumerate())


async def test_mirrors_count_the_roots_the_engines_stored(
    text_client: RedisClient, raw_client: RedisClient
) -> None:
    """A mirror's table counts each replica's prompt roots (``PrefixTable.held_roots``) as a table
    fed the same events directly does: one that tails the stream, and one that starts from the
    other's snapshot and the entries after it."""
    settings = fresh_settings(100_000)
    writer = RedisIndex(text_client, HASHER, settings)
    direct = PrefixTable(HASHER)
    rng = random.Random(21)
    tailing = make_mirror(raw_client, settings)
    assert await tailing.warm_start() == 0

    async def write(batches: int, start: int) -> None:
        for step in range(start, start + batches):
            replica = rng.choice(REPLICAS)
            batch = [random_event(rng) for _ in range(rng.randint(1, 5))]
            await writer.apply(replica, batch, float(step))
            direct.apply(replica, batch, float(step))

    await write(80, 0)
    for _ in range(200):  # bounded: the tailing mirror catches up
        await tailing.poll(block_ms=10)
        if tailing.last_number == (await writer.counters())["stream_entries"]:
            break
    want = direct.held_roots(REPLICAS, 0.0)
    assert sum(want.values()) > 0
    assert tailing.table.held_roots(REPLICAS, 0.0) == want
    await tailing.write_snapshot()
    late = make_mirror(raw_client, settings)
    await late.warm_start()
    assert late.counters.snapshots_loaded == 1
    assert late.table.held_roots(REPLICAS, 0.0) == want
    await write(40, 80)
    for _ in range(200):
        await late.poll(block_ms=10)
        if late.last_number == (await writer.counters())["stream_entries"]:
            break
    assert late.table.held_roots(REPLICAS, 0.0) == direct.held_roots(REPLICAS, 0.0)


@pytest.mark.parametrize("how", ["stored_again", "dropped"])
async def test_a_partial_mirror_is_partial_until_it_holds_what_redis_holds(
    text_client: RedisClient, raw_client: RedisClient, how: str
) -> None:
    """The first store trimmed away before a mirror started: it stays partial (Redis holds a block it
    lacks) until the engine stores that block again, or the replica is dropped fleet-wide; then the
    count check clears the mark, also when it read Redis ahead of the mirror."""
    settings = fresh_settings(100_000, stream_maxlen=10)
    writer = RedisIndex(text_client, HASHER, settings)
    a, b = ReplicaId("a"), ReplicaId("b")
    first = Stored(0, None, (EngineHash(1),), bytes(4 * HASHER.block_size), HASHER.block_size)
    await writer.apply(a, [first], 0.0)
    for i in range(400):  # MAXLEN ~ trims whole stream nodes (100 entries each)
        await writer.apply(a, [Removed(0, (EngineHash(1000 + i),))], 0.0)
    mirror = make_mirror(raw_client, settings)
    await mirror.warm_start()
    assert mirror.partial and mirror.table.held_blocks(a) == 0
    assert await mirror.check_partial()  # Redis holds a's block, the mirror does not
    other = Stored(0, None, (EngineHash(2),), bytes([1] * 4 * HASHER.block_size), HASHER.block_size)
    await writer.apply(b, [other], 0.0)  # the check reads Redis one entry ahead of the mirror
    if how == "stored_again":
        await writer.apply(a, [first], 0.0)
    else:
        await writer.drop_replica(a)
    assert await mirror.check_partial()  # read two entries ahead of the mirror: decided later
    assert await mirror.poll(block_ms=10) == 2
    assert not mirror.partial and mirror.counters.partial_cleared == 1
    assert mirror.table.held_blocks(a) == (1 if how == "stored_again" else 0)
    assert not load_table(mirror.snapshot(), HASHER, mirror.limits).partial  # snapshots lose the mark


async def test_a_tailing_partial_mirror_checks_itself_against_redis(
    text_client: RedisClient, raw_client: RedisClient
) -> None:
    """The same through :meth:`Mirror.run`: the tailing mirror checks every ``partial_check_s``."""
    settings = fresh_settings(100_000, stream_maxlen=10)
    writer = RedisIndex(text_client, HASHER, settings)
    a = ReplicaId("a")
    first = Stored(0, None, (EngineHash(1),), bytes(4 * HASHER.block_size), HASHER.block_size)
    await writer.apply(a, [first], 0.0)
    for i in range(400):
        await writer.apply(a, [Removed(0, (EngineHash(1000 + i),))], 0.0)
    mirror = Mirror(
        raw_client, HASHER, settings, time.monotonic, MirrorSettings(block_ms=50, partial_check_s=0.05)
    )
    stop = asyncio.Event()
    task = asyncio.create_task(mirror.run(stop))
    try:
        await asyncio.wait_for(mirror.ready.wait(), 5)
        await asyncio.sleep(0.3)  # several checks: Redis still holds a block the mirror lacks
        assert mirror.partial
        await writer.apply(a, [first], 0.0)
        for _ in range(100):  # bounded: 5 s
            if not mirror.partial:
                break
            await asyncio.sleep(0.05)
        assert not mirror.partial and mirror.table.held_blocks(a) == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_a_stream_restarted_within_the_millisecond_of_the_last_read_rebuilds_the_mirror(
    text_client: RedisClient, raw_client: RedisClient
) -> None:
    """Redis loses the key space (its keys deleted, as a ``FLUSHALL`` does) and its stream restarts at
    the same IDs: ``XREAD`` skips the new entries up to the last ID read, and the first one after it
    carries the number after the last one read. Only the stream's epoch (``g``) tells the two lives
    apart: the mirror rebuilds from the new stream and holds what Redis holds. The same millisecond
    is made sure of by a first entry (no ``n``: not a batch) with an ID in the future."""
    settings = fresh_settings(100_000)
    writer = RedisIndex(text_client, HASHER, settings)
    mirror = make_mirror(raw_client, settings)
    assert await mirror.warm_start() == 0
    future_ms = int(time.time() * 1000) + 3_600_000
    a, b = ReplicaId("a"), ReplicaId("b")

    def block(byte: int) -> Stored:
        return Stored(0, None, (EngineHash(byte),), bytes([byte] * 4 * HASHER.block_size), HASHER.block_size)

    await text_client.xadd(writer.keys.stream, {"r": "-"}, id=f"{future_ms}-0")
    for byte in (1, 2):  # the first life: entries 1 and 2 at IDs future-1 and future-2
        await writer.apply(a, [block(byte)], 0.0)
    assert await mirror.poll(block_ms=10) == 2 and mirror.last_number == 2
    async for key in text_client.scan_iter(match=writer.keys.prefix + "*"):
        await text_client.delete(key)
    await text_client.xadd(writer.keys.stream, {"r": "-"}, id=f"{future_ms}-0")
    for byte in (3, 4, 5):  # the second life: entries 1, 2 (skipped by XREAD) and 3, at future-1..3
        await writer.apply(b, [block(byte)], 0.0)
    await mirror.poll(block_ms=10)
    assert mirror.counters.resyncs == 1
    assert (mirror.table.held_blocks(a), mirror.table.held_blocks(b)) == (0, 3)
    assert mirror.last_number == 3 and not mirror.partial
