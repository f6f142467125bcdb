"""Replicas that left discovery without their lease holder retiring them (pure: no I/O, no clock).

When discovery removes a replica, only the balancer holding its lease drops its blocks and retires
it (deletes its lease, position and generation: ``docs/redis-fleet.md``, "Replicas that leave").
When no balancer does (the holder gave it up just then, died during the removal, or its Redis calls
failed), the replica's ``seq`` and ``gen`` fields and its blocks stayed in Redis for good.
:class:`Orphans` remembers each replica a balancer forgot without retiring it, until it is due: then
the lease manager takes the replica's lease (which fences every earlier writer), drops its blocks and
retires it, as its holder would have; or leaves it to the holder it finds still holding the lease.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from balancer.types import ReplicaId

T = TypeVar("T")

ORPHANS_MAX = 1024
"""Replicas remembered at once, per balancer; the oldest beyond it are forgotten (counted by the
caller: ``kvlb_redis_lease_events_total{event="orphan_overflow"}``). Removals come from discovery,
a few per rollout of a pod."""


class Orphans(Generic[T]):
    """Replica id → (what the sweep needs, monotonic time it is due), in the order added."""

    def __init__(self, max_count: int = ORPHANS_MAX) -> None:
        if max_count <= 0:
            raise ValueError(f"max_count must be > 0, got {max_count}")
        self.max_count = max_count
        self._due: dict[ReplicaId, tuple[T, float]] = {}

    def __len__(self) -> int:
        return len(self._due)

    def add(self, replica: ReplicaId, item: T, due: float) -> int:
        """Remember ``replica`` until ``due`` (added again: the later time). Returns how many of the
        oldest were forgotten to stay within ``max_count``."""
        self._due.pop(replica, None)
        self._due[replica] = (item, due)
        forgotten = 0
        while len(self._due) > self.max_count:
            del self._due[next(iter(self._due))]
            forgotten += 1
        return forgotten

    def cancel(self, replica: ReplicaId) -> None:
        """The replica is back (discovery lists it again): nothing to retire."""
        self._due.pop(replica, None)

    def take_due(self, now: float) -> list[tuple[ReplicaId, T]]:
        """The replicas due at ``now``, forgotten here."""
        due = [(replica, item) for replica, (item, at) in self._due.items() if at <= now]
        for replica, _ in due:
            del self._due[replica]
        return due
