"""The writers' error backoff cut short when Redis is back (:mod:`balancer.fleet.redis_back`), against
a real private ``redis-server`` SIGKILLed and restarted: every writer sleeping in its backoff writes
as soon as another call finds Redis answering, and a Redis that keeps failing is not hammered by
the wakes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from redis_server import start_server
from unstalled import Unstalled

from balancer.events import Stored
from balancer.fleet.redis_back import RedisBack, RetrySettings
from balancer.fleet.writer import FencedWriter
from balancer.index.hashing import BlockHasher
from balancer.index.redis.client import connect
from balancer.index.redis.index import RedisIndex
from balancer.index.redis.lease import IngestionLease, LeaseSettings
from balancer.index.redis.schema import RedisIndexSettings
from balancer.metrics import Metrics
from balancer.types import EngineHash, ReplicaId

pytestmark = pytest.mark.redis

HASHER = BlockHasher("back", 2)
REPLICAS = [ReplicaId(f"vllm-{i}") for i in range(3)]
LONG_S = 30.0
"""The backoff of the first test's writers: what each would wait without the wake."""


def block(n: int) -> Stored:
    return Stored(0, None, (EngineHash(n),), bytes([n % 256, 0, 0, 0]) * HASHER.block_size, HASHER.block_size)


def retries(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("kvlb_redis_apply_retries_total") or 0.0


async def _held_writer(url: str, retry: RetrySettings, back: RedisBack) -> tuple[FencedWriter, Metrics]:
    """A writer holding every replica of ``REPLICAS``, each written once."""
    client = connect(url, decode=True, socket_timeout_s=1.0, connect_timeout_s=1.0)
    index = RedisIndex(client, HASHER, RedisIndexSettings(pool="back", capacity_blocks=10_000))
    metrics = Metrics.create()
    writer = FencedWriter(
        index, metrics=metrics, on_lost=lambda replica, generation: None, retry=retry, redis_back=back
    )
    for replica in REPLICAS:
        lease = IngestionLease(client, index.keys, replica, "me", LeaseSettings(60.0, 1.0))
        grant = await lease.acquire()
        writer.hold(replica, lease, grant.generation, {}, writes=grant.writes, applied=grant.applied)
        await writer.apply_at(replica, [block(1)], 0.0, {0: 1})
    return writer, metrics


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def test_every_writer_in_backoff_writes_once_another_call_finds_redis_back(tmp_path: Path) -> None:
    """Three writes fail while Redis is down and sleep a 30-s backoff; Redis restarts and a call of
    another component (a ``PING``, as a lease tick would be) works and tells :class:`RedisBack`:
    every write lands on its next attempt, well within the backoff (before 2026-12-02 each waited
    its own out, up to 0.5 s with the default settings)."""
    server = await asyncio.to_thread(start_server, None, tmp_path)
    back = RedisBack()
    writer, metrics = await _held_writer(server.url, RetrySettings(LONG_S, LONG_S), back)
    probe = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=1.0)
    tasks: list[asyncio.Task[float]] = []
    try:
        await asyncio.to_thread(server.kill)
        landed: dict[ReplicaId, float] = {}

        async def write(replica: ReplicaId) -> float:
            await writer.apply_at(replica, [block(2)], 0.0, {0: 2})
            landed[replica] = time.monotonic()
            return landed[replica]

        tasks = [asyncio.create_task(write(replica)) for replica in REPLICAS]
        await _until(lambda: retries(metrics) == len(REPLICAS), "every write failed once")
        server = await asyncio.to_thread(start_server, server.port, tmp_path)
        assert await asyncio.to_thread(probe.ping)  # the first call that works after the outage
        assert not landed  # the writers still sleep in their backoff
        back.succeeded()
        watch = Unstalled(server.process.pid)
        async with asyncio.timeout(10.0):  # the backoff is 30 s: without the wake this fails
            await asyncio.gather(*tasks)
        lag_s = watch.seconds()
        assert back.wakes == 1 and back.woke_at is not None
        assert all(at >= back.woke_at for at in landed.values())  # woken, not timed out
        assert lag_s < LONG_S / 10, lag_s  # every write landed soon after the first call that worked
        assert retries(metrics) == len(REPLICAS)  # each landed on its first attempt after the wake
        assert all(writer.holdings[r].writes == 2 for r in REPLICAS)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        probe.close()
        await writer.index.client.aclose()
        await asyncio.to_thread(server.stop)


async def test_a_redis_still_failing_is_not_hammered_by_the_wakes(tmp_path: Path) -> None:
    """Redis stays down while something keeps calling :meth:`RedisBack.succeeded` every 5 ms (a
    flapping Redis whose reads work and writes fail): a woken attempt that fails waits its next,
    longer, backoff in full, so a write makes at most two attempts per backoff (about 13 in 3 s
    with the default 0.05–0.5 s, against about 9 without wakes; honouring every wake made one
    attempt per wake, hundreds)."""
    server = await asyncio.to_thread(start_server, None, tmp_path)
    back = RedisBack()
    settings = RetrySettings()
    writer, metrics = await _held_writer(server.url, settings, back)
    task: asyncio.Task[object] | None = None
    try:
        await asyncio.to_thread(server.kill)
        task = asyncio.create_task(writer.apply_at(REPLICAS[0], [block(2)], 0.0, {0: 2}))
        await _until(lambda: retries(metrics) >= 1, "the write failed")
        started = time.monotonic()
        before = retries(metrics)
        for _ in range(600):  # bounded: 3 s at most, and a little more on a loaded machine
            back.succeeded()
            await asyncio.sleep(0.005)
            if time.monotonic() - started >= 3.0:
                break
        window_s = time.monotonic() - started
        attempts = retries(metrics) - before
        assert back.wakes >= 3  # the writer was woken, repeatedly
        assert attempts <= 2 * window_s / settings.max_s + 6, (attempts, window_s)
        assert not task.done()  # still retrying the same batch
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await writer.index.client.aclose()
        await asyncio.to_thread(server.stop)
