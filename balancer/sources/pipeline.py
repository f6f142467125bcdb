"""Per-replica ingest pipelines and their supervisor (does I/O: owns tasks, reads the clock).

::

    source(s) ──offer()──▶ bounded queue ──▶ one applier task ──▶ index.apply(replica, events, now)

One queue and one applier per replica keep that replica's events in order; replicas never wait on
each other. The queue is bounded in batches and in bytes (:func:`batch_bytes`, an estimate of the
decoded events' memory), so a flood of large batches costs at most ``queue_max_bytes`` per replica;
one ``index.apply`` merges queued batches, so it is bounded by the same figure.
``offer`` never blocks: when the queue is full its content is dropped and replaced by
``Resync(rank, "overflow")`` for every rank it touched (counted in
``kvlb_events_queue_overflow_total``), because stale affinity is better than unbounded memory or a
stalled socket. ``now`` for the index is ``time.monotonic()``, read here, never in the pure core.

Repeated failures are logged through :class:`~balancer.log_limit.LimitedWarnings`: once, then once
a minute with the count (``kvlb_log_suppressed_total{cause}``), so a lost lease or a Redis outage
does not write a line (or a traceback) per queued batch.

An index that also offers ``apply_at`` (:class:`PositionedIndex`, the Redis writer of
:mod:`balancer.fleet.writer`) gets, with each apply, the last engine sequence number per DP rank
among the applied batches (a ZMQ ``seq``, or TRT-LLM's last ``event_id``), so a balancer that takes
the replica over later resumes right after it, or checks that what it drains follows on.

:class:`EventIngest` owns every task (sources and appliers); ``aclose`` cancels and awaits them all.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Collection, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar, cast, runtime_checkable

from balancer.errors import BalancerError, ConfigError
from balancer.events import KvEvent, Resync, Stored, event_blocks, split_chained
from balancer.gc_tuning import thread_cpu_s
from balancer.index.base import ApplyResult, PrefixIndex
from balancer.log_limit import LimitedWarnings
from balancer.metrics import Metrics
from balancer.sources.base import EventSource, Gate, IngestBatch, SourceStatus
from balancer.sources.budget import CpuBudget
from balancer.tasks import cancel_all, spawn
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class IngestSettings:
    """Settings of every :class:`ReplicaPipeline`."""

    queue_max_batches: int = 4096
    """Batches queued per replica between its sources and its applier. When full, the queue is
    emptied and replaced by one ``Resync`` per affected rank (counted). Must be ≥ 1."""
    coalesce_max_batches: int = 64
    """Most queued batches merged into one ``index.apply`` call (fewer awaits under load, same
    order). Must be ≥ 1."""
    max_event_blocks: int = 262_144
    """Most blocks one event may carry (engine hashes, or whole token blocks of a ``Stored``). A
    larger event is dropped where it enters the queue and its rank resyncs (``Resync(rank,
    "oversize")``, counted in ``kvlb_events_oversize_total``), so one hostile or broken event
    cannot hold the index (or a shared Redis) for seconds. Must be ≥ 1."""
    queue_max_bytes: int = 64 * 1024 * 1024
    """Bytes (:func:`batch_bytes`) queued per replica; a batch that would pass it overflows the
    queue like one batch too many. A single batch larger than this is replaced by resyncs of its
    ranks at once. Must be ≥ 1."""

    cpu_share: float = 0.25
    """CPU seconds per second the replica's ingestion (decode and apply) may spend; past it its
    sources shed messages undecoded and its ranks resync (:mod:`balancer.sources.budget`). Must be
    > 0; ``math.inf`` turns the budget off."""
    cpu_burst_s: float = 0.5
    """CPU seconds of ingestion a replica may save up while quiet and spend at once. Must be > 0."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field out of range."""
        for name in ("cpu_share", "cpu_burst_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ingest.{name} must be > 0, got {getattr(self, name)}")
        for name in ("queue_max_batches", "coalesce_max_batches", "max_event_blocks", "queue_max_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ingest.{name} must be >= 1, got {getattr(self, name)}")


class OwnCpu(Generic[T]):
    """Awaits a coroutine and adds up the thread CPU spent in its own steps (``cpu_s``).

    ``time.thread_time()`` around a plain ``await`` would also count whatever the event loop ran
    while the coroutine waited (other replicas' ingestion, and in fleet mode every request and the
    Redis writer's backoff sleeps): charged to one replica's budget, that made a Redis outage spend
    it and shed (then resync) healthy engines. Each step from resumption to the next suspension is
    timed instead."""

    __slots__ = ("_coroutine", "cpu_s")

    def __init__(self, coroutine: Coroutine[Any, Any, T]) -> None:
        self._coroutine = coroutine
        self.cpu_s = 0.0

    def __await__(self) -> Generator[Any, Any, T]:
        steps = self._coroutine.__await__()
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            started = thread_cpu_s()
            try:
                yielded = steps.send(sent) if thrown is None else steps.throw(thrown)
            except StopIteration as done:
                return cast(T, done.value)
            finally:
                self.cpu_s += thread_cpu_s() - started
            try:
                sent, thrown = (yield yielded), None
            except GeneratorExit:
                self._coroutine.close()
                raise
            except BaseException as exc:  # handed to the coroutine (cancellation too)
                sent, thrown = None, exc


CLOCK_AHEAD_S = 1.0
"""A batch stamped more than this in kvlb's future (seconds; a negative event lag) means the engine's
clock runs ahead of kvlb's: warned, since the lag figures and their alert then read low."""
EVENT_OVERHEAD_BYTES = 100
"""Estimated memory of one decoded event besides its tokens and hashes (object, tuple, fields)."""
HASH_BYTES = 40
"""Estimated memory of one engine hash in a decoded event (a Python int and its tuple slot)."""


def batch_bytes(events: Sequence[KvEvent]) -> int:
    """Estimated memory of decoded ``events``: tokens (packed bytes), hashes, per-event overhead."""
    total = 0
    for event in events:
        total += EVENT_OVERHEAD_BYTES
        if type(event) is Stored:
            total += len(event.tokens) + HASH_BYTES * len(event.engine_hashes)
        else:
            total += HASH_BYTES * len(getattr(event, "engine_hashes", ()))
    return total


@runtime_checkable
class PositionedIndex(Protocol):
    """An index that records, with each batch, the engine positions it came from."""

    async def apply_at(
        self, replica: ReplicaId, events: Sequence[KvEvent], now: float, positions: Mapping[int, int]
    ) -> ApplyResult:
        """``apply`` plus ``positions``: DP rank → sequence number of its last batch in ``events``."""
        ...


@dataclass(frozen=True, slots=True)
class ReplicaIngestStatus:
    """One replica's ingest state for ``/admin/replicas``."""

    replica: ReplicaId
    engine: str
    queued_batches: int
    queued_bytes: int
    """:func:`batch_bytes` of the queued batches (bounded by ``limits.event_queue_bytes``)."""
    overflows: int
    applied_batches: int
    apply_errors: int
    last_applied_wall_ts: float | None
    sources: tuple[SourceStatus, ...]
    last_lag_s: float | None = None
    """Event lag of the last applied batch that carried an engine timestamp: our wall clock when it
    was applied minus the engine's timestamp (``kvlb_events_lag_seconds``; clocks may be skewed)."""
    last_resync_wall_ts: float | None = None
    """Our wall clock when a resync of any rank was last applied (``None``: never)."""


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
        self._apply_at = index.apply_at if isinstance(index, PositionedIndex) else None
        self._busy = False
        self._metrics = metrics
        self._monotonic = monotonic
        self._wall_clock = wall_clock
        self._queue: asyncio.Queue[tuple[IngestBatch, int]] = asyncio.Queue(self.settings.queue_max_batches)
        self.queued_bytes = 0
        """:func:`batch_bytes` of the queued batches."""
        self._warnings = LimitedWarnings(
            log, metrics.log_suppressed_total, clock=monotonic, forgotten=metrics.log_causes_forgotten_total
        )
        self._unsure_ranks: set[int] = set()
        self.overflows = 0
        self.applied_batches = 0
        self.apply_errors = 0
        self.last_applied_wall_ts: float | None = None
        self.last_lag_s: float | None = None
        self.last_resync_wall_ts: float | None = None
        self.budget = (
            None
            if math.isinf(self.settings.cpu_share)
            else (CpuBudget(self.settings.cpu_share, self.settings.cpu_burst_s))
        )
        """The replica's ingestion CPU budget, shared with its sources (``None``: unbounded)."""

    def admits(self) -> bool:
        """Whether the replica's sources may decode now: its CPU budget is not spent and its queue is
        under half full (past that the applier is behind, and what is decoded now would most likely
        be dropped by the next overflow: it is cheaper to drop it undecoded)."""
        settings = self.settings
        if (
            self._queue.qsize() * 2 > settings.queue_max_batches
            or self.queued_bytes * 2 > settings.queue_max_bytes
        ):
            return False
        return self.budget is None or self.budget.allows(self._monotonic())

    def spent(self) -> str:
        """Why :meth:`admits` says no, in figures (the shed warning's ``budget`` cause)."""
        settings = self.settings
        if (
            self._queue.qsize() * 2 > settings.queue_max_batches
            or self.queued_bytes * 2 > settings.queue_max_bytes
        ):
            return (
                f"its event queue is over half full ({self._queue.qsize()} of {settings.queue_max_batches} "
                f"batches, {self.queued_bytes} of {settings.queue_max_bytes} bytes)"
            )
        if self.budget is None:
            return "its ingestion budget is off"
        return (
            f"its ingestion CPU budget is spent ({self.budget.level_s(self._monotonic()):.3f} s left of a "
            f"{settings.cpu_burst_s:g} s burst at {settings.cpu_share:g} CPU s/s)"
        )

    def charge(self, cpu_s: float) -> None:
        """Count ``cpu_s`` of decoding or applying against the replica's budget."""
        if self.budget is not None:
            self.budget.charge(cpu_s, self._monotonic())

    @property
    def queued_batches(self) -> int:
        return self._queue.qsize()

    def offer(self, batch: IngestBatch) -> None:
        """Queue ``batch`` without blocking; on overflow, replace the backlog by resyncs."""
        if not batch.events:
            return
        if any(event_blocks(event) > self.settings.max_event_blocks for event in batch.events):
            batch = self._without_oversize(batch)
        size = batch_bytes(batch.events)
        if self.queued_bytes + size <= self.settings.queue_max_bytes:
            try:
                self._queue.put_nowait((batch, size))
                self.queued_bytes += size
                return
            except asyncio.QueueFull:
                pass
        dropped = [batch]
        while not self._queue.empty():
            dropped.append(self._queue.get_nowait()[0])
        self.queued_bytes = 0
        ranks = sorted({event.dp_rank for item in dropped for event in item.events})
        self.overflows += 1
        self._metrics.events_queue_overflow_total.labels(self.replica).inc()
        self._warnings.warning(
            "events_queue_overflow",
            self.replica,
            "replica %s: event queue full (%d batches, %d bytes); dropped them, resyncing ranks %s",
            self.replica,
            len(dropped),
            size,
            ranks,
        )
        resync = IngestBatch(tuple(Resync(rank, "overflow") for rank in ranks))
        resync_size = batch_bytes(resync.events)
        self._queue.put_nowait((resync, resync_size))
        self.queued_bytes = resync_size

    def _without_oversize(self, batch: IngestBatch) -> IngestBatch:
        """``batch`` with each event over ``max_event_blocks`` replaced by a resync of its rank (a
        ``chained`` store, whose engine events had one block each, by runs of at most that many)."""
        cap = self.settings.max_event_blocks
        kept: list[KvEvent] = []
        for event in batch.events:
            blocks = event_blocks(event)
            if blocks <= cap:
                kept.append(event)
                continue
            if type(event) is Stored and event.chained:  # one-block events, merged by the decoder
                kept.extend(split_chained(event, cap))
                continue
            self._metrics.events_oversize_total.labels(self.replica).inc()
            self._warnings.warning(
                "events_oversize",
                self.replica,
                "replica %s: dropped an event of %d blocks (limits.max_event_blocks = %d); resyncing rank %d",
                self.replica,
                blocks,
                cap,
                event.dp_rank,
            )
            kept.append(Resync(event.dp_rank, "oversize"))
        return replace(batch, events=tuple(kept))

    async def run(self) -> None:
        """Apply queued batches in order until cancelled; an index failure is logged, not fatal."""
        while True:
            batches = [self._taken(await self._queue.get())]
            while len(batches) < self.settings.coalesce_max_batches and not self._queue.empty():
                batches.append(self._taken(self._queue.get_nowait()))
            self._busy = True
            applying = OwnCpu(self._apply(batches))
            try:
                await applying
            finally:
                self._busy = False
                self.charge(applying.cpu_s)

    def _taken(self, item: tuple[IngestBatch, int]) -> IngestBatch:
        batch, size = item
        self.queued_bytes = max(0, self.queued_bytes - size)
        return batch

    async def wait_applied(self, timeout_s: float) -> bool:
        """Wait (up to ``timeout_s``) until every queued batch is applied; ``True`` when all were,
        without an apply failure left to resync (stop the sources first)."""
        deadline = self._monotonic() + timeout_s
        while (self._busy or not self._queue.empty()) and self._monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        return not self._busy and self._queue.empty() and not self._unsure_ranks

    async def _apply(self, batches: list[IngestBatch]) -> None:
        events: list[KvEvent] = [Resync(rank, "stale") for rank in sorted(self._unsure_ranks)]
        for batch in batches:
            events.extend(batch.events)
        try:
            if self._apply_at is not None:
                positions: dict[int, int] = {}
                for batch in batches:  # in order: the last batch of a rank gives its position
                    positions.update(batch.positions)
                    if batch.seq is not None and batch.dp_rank is not None:
                        positions[batch.dp_rank] = batch.seq
                result = await self._apply_at(self.replica, events, self._monotonic(), positions)
            else:
                result = await self._index.apply(self.replica, events, self._monotonic())
        except Exception as exc:  # a failing backend (e.g. Redis down, lease lost) must not end ingestion
            self.apply_errors += 1
            self._metrics.events_applied_total.labels(self.engine, "batch", "error").inc()
            # kvlb's own errors (a lost lease, a fenced write) are expected: no traceback for them.
            self._warnings.warning(
                "index_apply_failed",
                self.replica,
                "replica %s: index.apply failed (%s: %s); its ranks will resync",
                self.replica,
                type(exc).__name__,
                exc,
                exc_info=not isinstance(exc, BalancerError),
            )
            # The index may hold part of these events: clear those ranks on the next apply.
            self._unsure_ranks.update(event.dp_rank for event in events)
            return
        self._unsure_ranks.clear()
        self._warnings.resolved("index_apply_failed", self.replica)
        self.applied_batches += len(batches)
        self._metrics.events_applied_batches_total.labels(self.replica).inc(len(batches))
        self.last_applied_wall_ts = self._wall_clock()
        self._record(result, events)
        engine_ts = batches[-1].engine_ts
        if engine_ts is not None:
            lag_s = self.last_applied_wall_ts - engine_ts
            self.last_lag_s = lag_s
            self._metrics.events_lag_seconds.labels(self.replica).set(lag_s)
            if lag_s < -CLOCK_AHEAD_S:
                self._warnings.warning(
                    "engine_clock_ahead",
                    self.replica,
                    "replica %s: a KV event batch is stamped %.1f s in kvlb's future: the engine's "
                    "clock is ahead of kvlb's by at least that, and its event lag "
                    "(kvlb_events_lag_seconds, KvlbIndexLagging) reads low by as much; synchronise the "
                    "clocks (NTP)",
                    self.replica,
                    -lag_s,
                )
        if result.resyncs:
            self.last_resync_wall_ts = self.last_applied_wall_ts

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


@runtime_checkable
class ConsumingSource(Protocol):
    """A source whose reads take the events out of the engine (TRT-LLM's ``/kv_cache_events``
    drain): cancelled in the middle of one, the events the engine handed over are lost, and nothing
    tells the next holder. A graceful stop (:meth:`EventIngest.remove_replica` with ``drain_s``)
    asks it to :meth:`finish` and lets the exchange under way deliver first."""

    def finish(self) -> None:
        """Start no new exchange with the engine (the source is about to be cancelled)."""
        ...

    @property
    def exchanging(self) -> bool:
        """Whether an exchange is under way whose events are not emitted yet."""
        ...

    @property
    def settled(self) -> bool:
        """Whether every exchange so far delivered its events or is known to have taken none (a
        failed one, a timeout above all, may have emptied the engine's buffer)."""
        ...


FINISH_POLL_S = 0.01
"""How often a graceful stop looks whether the consuming sources' exchanges are over (seconds)."""


@runtime_checkable
class EngineWatchingSource(Protocol):
    """A source that waits on the engine in ways the replica's health probe can cut short (a ZMQ
    replay request): told on the ingest loop when the probe finds nothing listening at the engine
    (:mod:`balancer.sources.replay_watch`)."""

    def engine_gone(self, why: str) -> None:
        """The probe found nothing listening at the engine: stop waiting on it now."""
        ...

    def engine_back(self) -> None:
        """The probe passes again."""
        ...


@runtime_checkable
class GatedSource(Protocol):
    """A source that sheds messages while its replica's CPU budget is spent."""

    gate: Gate | None


class IngestView(Protocol):
    """What the service reads of an ingest: :class:`EventIngest`, or its handle on the ingest
    thread (:class:`~balancer.sources.ingest_thread.ThreadedIngest`)."""

    def status(self, only: Collection[ReplicaId] | None = None) -> dict[ReplicaId, ReplicaIngestStatus]:
        """The ingest state of each replica it ingests (of those ``only`` names; ``None``: all)."""
        ...


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

    async def remove_replica(
        self, replica: ReplicaId, *, drop_index: bool = True, drain_s: float = 0.0
    ) -> bool:
        """Stop ``replica``'s tasks and, by default, forget its blocks in the index.

        With ``drain_s`` > 0 the sources stop first and queued batches get that long to be applied;
        a :class:`ConsumingSource` first finishes the exchange under way (its events are queued
        too), within the same ``drain_s``. Returns ``True`` when every batch taken from the engine
        was applied."""
        entry = self._replicas.pop(replica, None)
        if entry is None:
            return True
        try:
            settled = True
            if drain_s > 0:
                deadline = time.monotonic() + drain_s
                settled = await self._finish_exchanges(entry.sources, deadline)
            await cancel_all(entry.tasks[1:])  # the sources
            if drain_s > 0:
                left_s = max(0.0, deadline - time.monotonic())
                applied = await entry.pipeline.wait_applied(left_s) and settled
            else:
                applied = False
        finally:  # also when the drain is cancelled (a hand-over timed out): nothing else owns it now
            await cancel_all(entry.tasks[:1])  # the applier
        if drop_index:
            await self._index.drop_replica(replica)
        return applied

    @staticmethod
    async def _finish_exchanges(sources: Sequence[EventSource], deadline: float) -> bool:
        """Ask the consuming sources to finish, wait (until ``deadline``, monotonic) for their
        exchanges under way to deliver; ``True`` when none took events it did not emit. Called
        right before the sources are cancelled, with no await in between."""
        consuming = [s for s in sources if isinstance(s, ConsumingSource)]
        for source in consuming:
            source.finish()
        while any(s.exchanging for s in consuming) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(FINISH_POLL_S)
        return all(s.settled and not s.exchanging for s in consuming)

    def engine_gone(self, replica: ReplicaId, why: str) -> None:
        """``replica``'s health probe found nothing listening at its engine (``why``): its sources
        stop waiting on the engine (a replay in flight ends at once). A no-op for a replica not
        ingested here."""
        entry = self._replicas.get(replica)
        for source in () if entry is None else entry.sources:
            if isinstance(source, EngineWatchingSource):
                source.engine_gone(why)

    def engine_back(self, replica: ReplicaId) -> None:
        """``replica``'s health probe passes again after :meth:`engine_gone`."""
        entry = self._replicas.get(replica)
        for source in () if entry is None else entry.sources:
            if isinstance(source, EngineWatchingSource):
                source.engine_back()

    def pipeline(self, replica: ReplicaId) -> ReplicaPipeline | None:
        """The pipeline of ``replica`` while it ingests."""
        entry = self._replicas.get(replica)
        return None if entry is None else entry.pipeline

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
            await cancel_all(entry.tasks)

    def status(self, only: Collection[ReplicaId] | None = None) -> dict[ReplicaId, ReplicaIngestStatus]:
        """Ingest state of every replica (queue, overflows, applies, each source's stream state); of
        those ``only`` names when given (a listing made a few replicas at a time)."""
        if only is None:
            entries = list(self._replicas.items())
        else:
            entries = [(r, e) for r in only if (e := self._replicas.get(r)) is not None]
        return {
            replica: ReplicaIngestStatus(
                replica=replica,
                engine=entry.pipeline.engine,
                queued_batches=entry.pipeline.queued_batches,
                queued_bytes=entry.pipeline.queued_bytes,
                overflows=entry.pipeline.overflows,
                applied_batches=entry.pipeline.applied_batches,
                apply_errors=entry.pipeline.apply_errors,
                last_applied_wall_ts=entry.pipeline.last_applied_wall_ts,
                sources=tuple(source.status() for source in entry.sources),
                last_lag_s=entry.pipeline.last_lag_s,
                last_resync_wall_ts=entry.pipeline.last_resync_wall_ts,
            )
            for replica, entry in entries
        }

    def _start(self, entry: _Replica) -> None:
        name = entry.pipeline.replica
        for source in entry.sources:
            if isinstance(source, GatedSource):
                source.gate = entry.pipeline
        entry.tasks = [spawn(entry.pipeline.run(), f"kvlb-apply-{name}")] + [
            spawn(source.run(entry.pipeline.offer), f"kvlb-source-{name}-{position}")
            for position, source in enumerate(entry.sources)
        ]
