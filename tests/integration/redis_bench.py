"""Throughput and memory of ``RedisIndex.apply`` from one writer (I/O: starts its own redis-server).

Run: ``.venv/bin/python tests/integration/redis_bench.py [--batches N] [--events E] [--blocks B]``

Workload (seeded, built before timing): ``replicas`` replicas; each ``apply`` is one replica's batch
of ``events`` ``Stored`` events of ``blocks`` full blocks (16 tokens) each. Half the events of a batch
start a new conversation (parent = a shared system-prompt chain stored once per replica, read from
Redis), half continue the previous event of the batch. Every block is new, so each one is a holder
insert, an engine-hash map insert and an LRU insert. Reports blocks/s (end to end, and inside
``EVALSHA`` from ``INFO commandstats``), index bytes per held block (``INFO memory`` delta minus the
stream) and stream bytes per stored block; then the same with a budget that forces eviction.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis.asyncio as aioredis
from redis_server import start_server

from balancer.events import KvEvent, Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.redis.index import RedisIndex
from balancer.index.redis.schema import RedisIndexSettings
from balancer.types import EngineHash, ReplicaId

BS = 16
HASHER = BlockHasher("bench", BS)


def build(
    rng: random.Random, replicas: int, batches: int, events: int, blocks: int
) -> list[tuple[ReplicaId, list[KvEvent]]]:
    names = [ReplicaId(f"replica-{i}") for i in range(replicas)]
    system = pack_tokens([rng.randrange(50_000) for _ in range(4 * BS)])
    out: list[tuple[ReplicaId, list[KvEvent]]] = []
    for replica in names:  # the shared system prompt: 4 blocks, engine hashes 1..4
        out.append((replica, [Stored(0, None, tuple(EngineHash(h) for h in range(1, 5)), system, BS)]))
    next_hash = 1000
    for b in range(batches):
        batch: list[KvEvent] = []
        parent = EngineHash(4)
        for e in range(events):
            if e % 2 == 0:
                parent = EngineHash(4)
            ehs = tuple(EngineHash(next_hash + i) for i in range(blocks))
            next_hash += blocks
            tokens = pack_tokens([rng.randrange(50_000) for _ in range(blocks * BS)])
            batch.append(Stored(0, parent, ehs, tokens, BS))
            parent = ehs[-1]
        out.append((names[b % replicas], batch))
    return out


async def run(
    url: str, capacity: int, work: list[tuple[ReplicaId, list[KvEvent]]], label: str, stream_maxlen: int
) -> None:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    await client.flushall()
    settings = RedisIndexSettings(
        pool=f"bench-{label}", capacity_blocks=capacity, stream_maxlen=stream_maxlen
    )
    index = RedisIndex(client, HASHER, settings)
    seed, timed = work[: len({r for r, _ in work})], work[len({r for r, _ in work}) :]
    for replica, batch in seed:
        await index.apply(replica, batch, 0.0)
    before = (await client.info("memory"))["used_memory"]
    await client.config_resetstat()
    stored = evicted = 0
    start = time.perf_counter()
    for replica, batch in timed:
        result = await index.apply(replica, batch, 1.0)
        stored += result.stored_blocks
        evicted += result.evicted_blocks
    elapsed = time.perf_counter() - start
    after = (await client.info("memory"))["used_memory"]
    server_s = (await client.info("commandstats"))["cmdstat_evalsha"]["usec"] / 1e6
    stats = await index.stats()
    stream_bytes = await client.memory_usage(index.keys.stream, samples=0) or 0
    per_block = (after - before - stream_bytes) / max(stored - evicted, 1)
    stream_per_block = stream_bytes / max(stored, 1)
    print(
        f"{label}: {stored} blocks in {len(timed)} applies, {elapsed:.2f} s "
        f"-> {stored / elapsed:,.0f} blocks/s; "
        f"server (EVALSHA) {server_s:.2f} s -> {stored / server_s:,.0f} blocks/s; "
        f"evicted {evicted}; unique {stats.unique_blocks}; index {per_block:.0f} B per held block, "
        f"stream {stream_per_block:.0f} B per stored block"
    )
    await client.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--events", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--stream-maxlen", type=int, default=10_000, help="0: no event stream")
    args = parser.parse_args()
    work = build(random.Random(args.seed), args.replicas, args.batches, args.events, args.blocks)
    total = args.batches * args.events * args.blocks
    server = start_server()
    try:
        await run(server.url, 10 * total, work, "no-eviction", args.stream_maxlen)
        await run(server.url, total // 2, work, "evicting", args.stream_maxlen)
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.run(main())
