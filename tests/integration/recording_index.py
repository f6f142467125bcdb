"""Test double of the index for the event-source tests (ZMQ and TRT-LLM): it records every event
``apply`` receives, in order, for the one replica it serves."""

from __future__ import annotations

from collections.abc import Sequence

from balancer.events import KvEvent, Resync, Stored
from balancer.index.base import ApplyResult, IndexStats
from balancer.types import ReplicaId


class RecordingIndex:
    """Test double of the sink: records every event ``apply`` receives, in order."""

    def __init__(self, replica: ReplicaId) -> None:
        self.replica = replica
        self.events: list[KvEvent] = []

    async def apply(self, replica: ReplicaId, events: Sequence[KvEvent], now: float) -> ApplyResult:
        assert replica == self.replica
        self.events.extend(events)
        stored = sum(e.block_count for e in events if isinstance(e, Stored))
        return ApplyResult(stored_blocks=stored, resyncs=sum(isinstance(e, Resync) for e in events))

    async def drop_replica(self, replica: ReplicaId) -> int:
        return 0

    async def stats(self) -> IndexStats:
        return IndexStats(0, 0)

    async def aclose(self) -> None:
        return None

    def pages(self) -> list[int]:
        """Engine hash of every stored page, in arrival order."""
        return [h for e in self.events if isinstance(e, Stored) for h in e.engine_hashes]

    def resyncs(self) -> list[tuple[int, str]]:
        return [(e.dp_rank, e.reason) for e in self.events if isinstance(e, Resync)]

    def timeline(self) -> list[object]:
        """Pages and resyncs interleaved as they arrived."""
        return [
            e.engine_hashes[0] if isinstance(e, Stored) else e.reason
            for e in self.events
            if isinstance(e, Stored | Resync)
        ]
