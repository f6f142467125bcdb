"""A private ``redis-server`` for tests (I/O: a subprocess on 127.0.0.1, a free port).

One server per test session, started on first use and stopped by PID at session end (the
``tests/conftest.py`` fixtures; ``atexit`` as a backstop). Never touches a server on 6379.
Tests that need it are skipped, not failed, when the ``redis-server`` binary is missing.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import shutil
import subprocess
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from procs_free import free_port

from balancer.events import KvEvent
from balancer.fleet.space_mirror import SpaceMirror
from balancer.index.base import ApplyResult, HeldKeys, IndexStats, PrefixIndex
from balancer.index.hashing import BlockHasher
from balancer.index.redis.index import RedisIndex
from balancer.index.redis.mirror import Mirror, MirrorSettings
from balancer.index.redis.schema import RedisIndexSettings
from balancer.index.table import PrefixTable
from balancer.sources.ingest_thread import IngestThread, yield_gil
from balancer.types import BlockKey, Overlap, ReplicaId

_START_TIMEOUT_S = 10.0
HZ = 100
"""The server's ``hz`` (default 10): it times out a blocking read (``XREAD BLOCK``) only at its next
tick, so at 10 a mirror's 10 ms poll of an empty stream took about 100 ms (6 s of the 12 s of
``test_split_applies_agree_with_the_mirror``); at 100 it takes about 10 ms."""


@dataclass
class RedisServer:
    """A running ``redis-server`` subprocess."""

    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        """SIGKILL: the server dies without saving anything more."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)

    def flushall(self) -> None:
        with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5) as client:
            client.flushall()


def start_server(
    port: int | None = None, data_dir: Path | None = None, extra_args: Sequence[str] = ()
) -> RedisServer:
    """Start a fresh server; ``pytest.skip`` if the binary is missing. With ``data_dir`` it keeps an
    append-only file there, so a restart on the same port and dir keeps the data. ``appendfsync no``:
    Redis writes the file before every reply and leaves the flush to the kernel, which a SIGKILL of
    the server does not undo; under the default ``everysec`` Redis may hold the write back for up to
    2 s while a background fsync runs, and a kill then lost the last writes (1 in 20 runs of
    ``test_redis_restart.py`` at load 4, 2026-12-01)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found (make redis)")
    port = port or free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--hz", str(HZ)]
    if data_dir is None:
        argv += ["--appendonly", "no"]
    else:
        argv += ["--appendonly", "yes", "--appendfsync", "no", "--dir", str(data_dir)]
    argv += list(extra_args)  # more of the server's options (``--databases 4``)
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(process, port)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {process.returncode} (port {port})")
        try:
            with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1) as client:
                if client.ping():
                    return server
        except redis.ConnectionError:
            time.sleep(0.02)
    server.stop()
    raise RuntimeError(f"redis-server did not answer PING on port {port} within {_START_TIMEOUT_S} s")


class _Shared:
    """The session's server, started lazily (the contract factory has no fixture to ask)."""

    server: RedisServer | None = None

    @classmethod
    def get(cls) -> RedisServer:
        if cls.server is None or cls.server.process.poll() is not None:
            cls.server = start_server()
            atexit.register(cls.server.stop)
        return cls.server

    @classmethod
    def stop(cls) -> None:
        if cls.server is not None:
            cls.server.stop()
            cls.server = None


def shared_server() -> RedisServer:
    """The session's server (started on first call)."""
    return _Shared.get()


def started_server() -> RedisServer | None:
    """The session's server if it was started, else ``None``."""
    return _Shared.server


def stop_shared_server() -> None:
    _Shared.stop()


_pools = itertools.count()


def fresh_settings(capacity_blocks: int = 100_000, stream_maxlen: int = 10_000) -> RedisIndexSettings:
    """Settings with a pool name not used before in this session."""
    return RedisIndexSettings(
        pool=f"test-{next(_pools)}", capacity_blocks=capacity_blocks, stream_maxlen=stream_maxlen
    )


async def redis_index(hasher: BlockHasher, capacity_blocks: int) -> PrefixIndex:
    """Contract-suite factory: an empty ``RedisIndex`` on the session's server."""
    settings = fresh_settings(capacity_blocks)
    return RedisIndex.from_url(shared_server().url, hasher, settings)


class MirroredIndex:
    """The fleet's two halves under the ``PrefixIndex`` contract: a :class:`RedisIndex` takes the
    writes (``apply``, ``drop_replica``) and a :class:`Mirror` that follows its applied-event stream
    answers the reads (``match``, ``stats``) and keeps the speculative entries, which stay local to
    each balancer in fleet mode. After each write the mirror polls the stream, as its tail loop
    would, and applies the new entries at the write's ``now`` (its clock is the caller's)."""

    def __init__(self, writer: RedisIndex, raw_client: aioredis.Redis) -> None:
        self.writer = writer
        self._raw = raw_client
        self._now = 0.0
        self.mirror = Mirror(
            raw_client, writer.hasher, writer.settings, self._clock, MirrorSettings(block_ms=1)
        )

    def _clock(self) -> float:
        return self._now

    async def _follow(self, now: float) -> None:
        """Apply the stream entries the last write added (none when it changed nothing)."""
        self._now = now
        await self.mirror.poll(block_ms=1)

    async def apply(self, replica: ReplicaId, events: Sequence[KvEvent], now: float) -> ApplyResult:
        result = await self.writer.apply(replica, events, now)
        await self._follow(now)
        return result

    async def match(
        self, keys: Sequence[BlockKey], among: Collection[ReplicaId] | None, now: float
    ) -> Overlap:
        return await self.mirror.match(keys, among, now)

    async def add_speculative(
        self, replica: ReplicaId, keys: Sequence[BlockKey], ttl_s: float, now: float
    ) -> None:
        await self.mirror.add_speculative(replica, keys, ttl_s, now)

    async def drop_replica(self, replica: ReplicaId) -> int:
        dropped = await self.writer.drop_replica(replica)
        await self._follow(self._now)
        return dropped

    async def drop_blocks(self, replica: ReplicaId, keys: Sequence[BlockKey]) -> int:
        dropped = await self.writer.drop_blocks(replica, keys)
        await self._follow(self._now)
        return dropped

    async def stats(self) -> IndexStats:
        return await self.mirror.stats()

    async def held_keys(self, replica: ReplicaId, limit: int) -> list[HeldKeys]:
        return await self.mirror.held_keys(replica, limit)

    async def aclose(self) -> None:
        await self.writer.aclose()
        await self._raw.aclose()


class ThreadedMirroredIndex:
    """:class:`MirroredIndex` as fleet mode runs it: the mirror tails the stream on an
    :class:`~balancer.sources.ingest_thread.IngestThread` (a :class:`SpaceMirror` with its own
    client, used on that thread's loop only), and the reads and speculative entries go to the table
    it installed on this loop, as routing's do. After each write this waits (bounded) until the
    mirror applied the stream's last entry."""

    def __init__(self, writer: RedisIndex, raw_client: aioredis.Redis, thread: IngestThread) -> None:
        self.writer = writer
        self._raw = raw_client
        self._now = 0.0
        self.thread = thread
        self.table: PrefixTable | None = None
        mirror = Mirror(
            raw_client, writer.hasher, writer.settings, self._clock, MirrorSettings(block_ms=50),
            between_entries=yield_gil,
        )  # fmt: skip
        self.handle = SpaceMirror(thread, mirror, self._install, writer.settings.pool)

    def _clock(self) -> float:
        return self._now

    def _install(self, table: PrefixTable) -> None:
        self.table = table

    def _table(self) -> PrefixTable:
        assert self.table is not None, "not warm"
        return self.table

    async def _follow(self) -> None:
        """Wait until the mirror applied the stream's newest entry (up to 10 s)."""
        want = (await self.writer.counters()).get("stream_entries", 0)  # the newest entry's number
        for _ in range(10_000):
            if self.handle.last_number >= want:
                return
            await asyncio.sleep(0.001)
        raise TimeoutError(f"the mirror applied {self.handle.last_number} of {want} entries")

    async def apply(self, replica: ReplicaId, events: Sequence[KvEvent], now: float) -> ApplyResult:
        self._now = now
        result = await self.writer.apply(replica, events, now)
        await self._follow()
        return result

    async def match(
        self, keys: Sequence[BlockKey], among: Collection[ReplicaId] | None, now: float
    ) -> Overlap:
        return self._table().match(keys, among, now)

    async def add_speculative(
        self, replica: ReplicaId, keys: Sequence[BlockKey], ttl_s: float, now: float
    ) -> None:
        self._table().add_speculative(replica, keys, ttl_s, now)

    async def drop_replica(self, replica: ReplicaId) -> int:
        dropped = await self.writer.drop_replica(replica)
        await self._follow()
        return dropped

    async def drop_blocks(self, replica: ReplicaId, keys: Sequence[BlockKey]) -> int:
        dropped = await self.writer.drop_blocks(replica, keys)
        await self._follow()
        return dropped

    async def stats(self) -> IndexStats:
        return self._table().stats()

    async def held_keys(self, replica: ReplicaId, limit: int) -> list[HeldKeys]:
        return self._table().held_keys(replica, limit)

    async def aclose(self) -> None:
        assert self.handle.mirror.thread in (None, self.thread.name)  # it applied on its thread only
        await self.handle.aclose()
        if self.thread.loop is not None:
            await self.thread.call(self._raw.aclose)
        await self.thread.stop()
        await self.writer.aclose()


async def threaded_mirror_index(hasher: BlockHasher, capacity_blocks: int) -> PrefixIndex:
    """Contract-suite factory: a ``RedisIndex`` writer and a warm ``Mirror`` of its stream that runs
    on an ingest thread while the suite reads on its own loop (fleet mode's arrangement)."""
    url = shared_server().url
    thread = IngestThread("kvlb-test-mirror")
    await thread.start()
    index = ThreadedMirroredIndex(
        RedisIndex.from_url(url, hasher, fresh_settings(capacity_blocks)),
        aioredis.Redis.from_url(url, decode_responses=False),
        thread,
    )
    await index.handle.start()
    await asyncio.wait_for(index.handle.ready.wait(), 10)
    return index


async def mirror_index(hasher: BlockHasher, capacity_blocks: int) -> PrefixIndex:
    """Contract-suite factory: a ``RedisIndex`` writer and a warm ``Mirror`` of its stream."""
    url = shared_server().url
    index = MirroredIndex(
        RedisIndex.from_url(url, hasher, fresh_settings(capacity_blocks)),
        aioredis.Redis.from_url(url, decode_responses=False),
    )
    await index.mirror.warm_start()
    return index
