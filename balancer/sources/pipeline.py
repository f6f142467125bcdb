"""Per-replica ingest pipelines and their supervisor (does I/O: owns tasks, reads the clock).

::

    source(s) ──offer()──▶ bounded queue ──▶ one applier task ──▶ index.apply(replica, events, now)

One queue and one applier per replica keep that replica's events in order; replicas never wait on
each other. ``offer`` never blocks: when the queue is full its content is dropped and replaced by
``Resync(rank, "overflow")`` for every rank it touched (counted in
``kvlb_events_queue_overflow_total``), because stale affinity is better than unbounded memory or a
stalled socket. ``now`` for the index is ``time.monotonic()``, read here, never in the pure core.

:class:`EventIngest` owns every task (sources and appliers); ``aclose`` cancels and awaits them all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from balancer.errors import ConfigError
from balancer.events import KvEvent, Resync
from balancer.index.base import ApplyResult, PrefixIndex
from balancer.metrics import Metrics
from balancer.sources.base import EventSource, IngestBatch, SourceStatus
from balancer.types import ReplicaId

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IngestSettings:
    """Settings of every :class:`ReplicaPipeline`."""

    queue_max_batches: int = 4096
    """Batches queued per replica between its sources and its applier. When full, the queue is
    emptied and replaced by one ``Resync`` per affected rank (counted). Must be ≥ 1."""
    coalesce_max_batches: int = 64
    """Most queued batches merged into one ``index.apply`` call (fewer awaits under load, same
    order). Must be ≥ 1."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field out of range."""
        for name in ("queue_max_batches", "coalesce_max_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ingest.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class ReplicaIngestStatus:
    """One replica's ingest state for ``/admin/replicas``."""

    replica: ReplicaId
    engine: str
    queued_batches: int
    overflows: int
    applied_batches: int
    apply_errors: int
    last_applied_wall_ts: float | None
    sources: tuple[SourceStatus, ...]


class ReplicaPipeline:
    """The bounded queue and ordered applier of one replica."""

    def __init__(
        self,
        replica: ReplicaId,
        engine: str,
        index: PrefixIndex,
        *,
        metrics: Metrics,
        settings: IngestSettings | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.replica = replica
        self.engine = engine
        self.settings = settings or IngestSettings()
        self.settings.validate()
        self._index = index
        self._metrics = metrics
        self._monotonic = monotonic
        self._wall_clock = wall_clock
        self._queue: asyncio.Queue[IngestBatch] = asyncio.Queue(self.settings.queue_max_batches)
        self._unsure_ranks: set[int] = set()
        self.overflows = 0
        self.applied_batches = 0
        self.apply_errors = 0
        self.last_applied_wall_ts: float | None = None

    @property
    def queued_batches(self) -> int:
        return self._queue.qsize()

    def offer(self, batch: IngestBatch) -> None:
        """Queue ``batch`` without blocking; on overflow, replace the backlog by resyncs."""
        if not batch.events:
            return
        try:
            self._queue.put_nowait(batch)
            return
        except asyncio.QueueFull:
            pass
        dropped = [batch]
        while not self._queue.empty():
            dropped.append(self._queue.get_nowait())
        ranks = sorted({event.dp_rank for item in dropped for event in item.events})
        self.overflows += 1
        self._metrics.events_queue_overflow_total.labels(self.replica).inc()
        log.warning(
            "replica %s: event queue full (%d batches); dropped them, resyncing ranks %s",
            self.replica,
            len(dropped),
            ranks,
        )
        self._queue.put_nowait(IngestBatch(tuple(Resync(rank, "overflow") for rank in ranks)))

    async def run(self) -> None:
        """Apply queued batches in order until cancelled; an index failure is logged, not fatal."""
        while True:
            batches = [await self._queue.get()]
            while len(batches) < self.settings.coalesce_max_batches and not self._queue.empty():
                batches.append(self._queue.get_nowait())
            await self._apply(batches)

    async def _apply(self, batches: list[IngestBatch]) -> None:
        events: list[KvEvent] = [Resync(rank, "stale") for rank in sorted(self._unsure_ranks)]
        for batch in batches:
            events.extend(batch.events)
        try:
            result = await self._index.apply(self.replica, events, self._monotonic())
        except Exception:  # a failing backend (e.g. Redis down) must not end ingestion
            self.apply_errors += 1
            self._metrics.events_applied_total.labels(self.engine, "batch", "error").inc()
            log.exception("replica %s: index.apply failed; its ranks will resync", self.replica)
            # The index may hold part of these events: clear those ranks on the next apply.
            self._unsure_ranks.update(event.dp_rank for event in events)
            return
        self._unsure_ranks.clear()
        self.applied_batches += len(batches)
        self.last_applied_wall_ts = self._wall_clock()
        self._record(result, events)
        engine_ts = batches[-1].engine_ts
        if engine_ts is not None:
            lag_s = self.last_applied_wall_ts - engine_ts
            self._metrics.events_lag_seconds.labels(self.replica).set(lag_s)

    def _record(self, result: ApplyResult, events: Sequence[KvEvent]) -> None:
        """Metrics from one apply: ``stored``/``removed`` count blocks, the other types events."""
        applied = self._metrics.events_applied_total
        for kind, status, count in (
            ("stored", "applied", result.stored_blocks),
            ("stored", "unknown_parent", result.skipped_unknown_parent),
            ("stored", "block_size", result.skipped_block_size_mismatch),
            ("removed", "applied", result.removed_blocks),
            ("removed", "unknown", result.unknown_removals),
            ("cleared", "applied", result.cleared_caches),
            ("resync", "applied", result.resyncs),
        ):
            if count:
                applied.labels(self.engine, kind, status).inc(count)
        if result.skipped_unknown_parent:
            self._metrics.index_skipped_total.labels("unknown_parent").inc(result.skipped_unknown_parent)
        if result.unknown_removals:
            self._metrics.index_skipped_total.labels("unknown_removal").inc(result.unknown_removals)
        if result.skipped_block_size_mismatch:
            self._metrics.index_skipped_total.labels("block_size").inc(result.skipped_block_size_mismatch)
        for event in events:
            if isinstance(event, Resync):
                self._metrics.events_resyncs_total.labels(self.replica, event.reason).inc()


@dataclass(slots=True)
class _Replica:
    pipeline: ReplicaPipeline
    sources: tuple[EventSource, ...]
    tasks: list[asyncio.Task[None]]


class EventIngest:
    """Owns one pipeline per replica and every task feeding or draining it."""

    def __init__(
        self, index: PrefixIndex, *, metrics: Metrics, settings: IngestSettings | None = None
    ) -> None:
        self._index = index
        self._metrics = metrics
        self._settings = settings or IngestSettings()
        self._settings.validate()
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._running = False

    def add_replica(self, replica: ReplicaId, engine: str, sources: Sequence[EventSource]) -> ReplicaPipeline:
        """Register ``replica`` and its sources; their tasks start now if ingest is running."""
        if replica in self._replicas:
            raise ValueError(f"replica {replica} is already ingesting")
        pipeline = ReplicaPipeline(
            replica, engine, self._index, metrics=self._metrics, settings=self._settings
        )
        entry = _Replica(pipeline, tuple(sources), [])
        self._replicas[replica] = entry
        if self._running:
            self._start(entry)
        return pipeline

    async def remove_replica(self, replica: ReplicaId, *, drop_index: bool = True) -> None:
        """Stop ``replica``'s tasks and, by default, forget its blocks in the index."""
        entry = self._replicas.pop(replica, None)
        if entry is None:
            return
        await _cancel(entry.tasks)
        if drop_index:
            await self._index.drop_replica(replica)

    async def start(self) -> None:
        """Start every registered replica's applier and sources (idempotent)."""
        if self._running:
            return
        self._running = True
        for entry in self._replicas.values():
            self._start(entry)

    async def aclose(self) -> None:
        """Cancel and await every task, newest first; the index itself is not closed here."""
        self._running = False
        for entry in reversed(list(self._replicas.values())):
            await _cancel(entry.tasks)

    def status(self) -> dict[ReplicaId, ReplicaIngestStatus]:
        """Ingest state of every replica (queue, overflows, applies, each source's stream state)."""
        return {
            replica: ReplicaIngestStatus(
                replica=replica,
                engine=entry.pipeline.engine,
                queued_batches=entry.pipeline.queued_batches,
                overflows=entry.pipeline.overflows,
                applied_batches=entry.pipeline.applied_batches,
                apply_errors=entry.pipeline.apply_errors,
                last_applied_wall_ts=entry.pipeline.last_applied_wall_ts,
                sources=tuple(source.status() for source in entry.sources),
            )
            for replica, entry in self._replicas.items()
        }

    def _start(self, entry: _Replica) -> None:
        name = entry.pipeline.replica
        tasks = [asyncio.create_task(entry.pipeline.run(), name=f"kvlb-apply-{name}")]
        for position, source in enumerate(entry.sources):
            task = asyncio.create_task(
                source.run(entry.pipeline.offer), name=f"kvlb-source-{name}-{position}"
            )
            tasks.append(task)
        for task in tasks:
            task.add_done_callback(_report_exit)
        entry.tasks = tasks


def _report_exit(task: asyncio.Task[None]) -> None:
    """Sources and appliers run until cancelled: an exit is a bug (or a terminated ZMQ context)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("ingest task %s died", task.get_name(), exc_info=exc)
    else:
        log.info("ingest task %s ended", task.get_name())


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` in reverse start order and wait for each to finish."""
    for task in reversed(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
