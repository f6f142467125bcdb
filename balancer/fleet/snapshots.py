"""``SnapshotKeeper``: one balancer at a time writes each key space's table snapshot (I/O, Redis).

A starting balancer's mirror loads the latest snapshot and replays only the stream entries after it
(:mod:`balancer.index.redis.mirror`), which is what makes a warm start fast and complete even once the
stream has been trimmed. The writer of a key space holds its ``snaplease`` key (``SET NX PX``,
renewed each tick). It writes when its mirror moved on by ``every_entries`` entries or
``every_bytes`` bytes of entries since the last snapshot (a quarter of the stream's length and of
its byte bound by default, so a snapshot is always younger than the oldest retained entry at
ordinary rates, whichever bound trims first), or ``interval_s`` after the last one if anything
changed.

Writing runs where the mirror runs (in fleet mode the ingest thread: :mod:`balancer.fleet.space_mirror`).
Only the copy of the table is made under the table's lock, tens of milliseconds per million blocks
(see ``kvlb bench redis``), during which that balancer's requests wait for the lock; encoding runs in
a worker thread. Keep ``interval_s`` large.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from balancer.index.redis.client import RedisClient
from balancer.index.redis.schema import RedisKeys
from balancer.metrics import Metrics

log = logging.getLogger(__name__)

_HOLD = """
-- KEYS[1]: snapshot lease; ARGV: owner, ttl_ms -> 1 if the caller holds it now
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


class SnapshotSource(Protocol):
    """What the keeper needs of a mirror (a :class:`~balancer.index.redis.mirror.Mirror`, or the
    request loop's handle on one that runs on the ingest thread)."""

    @property
    def last_number(self) -> int: ...

    @property
    def bytes_read(self) -> int: ...

    @property
    def ready(self) -> asyncio.Event: ...

    async def write_snapshot(self) -> int: ...


@dataclass(slots=True)
class _Space:
    mirror: SnapshotSource
    keys: RedisKeys
    written_number: int = -1
    written_at: float = 0.0
    written_bytes: int = 0


class SnapshotKeeper:
    """Writes the snapshots of the key spaces whose snapshot lease this balancer holds."""

    def __init__(
        self,
        client: RedisClient,
        *,
        owner: str,
        interval_s: float,
        every_entries: int,
        ttl_s: float,
        metrics: Metrics,
        every_bytes: int = 0,
    ) -> None:
        """``every_bytes`` 0: no snapshot by bytes."""
        self.client = client
        self.owner = owner
        self.interval_s = interval_s
        self.every_entries = max(1, every_entries)
        self.every_bytes = every_bytes
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.written = 0
        self._metrics = metrics
        self._spaces: list[_Space] = []
        self._hold = client.register_script(_HOLD)

    def add(self, mirror: SnapshotSource, keys: RedisKeys) -> None:
        self._spaces.append(_Space(mirror, keys))

    async def tick(self) -> None:
        """Renew or take each snapshot lease, and write the snapshots that are due."""
        now = time.monotonic()
        for space in self._spaces:
            mirror = space.mirror
            held = await self._hold(keys=[space.keys.snapshot_lease], args=[self.owner, self.ttl_ms])
            if not held:
                space.written_number = -1  # another balancer writes; start afresh if we take over
                continue
            if space.written_number < 0:  # just took it: the last snapshot is not older than this
                space.written_number, space.written_at = mirror.last_number, now
                space.written_bytes = mirror.bytes_read
                continue
            moved = mirror.last_number - space.written_number
            by_bytes = 0 < self.every_bytes <= mirror.bytes_read - space.written_bytes
            due = moved >= self.every_entries or (moved != 0 and now - space.written_at >= self.interval_s)
            due = due or (moved != 0 and by_bytes)
            if not mirror.ready.is_set() or not due:
                continue
            started = time.perf_counter()
            read = mirror.bytes_read  # (read first: the mirror may move on while the snapshot is made)
            size = await mirror.write_snapshot()
            space.written_number, space.written_at, space.written_bytes = mirror.last_number, now, read
            self.written += 1
            self._metrics.redis_snapshots_total.labels("write").inc()
            log.info(
                "snapshot of %s at entry %d: %d bytes in %.3f s",
                space.keys.prefix,
                mirror.last_number,
                size,
                time.perf_counter() - started,
            )

    async def release(self) -> None:
        """Give the snapshot leases up (another balancer takes them at its next tick)."""
        for space in self._spaces:
            if await self.client.get(space.keys.snapshot_lease) in (self.owner, self.owner.encode()):
                await self.client.delete(space.keys.snapshot_lease)
