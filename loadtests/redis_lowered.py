"""``python -m loadtests.redis_lowered``: how many appends a lowered ``redis.stream_max_bytes`` takes to
be reached, and how long each of those script calls holds Redis (I/O: starts its own ``redis-server``
on a free 127.0.0.1 port and stops it by pid).

What a restart with a lower bound does to the key space, on kvlb's own ``RedisIndex``: one index
with ``--from-bytes`` (64 MiB) and ``--maxlen`` fills the stream with ``--entries`` appends of
``--blocks`` 16-token blocks each (every batch stores its blocks and removes them again, so the index
stays empty and the stream is all there is); then an index with ``--to-bytes`` (1 MiB) appends the
same batches until the retained entries' fields fit. For each of those appends: the entries trimmed,
the stream's fields after it, and the duration Redis itself gives the script call (``SLOWLOG`` with a
threshold of 0, in microseconds: the time Redis is blocked). Prints a table, then the JSON report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis

from balancer.events import KvEvent, Removed, Stored
from balancer.index.hashing import BlockHasher
from balancer.index.redis.index import RedisIndex
from balancer.index.redis.schema import RedisIndexSettings
from balancer.types import EngineHash, ReplicaId
from loadtests.bench.redis_bench import _wait_up, start_redis

BLOCK_SIZE = 16
HASHER = BlockHasher("lowered", BLOCK_SIZE)
MIB = 1 << 20
REPLICA = ReplicaId("r0")
MAX_LOWERED_APPENDS = 1000
BASELINE_APPENDS = 5
"""Appends under the first bound whose script durations are the baseline (no trim for bytes)."""
"""Appends under the lowered bound before the run gives up (the bound not reached)."""


def batch(first: int, blocks: int) -> list[KvEvent]:
    """``blocks`` new blocks stored and removed again (about 70 B a block in the entry)."""
    hashes = tuple(EngineHash(first + i) for i in range(blocks))
    tokens = bytes((first + i) % 251 for i in range(4 * BLOCK_SIZE * blocks))
    return [Stored(0, None, hashes, tokens, BLOCK_SIZE), Removed(0, hashes)]


async def fields_bytes(raw: Any, stream: str) -> tuple[int, int]:
    """The retained entries and their fields' bytes (names and values: what the bound counts)."""
    total = count = 0
    last = "-"
    while True:  # in pages of 1,000: a 64 MiB stream read at once would be one 64 MiB reply
        page: list[tuple[bytes, dict[bytes, bytes]]] = await raw.xrange(stream, min=last, count=1000)
        page = [e for e in page if e[0].decode() != last]
        if not page:
            return count, total
        count += len(page)
        total += sum(len(k) + len(v) for _id, fields in page for k, v in fields.items())
        last = page[-1][0].decode()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_start = os.getloadavg()
    process, url = start_redis()
    text = aioredis.Redis.from_url(url, decode_responses=True)
    raw = aioredis.Redis.from_url(url)
    try:
        await _wait_up(url)
        base = RedisIndexSettings(pool="lowered", stream_maxlen=args.maxlen, capacity_blocks=10 * args.blocks)
        high = RedisIndex(text, HASHER, _with_bytes(base, args.from_bytes))
        next_hash = 1
        fill_began = time.monotonic()
        for first in range(0, args.entries, args.fill_concurrency):  # one replica per concurrent append
            appends = []
            for k in range(min(args.fill_concurrency, args.entries - first)):
                replica = ReplicaId(f"fill-{k}")
                appends.append(high.apply(replica, batch(next_hash, args.blocks), float(first)))
                next_hash += args.blocks
            await asyncio.gather(*appends)
        fill_s = time.monotonic() - fill_began
        entries, before = await fields_bytes(raw, high.keys.stream)
        await text.config_set("slowlog-log-slower-than", 0)
        await text.config_set("slowlog-max-len", 1024)
        baseline_us = []
        for i in range(BASELINE_APPENDS):  # the same appends without a trim: what an append costs
            await text.slowlog_reset()
            await high.apply(REPLICA, batch(next_hash, args.blocks), float(args.entries + i))
            next_hash += args.blocks
            baseline_us.append(
                max((int(e["duration"]) for e in await text.slowlog_get(1024) if _is_script(e)), default=0)
            )
        low = RedisIndex(text, HASHER, _with_bytes(base, args.to_bytes))
        steps: list[dict[str, Any]] = []
        for i in range(MAX_LOWERED_APPENDS):
            await text.slowlog_reset()
            trims_before = low.stream_byte_trims
            await low.apply(REPLICA, batch(next_hash, args.blocks), float(args.entries + i))
            next_hash += args.blocks
            log = await text.slowlog_get(1024)
            script_us = max((int(e["duration"]) for e in log if _is_script(e)), default=0)
            kept, kept_bytes = await fields_bytes(raw, low.keys.stream)
            steps.append(
                {
                    "append": i + 1,
                    "trimmed": low.stream_byte_trims - trims_before,
                    "entries": kept,
                    "fields_mb": round(kept_bytes / 1e6, 3),
                    "script_us": script_us,
                }
            )
            if kept_bytes <= args.to_bytes:
                break
        reached = bool(steps) and steps[-1]["fields_mb"] * 1e6 <= args.to_bytes
        return {
            "started": started,
            "load_at_start": [round(x, 2) for x in load_start],
            "load_at_end": [round(x, 2) for x in os.getloadavg()],
            "command": " ".join(sys.argv),
            "from_bytes": args.from_bytes,
            "to_bytes": args.to_bytes,
            "maxlen": args.maxlen,
            "blocks_per_entry": args.blocks,
            "filled": {"appends": args.entries, "entries": entries, "fields_mb": round(before / 1e6, 3),
                       "entry_bytes": round(before / entries) if entries else 0, "fill_s": round(fill_s, 1)},
            "appends_to_reach": len(steps) if reached else None,
            "untrimmed_script_ms_median": round(statistics.median(baseline_us) / 1000, 2),
            "max_script_ms": round(max((s["script_us"] for s in steps), default=0) / 1000, 2),
            "steps": steps,
        }  # fmt: skip
    finally:
        await text.aclose()
        await raw.aclose()
        process.kill()
        process.wait()


def _is_script(entry: dict[str, Any]) -> bool:
    command = entry.get("command", b"")
    name = (
        (command.decode(errors="replace") if isinstance(command, bytes) else str(command))
        .split(" ", 1)[0]
        .upper()
    )
    return name in ("EVALSHA", "EVAL", "FCALL")


def _with_bytes(settings: RedisIndexSettings, max_bytes: int) -> RedisIndexSettings:
    return replace(settings, stream_max_bytes=max_bytes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.redis_lowered", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--from-bytes", type=int, default=64 * MIB)
    parser.add_argument("--to-bytes", type=int, default=MIB)
    parser.add_argument("--maxlen", type=int, default=10_000, help="redis.stream_maxlen of both")
    parser.add_argument("--entries", type=int, default=10_000, help="appends under the first bound")
    parser.add_argument("--blocks", type=int, default=96, help="16-token blocks per entry")
    parser.add_argument("--fill-concurrency", type=int, default=1, help="appends at once while filling")
    parser.add_argument("--json", action="store_true", help="the JSON report only")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    if not args.json:
        print(f"filled: {result['filled']}")
        print(f"{'append':>7} {'trimmed':>8} {'entries':>8} {'fields_mb':>10} {'script_us':>10}")
        for step in result["steps"]:
            row = (step["append"], step["trimmed"], step["entries"], step["fields_mb"], step["script_us"])
            print(f"{row[0]:>7} {row[1]:>8} {row[2]:>8} {row[3]:>10} {row[4]:>10}")
        print(
            f"appends to reach {args.to_bytes} B: {result['appends_to_reach']}; longest script"
            f" {result['max_script_ms']} ms (an append under the first bound:"
            f" {result['untrimmed_script_ms_median']} ms, median)"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
