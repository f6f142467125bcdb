"""``kvlb bench redis``: the Redis fleet path measured next to the in-memory one (I/O: starts its
own ``redis-server`` on a free 127.0.0.1 port and stops it by PID).

Side by side, in one run:

* **apply**: blocks/s of the same seeded batches through ``RedisIndex.apply`` (fenced, with
  positions and the stream entry, as an ingester writes them) from one replica at a time and from
  four replicas' pipelines at once, versus ``PrefixTable.apply`` in memory. Target: ≥ 200k
  blocks/s through Redis from one ingester.
* **mirror lag**: p50/p99 from the moment a batch is handed to the writer until each of three
  mirrors has applied it, at a paced rate. The mirrors share the bench's one event loop with the
  writer (real balancers have a process each), which makes this pessimistic. Target: p99 ≤ 50 ms.
* **warm start**: a fresh mirror's time to ready (snapshot ``GET`` + table load + replay of the
  entries after it) for 100k and 1M blocks, and, for 100k, the replay of a stream holding every
  batch (no snapshot); plus the time to write such a snapshot. The snapshot is taken from an
  in-memory table built from the workload (writing 1M blocks through Redis first would take
  longer than the rest of the bench). Target: ≤ 2 s at 1M blocks.
* **memory**: Redis bytes per held block of the index (``INFO memory`` delta minus the stream) and
  stream bytes per stored block, after the apply phase.

Every figure is one run on whatever else the machine is doing: treat it as provisional.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from balancer.events import KvEvent, Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.redis.index import RedisIndex
from balancer.index.redis.mirror import Mirror, MirrorSettings
from balancer.index.redis.schema import RedisIndexSettings
from balancer.index.redis.stream import StreamEntry
from balancer.index.slots import TableLimits
from balancer.index.snapshot import capture, encode
from balancer.index.table import PrefixTable
from balancer.types import EngineHash, ReplicaId
from loadtests.bench.command import print_report

BS = 16
HASHER = BlockHasher("bench", BS)
TARGETS = {"apply_blocks_per_s": 200_000, "mirror_lag_p99_ms": 50.0, "warm_start_1m_s": 2.0}


@dataclass(frozen=True, slots=True)
class Shape:
    apply_batches: int = 120
    events_per_batch: int = 32
    blocks_per_event: int = 16
    lag_batches: int = 600
    lag_rate_per_s: float = 300.0
    lag_blocks_per_batch: int = 8
    warm_blocks: tuple[int, ...] = (100_000, 1_000_000)


SMOKE = Shape(apply_batches=8, events_per_batch=8, blocks_per_event=8, lag_batches=40, warm_blocks=(5_000,))

Work = list[tuple[ReplicaId, list[KvEvent]]]


def build(batches: int, events: int, blocks: int, replicas: int = 4, seed: int = 1) -> Work:
    """Batches of new chains (every block new), round-robin over ``replicas``; tokens are counters."""
    out: Work = []
    token = seed * 100_000_000
    next_hash = 1
    for b in range(batches):
        batch: list[KvEvent] = []
        for _ in range(events):
            tokens = pack_tokens(list(range(token, token + blocks * BS)))
            token += blocks * BS
            batch.append(Stored(0, None, tuple(EngineHash(next_hash + i) for i in range(blocks)), tokens, BS))
            next_hash += blocks
        out.append((ReplicaId(f"replica-{b % replicas}"), batch))
    return out


def _blocks(work: Work) -> int:
    return sum(len(e.engine_hashes) for _, batch in work for e in batch if isinstance(e, Stored))


class _TimedMirror(Mirror):
    """A mirror that records when it applied each live entry (number → wall seconds)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.applied_at: dict[int, float] = {}

    async def _apply(self, entry: StreamEntry, into: Any) -> None:
        await super()._apply(entry, into)
        self.applied_at[entry.number] = time.perf_counter()


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found (make redis)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ), f"redis://127.0.0.1:{port}/0"


async def _wait_up(url: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        async with asyncio.timeout(10):
            while True:
                try:
                    if await client.ping():
                        return
                except (RedisError, OSError):
                    await asyncio.sleep(0.05)
    finally:
        await client.aclose()


def _settings(pool: str, capacity: int, maxlen: int = 10_000) -> RedisIndexSettings:
    return RedisIndexSettings(pool=pool, capacity_blocks=capacity, stream_maxlen=maxlen)


async def bench_apply(text: aioredis.Redis, shape: Shape) -> dict[str, Any]:
    work = build(shape.apply_batches, shape.events_per_batch, shape.blocks_per_event)
    blocks = _blocks(work)
    table = PrefixTable(HASHER, TableLimits(capacity_blocks=10 * blocks))
    started = time.perf_counter()
    for replica, batch in work:
        table.apply(replica, batch, 0.0)
    memory_s = time.perf_counter() - started

    index = RedisIndex(text, HASHER, _settings("bench-apply", 10 * blocks))
    before = (await text.info("memory"))["used_memory"]
    started = time.perf_counter()
    for n, (replica, batch) in enumerate(work):
        await index.apply(replica, batch, time.time(), generation=0, seq=f"0:{n}")
    serial_s = time.perf_counter() - started
    after = (await text.info("memory"))["used_memory"]
    stream_bytes = await text.memory_usage(index.keys.stream, samples=0) or 0

    concurrent = RedisIndex(text, HASHER, _settings("bench-apply-4", 10 * blocks))
    by_replica: dict[ReplicaId, list[list[KvEvent]]] = {}
    for replica, batch in build(shape.apply_batches, shape.events_per_batch, shape.blocks_per_event, seed=2):
        by_replica.setdefault(replica, []).append(batch)

    async def pipeline(replica: ReplicaId, batches: list[list[KvEvent]]) -> None:
        for n, batch in enumerate(batches):
            await concurrent.apply(replica, batch, time.time(), generation=0, seq=f"0:{n}")

    started = time.perf_counter()
    await asyncio.gather(*(pipeline(r, b) for r, b in by_replica.items()))
    concurrent_s = time.perf_counter() - started
    return {
        "blocks": blocks,
        "batch": f"{shape.events_per_batch} events x {shape.blocks_per_event} blocks of {BS} tokens",
        "memory_blocks_per_s": blocks / memory_s,
        "redis_one_replica_blocks_per_s": blocks / serial_s,
        "redis_four_replicas_blocks_per_s": blocks / concurrent_s,
        "redis_index_bytes_per_block": (after - before - stream_bytes) / blocks,
        "redis_stream_bytes_per_block": stream_bytes / blocks,
    }


async def bench_lag(text: aioredis.Redis, raw: aioredis.Redis, shape: Shape) -> dict[str, Any]:
    settings = _settings("bench-lag", 1_000_000)
    index = RedisIndex(text, HASHER, settings)
    fast = MirrorSettings(block_ms=200)
    mirrors = [_TimedMirror(raw, HASHER, settings, time.monotonic, fast) for _ in range(3)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(m.run(stop)) for m in mirrors]
    for mirror in mirrors:
        await asyncio.wait_for(mirror.ready.wait(), 10)
    work = build(shape.lag_batches, 1, shape.lag_blocks_per_batch, seed=3)
    handed: dict[int, float] = {}
    period_s = 1.0 / shape.lag_rate_per_s
    started = time.perf_counter()
    for n, (replica, batch) in enumerate(work, start=1):
        await asyncio.sleep(max(0.0, started + n * period_s - time.perf_counter()))
        handed[n] = time.perf_counter()
        await index.apply(replica, batch, time.time(), generation=0, seq=f"0:{n}")
    async with asyncio.timeout(10):
        while any(len(m.applied_at) < len(work) for m in mirrors):  # noqa: ASYNC110 - plain state
            await asyncio.sleep(0.01)
    elapsed_s = time.perf_counter() - started
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    lags_ms = sorted((m.applied_at[n] - t) * 1000 for m in mirrors for n, t in handed.items())
    return {
        "mirrors": len(mirrors),
        "batches": len(work),
        "rate_blocks_per_s": len(work) * shape.lag_blocks_per_batch / elapsed_s,
        "p50_ms": statistics.median(lags_ms),
        "p99_ms": lags_ms[min(len(lags_ms) - 1, int(0.99 * len(lags_ms)))],
        "max_ms": lags_ms[-1],
    }


async def bench_warm(text: aioredis.Redis, raw: aioredis.Redis, blocks: int) -> dict[str, Any]:
    """Warm start of a fresh mirror from a snapshot of ``blocks`` blocks plus 100 entries after it."""
    events, per_event = 32, 16
    work = build(max(1, blocks // (events * per_event)), events, per_event, seed=4)
    settings = _settings(f"bench-warm-{blocks}", 2 * blocks + 100_000)
    table = PrefixTable(HASHER, TableLimits(capacity_blocks=settings.capacity_blocks))
    for replica, batch in work:
        table.apply(replica, batch, 0.0)
    index = RedisIndex(text, HASHER, settings)
    tail = build(100, 1, 4, seed=5)
    await index.apply(*tail[0], 0.0)
    newest = cast("list[tuple[bytes, Any]]", await raw.xrevrange(index.keys.stream, count=1))
    last_id = newest[0][0].decode()
    started = time.perf_counter()
    state = capture(table)
    capture_s = time.perf_counter() - started
    data = encode(state, 1, last_id)
    encode_s = time.perf_counter() - started - capture_s
    await raw.set(index.keys.snapshot, data)
    write_s = time.perf_counter() - started
    for replica, batch in tail[1:]:
        await index.apply(replica, batch, 0.0)
    mirror = Mirror(raw, HASHER, settings, time.monotonic)
    started = time.perf_counter()
    replayed = await mirror.warm_start()
    warm_s = time.perf_counter() - started
    held = (await mirror.stats()).held_blocks
    await raw.delete(index.keys.snapshot)
    return {
        "blocks": held,
        "snapshot_bytes": len(data),
        "snapshot_capture_s": capture_s,
        "snapshot_encode_s": encode_s,
        "snapshot_write_s": write_s,
        "warm_start_s": warm_s,
        "entries_replayed_after_snapshot": replayed,
        "snapshot_loaded": mirror.counters.snapshots_loaded == 1,
    }


async def bench_replay(text: aioredis.Redis, raw: aioredis.Redis, blocks: int) -> dict[str, Any]:
    """Warm start with no snapshot: replay a stream holding every batch of ``blocks`` blocks."""
    events, per_event = 32, 16
    work = build(max(1, blocks // (events * per_event)), events, per_event, seed=6)
    settings = _settings(f"bench-replay-{blocks}", 2 * blocks, maxlen=len(work) + 1000)
    index = RedisIndex(text, HASHER, settings)
    for replica, batch in work:
        await index.apply(replica, batch, 0.0)
    mirror = Mirror(raw, HASHER, settings, time.monotonic)
    started = time.perf_counter()
    await mirror.warm_start()
    return {"blocks": (await mirror.stats()).held_blocks, "warm_start_s": time.perf_counter() - started}


async def run_async(shape: Shape) -> dict[str, Any]:
    process, url = start_redis()
    text = aioredis.Redis.from_url(url, decode_responses=True)
    raw = aioredis.Redis.from_url(url, decode_responses=False)
    try:
        await _wait_up(url)
        report: dict[str, Any] = {"targets": TARGETS, "load_average_at_start": os.getloadavg()[0]}
        report["apply"] = await bench_apply(text, shape)
        await text.flushall()
        report["mirror_lag"] = await bench_lag(text, raw, shape)
        await text.flushall()
        report["warm_start"] = []
        for blocks in shape.warm_blocks:
            report["warm_start"].append(await bench_warm(text, raw, blocks))
            await text.flushall()
        report["replay_without_snapshot"] = await bench_replay(text, raw, min(shape.warm_blocks))
        report["load_average_at_end"] = os.getloadavg()[0]
        return report
    finally:
        await text.aclose()
        await raw.aclose()
        process.terminate()
        process.wait(timeout=10)


def run(shape: Shape) -> dict[str, Any]:
    return asyncio.run(run_async(shape))


def format_report(report: dict[str, Any]) -> str:
    """A readable summary of :func:`run`'s report."""
    apply, lag, targets = report["apply"], report["mirror_lag"], report["targets"]
    ok = "meets" if apply["redis_one_replica_blocks_per_s"] >= targets["apply_blocks_per_s"] else "MISSES"
    lines = [
        f"kvlb bench redis (load average {report['load_average_at_start']:.1f} at start, "
        f"{report['load_average_at_end']:.1f} at end, on {os.cpu_count()} CPUs)",
        f"apply {apply['blocks']:,} blocks ({apply['batch']} per batch)",
        f"  in memory (PrefixTable)          {apply['memory_blocks_per_s']:>12,.0f} blocks/s",
        f"  Redis, one replica's pipeline    {apply['redis_one_replica_blocks_per_s']:>12,.0f} blocks/s "
        f"({ok} target {targets['apply_blocks_per_s']:,})",
        f"  Redis, four pipelines at once    {apply['redis_four_replicas_blocks_per_s']:>12,.0f} blocks/s",
        f"  Redis memory: index {apply['redis_index_bytes_per_block']:.0f} B per held block, "
        f"stream {apply['redis_stream_bytes_per_block']:.0f} B per stored block",
        f"mirror lag, {lag['mirrors']} mirrors, {lag['batches']} batches at {lag['rate_blocks_per_s']:,.0f} "
        f"blocks/s: p50 {lag['p50_ms']:.1f} ms, p99 {lag['p99_ms']:.1f} ms, max {lag['max_ms']:.1f} ms "
        f"(target p99 <= {targets['mirror_lag_p99_ms']:.0f} ms)",
    ]
    for warm in report["warm_start"]:
        lines.append(
            f"warm start, {warm['blocks']:,} blocks: {warm['warm_start_s']:.2f} s (snapshot "
            f"{warm['snapshot_bytes'] / 1e6:.1f} MB; writing it took {warm['snapshot_write_s']:.2f} s, "
            f"of which {warm['snapshot_capture_s']:.2f} s on the event loop; "
            f"{warm['entries_replayed_after_snapshot']} entries replayed after it)"
        )
    replay = report["replay_without_snapshot"]
    lines.append(
        f"warm start without snapshot (stream replay), {replay['blocks']:,} blocks: "
        f"{replay['warm_start_s']:.2f} s"
    )
    lines.append(f"target: warm start <= {targets['warm_start_1m_s']:.0f} s at 1M blocks")
    return "\n".join(lines)


def add_parser(kinds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = kinds.add_parser("redis", help="Redis fleet path: apply, mirror lag, warm start, memory")
    parser.add_argument("--json", action="store_true", help="print the JSON report only")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (seconds), for CI")
    parser.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    return print_report(run(SMOKE if args.smoke else Shape()), format_report, json_only=args.json)
