"""``MemoryIndex``: the embedded :class:`~balancer.index.base.PrefixIndex` (pure, async facade).

Every coroutine calls the synchronous :class:`~balancer.index.table.PrefixTable` and never awaits,
so each call is atomic with respect to the event loop and needs no lock. Event ingestion writes
through it (a balancer without Redis wraps each key space's table with :meth:`MemoryIndex.over`;
the fleet mirror replays the Redis stream through one); the router reads the table itself.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from balancer.events import KvEvent
from balancer.index.base import ApplyResult, HeldKeys, IndexStats
from balancer.index.hashing import BlockHasher
from balancer.index.slots import TableLimits
from balancer.index.table import PrefixTable
from balancer.types import BlockKey, Overlap, ReplicaId


class MemoryIndex:
    """A prefix index held in this process (one pool)."""

    def __init__(self, hasher: BlockHasher, limits: TableLimits | None = None) -> None:
        self.table = PrefixTable(hasher, limits)

    @classmethod
    def with_capacity(cls, hasher: BlockHasher, capacity_blocks: int) -> MemoryIndex:
        return cls(hasher, TableLimits(capacity_blocks=capacity_blocks))

    @classmethod
    def over(cls, table: PrefixTable) -> MemoryIndex:
        """A facade sharing an existing table (e.g. a pool key space's, which routing also reads)."""
        index = cls.__new__(cls)
        index.table = table
        return index

    async def apply(self, replica: ReplicaId, events: Sequence[KvEvent], now: float) -> ApplyResult:
        return self.table.apply(replica, events, now)

    async def match(
        self, keys: Sequence[BlockKey], among: Collection[ReplicaId] | None, now: float
    ) -> Overlap:
        return self.table.match(keys, among, now)

    async def add_speculative(
        self, replica: ReplicaId, keys: Sequence[BlockKey], ttl_s: float, now: float
    ) -> None:
        self.table.add_speculative(replica, keys, ttl_s, now)

    async def drop_replica(self, replica: ReplicaId) -> int:
        return self.table.drop_replica(replica)

    async def drop_blocks(self, replica: ReplicaId, keys: Sequence[BlockKey]) -> int:
        return self.table.drop_blocks(replica, keys)

    async def stats(self) -> IndexStats:
        return self.table.stats()

    async def held_keys(self, replica: ReplicaId, limit: int) -> list[HeldKeys]:
        return self.table.held_keys(replica, limit)

    async def aclose(self) -> None:
        """Nothing to release: the table is plain memory."""
