"""A Redis client after ``redis-server`` is SIGKILLed and restarted (real server, append-only file):
no call fails once the server answers again, though the pool held connections to the dead one
(:class:`~balancer.index.redis.client.RestartSafeRedis`). Nor after the server closed its pooled
connections for idleness (Redis's ``timeout``, which managed services set)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_server import start_server

from balancer.index.redis.client import RedisClient, connect

CALLS = 4
"""Concurrent calls: the pool then holds this many connections."""


async def _restarted(tmp_path: Path, call: Callable[[RedisClient, int], Awaitable[Any]]) -> list[Any]:
    """Fill a client's pool with ``CALLS`` connections, SIGKILL and restart the server (one call
    fails meanwhile, as every caller's first call in an outage does), then make ``CALLS``
    concurrent calls, twice: their results (exceptions included)."""
    server = await asyncio.to_thread(start_server, None, tmp_path)
    client = connect(server.url, decode=False, socket_timeout_s=1.0, connect_timeout_s=1.0)
    try:
        await asyncio.gather(*(client.set(f"k{i}", i) for i in range(CALLS)))
        await asyncio.to_thread(server.kill)
        with pytest.raises(redis.ConnectionError):
            await client.get("k0")
        server = await asyncio.to_thread(start_server, server.port, tmp_path)
        results: list[Any] = []
        for _ in range(2):
            results += await asyncio.gather(*(call(client, i) for i in range(CALLS)), return_exceptions=True)
        return results
    finally:
        await client.aclose()
        await asyncio.to_thread(server.stop)


async def test_no_call_fails_after_a_restart(tmp_path: Path) -> None:
    async def get(client: RedisClient, i: int) -> Any:
        return await client.get(f"k{i}")

    results = await _restarted(tmp_path, get)
    assert results == [str(i).encode() for i in range(CALLS)] * 2  # the data survived in the AOF


async def test_no_pipeline_fails_after_a_restart(tmp_path: Path) -> None:
    async def piped(client: RedisClient, i: int) -> Any:
        pipe = client.pipeline(transaction=False)
        pipe.get(f"k{i}")
        pipe.exists(f"k{i}")
        return await pipe.execute()

    results = await _restarted(tmp_path, piped)
    assert results == [[str(i).encode(), 1] for i in range(CALLS)] * 2


async def test_no_call_fails_after_the_server_closed_idle_connections() -> None:
    """``CONFIG SET timeout 2`` and 3.5 s of silence: Redis closes every pooled connection. Each call
    after it, plain, piped or a script, takes a fresh connection instead of failing once on the
    closed one (it did until 2026-12-01: redis-py's pool skips its check of a pooled connection
    while ``maint_notifications_config`` is its default ``"auto"``)."""
    server = await asyncio.to_thread(start_server)
    client = connect(server.url, decode=True, socket_timeout_s=1.0, connect_timeout_s=1.0)
    watcher = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=1.0)
    try:
        await client.config_set("timeout", 2)
        sha = await client.script_load("return redis.call('GET', KEYS[1])")
        await asyncio.gather(*(client.set(f"k{i}", i) for i in range(CALLS)))
        assert await asyncio.to_thread(lambda: watcher.info("clients")["connected_clients"]) > 1
        await asyncio.sleep(3.5)  # the server's cron closes connections idle for 2 s
        assert await asyncio.to_thread(lambda: watcher.info("clients")["connected_clients"]) == 1  # its own

        async def calls(i: int) -> Any:
            pipe = client.pipeline(transaction=False)
            pipe.get(f"k{i}")
            return [await client.get(f"k{i}"), await pipe.execute(), await client.evalsha(sha, 1, f"k{i}")]

        results = await asyncio.gather(*(calls(i) for i in range(CALLS)), return_exceptions=True)
        assert results == [[str(i), [str(i)], str(i)] for i in range(CALLS)]
    finally:
        watcher.close()
        await client.aclose()
        await asyncio.to_thread(server.stop)
