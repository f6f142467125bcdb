"""``SpaceIngest``: one key space's fleet-mode ingestion, run on the ingest thread (I/O: a thread hop).

In fleet mode a key space's :class:`~balancer.sources.pipeline.EventIngest` (sources, queues,
appliers) writes through its :class:`~balancer.fleet.writer.FencedWriter` to a
:class:`~balancer.index.redis.index.RedisIndex`. All three, and the Redis client they write with,
live on the loop of the balancer's :class:`~balancer.sources.ingest_thread.IngestThread`: decoding a
flood and the writer's client-side work (planning, script calls, retries) never take the request
loop's time. The mirrors run there too (:mod:`balancer.fleet.space_mirror`), on a client of their
own. The request loop keeps the lease manager, the policy sync and the snapshot leases, on clients
of its own; no Redis client is used from both loops.

This class is the lease manager's handle (:mod:`balancer.fleet.leases`). Each method is one hop to
the ingest loop (``IngestThread.call``) that does the whole step there, so what must happen
together happens together: :meth:`take` registers the holding, starts the sources and queues the
take-over resyncs before any source runs; :meth:`give_up` stops the sources, drains the queue and
releases the holding. Whatever the request loop gets back is a copy (:class:`HoldingView`), never the
writer's live state. ``status`` reads the ingest counters without a hop (a point-in-time copy, as
:class:`~balancer.sources.ingest_thread.ThreadedIngest` does).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from balancer.events import Resync
from balancer.fleet.writer import FencedWriter, Holding
from balancer.index.redis.lease import IngestionLease
from balancer.sources.base import EventSource, IngestBatch
from balancer.sources.ingest_thread import IngestThread, ThreadedIngest
from balancer.sources.pipeline import EventIngest, ReplicaIngestStatus
from balancer.types import ReplicaId


@dataclass(frozen=True, slots=True)
class HoldingView:
    """A copy of one replica's :class:`~balancer.fleet.writer.Holding`, taken on the ingest loop."""

    generation: int
    positions: Mapping[int, int]
    """Last applied engine sequence number per DP rank."""
    writes: int
    applied: str
    """The positions text Redis holds for the replica (what the next write expects)."""
    lost: bool


class SpaceIngest:
    """The request loop's handle on one key space's writer and ingest, which run on ``thread``."""

    def __init__(self, thread: IngestThread, writer: FencedWriter, ingest: EventIngest) -> None:
        self.thread = thread
        self.writer = writer
        """Lives on the ingest loop: call it there (``thread.call``); reading a counter is fine."""
        self._ingest = ThreadedIngest(thread, ingest)

    async def start(self) -> None:
        await self._ingest.start()

    async def aclose(self) -> None:
        await self._ingest.aclose()

    def status(self, only: Collection[ReplicaId] | None = None) -> dict[ReplicaId, ReplicaIngestStatus]:
        return self._ingest.status(only)

    def engine_gone(self, replica: ReplicaId, why: str) -> None:
        """``replica``'s probe found nothing listening at its engine (a signal: returns at once)."""
        self._ingest.engine_gone(replica, why)

    def engine_back(self, replica: ReplicaId) -> None:
        self._ingest.engine_back(replica)

    async def take(
        self,
        replica: ReplicaId,
        engine: str,
        lease: IngestionLease,
        generation: int,
        positions: Mapping[int, int],
        *,
        writes: int,
        applied: str,
        sources: Sequence[EventSource],
        resyncs: Sequence[Resync] = (),
    ) -> None:
        """Start ingesting ``replica`` with a newly granted lease: hold it in the writer, register
        its sources (they start at once) and queue ``resyncs`` ahead of their first batch."""
        writer, ingest = self.writer, self._ingest.ingest
        wrapped = self._ingest.yielding(sources)

        async def take() -> None:
            writer.hold(replica, lease, generation, positions, writes=writes, applied=applied)
            pipeline = ingest.add_replica(replica, engine, wrapped)
            if resyncs:  # before the sources' tasks first run: this is one step of the loop
                pipeline.offer(IngestBatch(tuple(resyncs)))

        await self.thread.call(take)

    async def give_up(self, replica: ReplicaId, *, drain_s: float = 0.0) -> tuple[bool, HoldingView | None]:
        """Stop ingesting ``replica``: its sources stop, its queue gets ``drain_s`` to reach Redis,
        its applier stops and the writer forgets it. Returns whether every batch taken from the
        engine was applied, and the holding as it ended (``None`` if it was not held)."""
        writer, ingest = self.writer, self._ingest.ingest

        async def give_up() -> tuple[bool, HoldingView | None]:
            drained = await ingest.remove_replica(replica, drop_index=False, drain_s=drain_s)
            return drained, _view(writer.release(replica))

        return await self.thread.call(give_up)

    async def holding(self, replica: ReplicaId) -> HoldingView | None:
        """A copy of the writer's holding of ``replica`` (``None``: not held)."""
        writer = self.writer

        async def read() -> HoldingView | None:
            return _view(writer.holdings.get(replica))

        return await self.thread.call(read)

    async def adopt_generation(self, replica: ReplicaId, generation: int, applied: str) -> bool:
        """Write ``replica`` with ``generation`` from now on (a lease taken back); ``False`` if the
        writer no longer holds it, or if ``applied`` (the positions Redis holds) is not its own last
        write, answered or in flight (someone else wrote the replica meanwhile)."""
        writer = self.writer

        async def adopt() -> bool:
            holding = writer.holdings.get(replica)
            if holding is None or holding.lost or not holding.wrote_last(applied):
                return False
            holding.generation = generation
            return True

        return await self.thread.call(adopt)

    async def drop(self, replica: ReplicaId) -> int:
        """Drop ``replica``'s blocks fleet-wide (:meth:`FencedWriter.drop`)."""
        return await self.thread.call(lambda: self.writer.drop(replica))


def _view(holding: Holding | None) -> HoldingView | None:
    if holding is None:
        return None
    return HoldingView(
        holding.generation, dict(holding.positions), holding.writes, holding.applied, holding.lost
    )
