"""Redis memory under a churn of the soak's shape, with and without the stream's byte bound (I/O: starts
its own redis-server on a free port, 127.0.0.1, and stops it).

Run: ``.venv/bin/python tests/integration/redis_churn_memory.py [--applies N] [--stream-max-bytes B]``

The synthetic churn of docs/reliability.md ("From the churn soak", the ``used_memory`` point), on
kvlb's own ``RedisIndex``: four replicas in turn, each apply 4 ``Stored`` of 16 new 16-token blocks
(64 blocks, about 5.5 kB in the stream entry) plus the ``Removed`` of what passes an engine LRU of
25,000 blocks; one replica renamed every 50 applies (``drop_replica`` of the old id, the new id
empty), so the held blocks stay flat. Every ``--every`` applies it prints ``INFO memory``'s
``used_memory``, ``DBSIZE``, ``XLEN`` and ``MEMORY USAGE`` of the stream and of its sizes list.
``--stream-max-bytes 0`` leaves the setting out (what a tree before h-streambytes runs: put that
tree first on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis.asyncio as aioredis
from redis_server import start_server

from balancer.events import KvEvent, Removed, Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.redis.index import RedisIndex
from balancer.index.redis.schema import RedisIndexSettings
from balancer.types import EngineHash, ReplicaId

BS = 16
HASHER = BlockHasher("churn", BS)
ENGINE_LRU_BLOCKS = 25_000


async def run(args: argparse.Namespace) -> None:
    server = start_server()
    try:
        client = aioredis.Redis.from_url(server.url, decode_responses=True)
        settings = RedisIndexSettings(pool="churn", stream_maxlen=args.stream_maxlen)
        if args.stream_max_bytes:
            settings = dataclasses.replace(settings, stream_max_bytes=args.stream_max_bytes)
        index = RedisIndex(client, HASHER, settings)
        rng = random.Random(7)
        names = [f"r{i}" for i in range(4)]
        lives = [0, 0, 0, 0]
        lru: list[collections.deque[int]] = [collections.deque() for _ in range(4)]
        next_hash = 1
        started = time.monotonic()
        print(f"# {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()}")
        tree = Path(sys.modules["balancer"].__file__ or "").parent
        print(f"# {settings}; {' '.join(sys.argv)}; balancer from {tree}")
        print("applies used_memory_MB dbsize xlen stream_MB sizes_list_MB byte_trims elapsed_s")
        for step in range(1, args.applies + 1):
            slot = step % 4
            if step % 50 == 0:  # rename one replica: the old id dropped, the new one empty
                renamed = (step // 50) % 4
                await index.drop_replica(ReplicaId(f"{names[renamed]}-{lives[renamed]}"))
                lives[renamed] += 1
                lru[renamed].clear()
            replica = ReplicaId(f"{names[slot]}-{lives[slot]}")
            batch: list[KvEvent] = []
            for _ in range(4):
                ehs = tuple(EngineHash(next_hash + i) for i in range(16))
                next_hash += 16
                tokens = pack_tokens([rng.randrange(50_000) for _ in range(16 * BS)])
                batch.append(Stored(0, None, ehs, tokens, BS))
                lru[slot].extend(ehs)
            over = max(0, len(lru[slot]) - ENGINE_LRU_BLOCKS)
            gone = [EngineHash(lru[slot].popleft()) for _ in range(over)]
            if gone:
                batch.append(Removed(0, tuple(gone)))
            await index.apply(replica, batch, float(step))
            if step % args.every == 0:
                await report(client, index, step, time.monotonic() - started)
        print(f"# end {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()}")
        await client.aclose()
    finally:
        server.stop()


async def report(client: Any, index: RedisIndex, step: int, elapsed_s: float) -> None:
    memory = await client.info("memory")
    stream = await client.memory_usage(index.keys.stream, samples=0) or 0  # every node: exact
    sizes = await client.memory_usage(f"{index.keys.prefix}evbytes", samples=0) or 0
    counters = await index.counters()
    print(
        f"{step} {memory['used_memory'] / 1e6:.2f} {await client.dbsize()} "
        f"{await client.xlen(index.keys.stream)} {stream / 1e6:.2f} {sizes / 1e6:.3f} "
        f"{counters.get('stream_byte_trims', 0)} {elapsed_s:.0f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--applies", type=int, default=14_000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--stream-maxlen", type=int, default=10_000)
    parser.add_argument("--stream-max-bytes", type=int, default=0, help="0: leave the setting out")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
