"""``FencedWriter``: what the ingest pipelines of one key space apply to in fleet mode (I/O, Redis).

It stands between :class:`~balancer.sources.pipeline.ReplicaPipeline` and the key space's
:class:`~balancer.index.redis.index.RedisIndex`. For each replica whose lease this balancer holds it
knows the generation to write with and the engine positions applied so far, and stores the new
positions in the same atomic call as the batch (so the next holder resumes exactly after it).

* **Redis unreachable.** ``apply`` retries the same batch with exponential backoff, cut short when
  another Redis call of this balancer works again (:mod:`balancer.fleet.redis_back`). Meanwhile the
  pipeline's bounded queue fills; when it overflows, its content is replaced by ``Resync`` for the
  ranks it touched (``kvlb_events_queue_overflow_total``). So ingesters buffer, bounded, then resync.
* **Exactly once.** Each write also requires the positions stored by the previous one
  (``expect_seq``). A write whose answer was lost is recognised by its unique text and not redone;
  positions that are neither (Redis restarted without our last writes) give the replica up, and the
  lease manager takes it anew from the positions Redis kept, replaying the rest from the engine.
* **Fenced.** A :class:`~balancer.index.redis.index.StaleGenerationError` while the lease is still
  ours means we bumped the generation ourselves (a liveness drop, or the lease taken back after it
  expired): take the new one (if the lease manager has not set it already) and write again.
  Otherwise another balancer took the replica: the holding is marked lost, ``on_lost`` is told
  (with the generation the holding wrote with, so a report that arrives after the replica was
  taken anew is told from one about the new holding), and the error goes up (the pipeline logs
  it; the lease manager stops the replica's ingest).

Routing never reads this class: every balancer, this one included, sees the writes through its
mirror (:mod:`balancer.index.redis.mirror`), so all of them apply the same batches in the same order.

**One loop.** A running balancer keeps each writer, its index and its Redis client on the ingest
thread's loop (:mod:`balancer.fleet.space_ingest`): every call here, ``on_lost`` and ``on_redis``
included, runs there. The lease a holding names is read for its owner token only; who holds it
now is asked through the writer's own client (:meth:`FencedWriter._holder`), never the lease's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from balancer.errors import BalancerError
from balancer.events import KvEvent
from balancer.fleet.redis_back import Backoff, RedisBack, RetrySettings
from balancer.index.base import ApplyResult, HeldKeys, IndexStats
from balancer.index.redis.client import REDIS_ERRORS
from balancer.index.redis.index import PositionMismatchError, RedisIndex, StaleGenerationError
from balancer.index.redis.lease import IngestionLease, encode_positions
from balancer.log_limit import LimitedWarnings
from balancer.metrics import Metrics
from balancer.types import BlockKey, Overlap, ReplicaId

log = logging.getLogger(__name__)


class LeaseLostError(BalancerError):
    """This balancer no longer ingests the replica (its lease went to another one)."""


@dataclass(slots=True)
class Holding:
    """One leased replica: how to write it and how far it got."""

    lease: IngestionLease
    generation: int
    positions: dict[int, int] = field(default_factory=dict)
    """Last applied engine sequence number per DP rank (as stored in Redis)."""
    writes: int = 0
    applied: str = ""
    """The positions text Redis holds for the replica (what the next write expects)."""
    writing: str | None = None
    """The positions text of the write in flight (``None``: none). Redis may hold it already while
    its answer is on the way, so a lease taken back then finds it there instead of ``applied``."""
    lost: bool = False

    def wrote_last(self, applied: str) -> bool:
        """Whether ``applied``, the positions text Redis holds, is this holding's own last write:
        the one answered or the one in flight."""
        return applied in (self.applied, self.writing)


class FencedWriter:
    """The :class:`~balancer.index.base.PrefixIndex` (plus ``apply_at``) of one key space's ingest."""

    def __init__(
        self,
        index: RedisIndex,
        *,
        metrics: Metrics,
        on_lost: Callable[[ReplicaId, int], None],
        on_redis: Callable[[BaseException | None], None] = lambda error: None,
        retry: RetrySettings | None = None,
        redis_back: RedisBack | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``on_lost(replica, generation)`` is told that the holding of ``replica`` that wrote with
        ``generation`` is lost; ``on_redis(error)`` how each Redis call went (``None``: it worked), for
        the degraded state. ``redis_back`` wakes the attempts sleeping in their backoff once another
        call works (``None``: each waits its backoff out)."""
        self.index = index
        self.holdings: dict[ReplicaId, Holding] = {}
        self._metrics = metrics
        self._on_lost = on_lost
        self._on_redis = on_redis
        self._retry = retry or RetrySettings()
        self._redis_back = redis_back
        self._wall_clock = wall_clock
        self._warnings = LimitedWarnings(
            log,
            metrics.log_suppressed_total,
            clock=time.monotonic,
            forgotten=metrics.log_causes_forgotten_total,
        )
        self.thread: str | None = None
        """Name of the thread the last write ran on (``None`` before the first): the ingest thread
        in a running balancer (``/admin/fleet`` shows it; tests check it)."""

    def hold(
        self,
        replica: ReplicaId,
        lease: IngestionLease,
        generation: int,
        positions: Mapping[int, int],
        *,
        writes: int = 0,
        applied: str = "",
    ) -> None:
        """Start writing ``replica``; ``applied`` is the positions text Redis holds for it now."""
        self.holdings[replica] = Holding(lease, generation, dict(positions), writes, applied)

    def release(self, replica: ReplicaId) -> Holding | None:
        holding = self.holdings.pop(replica, None)
        if holding is not None:
            holding.lost = True  # a retry loop still running gives up
        return holding

    async def apply(self, replica: ReplicaId, events: Sequence[KvEvent], now: float) -> ApplyResult:
        return await self.apply_at(replica, events, now, {})

    async def apply_at(
        self, replica: ReplicaId, events: Sequence[KvEvent], now: float, positions: Mapping[int, int]
    ) -> ApplyResult:
        """Write one batch fenced by the replica's generation, with its positions; waits out outages."""
        self.thread = threading.current_thread().name
        holding = self._holding(replica)
        merged = {**holding.positions, **positions}
        text = encode_positions(merged, writes=holding.writes + 1)
        holding.writing = text
        try:
            return await self._write(replica, holding, events, merged, text)
        finally:
            holding.writing = None

    async def _write(
        self,
        replica: ReplicaId,
        holding: Holding,
        events: Sequence[KvEvent],
        merged: dict[int, int],
        text: str,
    ) -> ApplyResult:
        """:meth:`apply_at`'s attempts until one lands: fenced writes adopt our own new generation,
        failed ones are retried with backoff (raises once the replica is lost)."""
        backoff = Backoff(self._retry)
        woken = False
        started = time.perf_counter()
        while True:
            try:
                # ``now`` for Redis is wall-clock seconds: shared by every balancer (it only dates
                # speculative entries there, which kvlb keeps local).
                result = await self.index.apply(
                    replica,
                    events,
                    self._wall_clock(),
                    generation=holding.generation,
                    seq=text,
                    expect_seq=holding.applied,
                )
            except PositionMismatchError:
                self._on_redis(None)
                if await self.index.client.hget(self.index.keys.applied_seq, replica) != text:
                    holding.lost = True
                    log.warning("replica %s: Redis lost our last writes; taking it anew", replica)
                    self._on_lost(replica, holding.generation)
                    raise
                result = ApplyResult()  # our previous attempt landed; its answer was lost
            except StaleGenerationError as exc:
                self._on_redis(None)
                await self._fenced(replica, holding, exc)
                continue
            except REDIS_ERRORS as exc:
                self._on_redis(exc)
                self._metrics.redis_errors_total.labels("writer").inc()
                self._metrics.redis_apply_retries_total.inc()
                if backoff.failures == 0:  # once per batch, and batches queue up: limited
                    self._warnings.warning(
                        "redis_write_failed",
                        replica,
                        "replica %s: Redis write failed (%s); retrying with backoff",
                        replica,
                        exc,
                    )
                woken = await self._wait(backoff, backoff.failed(time.monotonic(), woken=woken))
                self._holding(replica)  # raises once the lease went away meanwhile
                continue
            self._on_redis(None)
            self._warnings.resolved("redis_write_failed", replica)
            holding.positions, holding.applied = merged, text
            holding.writes += 1
            self._metrics.redis_apply_seconds.observe(time.perf_counter() - started)
            return result

    async def _wait(self, backoff: Backoff, wait_s: float) -> bool:
        """Sleep ``wait_s`` after a failed attempt, or less if woken; ``True`` if woken."""
        if self._redis_back is None or not backoff.wakeable:
            await asyncio.sleep(wait_s)
            return False
        return await self._redis_back.sleep(wait_s)

    def _holding(self, replica: ReplicaId) -> Holding:
        holding = self.holdings.get(replica)
        if holding is None or holding.lost:
            raise LeaseLostError(f"replica {replica!r} is not ingested by this balancer")
        return holding

    async def _fenced(self, replica: ReplicaId, holding: Holding, exc: StaleGenerationError) -> None:
        """Adopt the new generation if the lease is still ours, else give the replica up (raises)."""
        self._metrics.redis_stale_writes_total.inc()
        if await self._holder(replica) == holding.lease.owner and exc.current >= holding.generation:
            # Ours: the bump was our own (a liveness drop, or the lease taken back, which may have
            # set the new generation here already while the refused write was on its way).
            if exc.current > holding.generation:
                log.info("replica %s: generation %d -> %d", replica, holding.generation, exc.current)
                holding.generation = exc.current
            return
        holding.lost = True
        log.warning("replica %s: another balancer ingests it now (%s)", replica, exc)
        self._on_lost(replica, holding.generation)
        raise exc

    async def _holder(self, replica: ReplicaId) -> str | None:
        """The owner token of ``replica``'s lease now, read through this writer's own client."""
        holder = await self.index.client.get(self.index.keys.lease(replica))
        return holder.decode() if isinstance(holder, bytes) else holder

    async def drop(self, replica: ReplicaId) -> int:
        """Drop ``replica`` fleet-wide (bumps its generation; a held replica goes on writing)."""
        dropped = await self.index.drop_replica(replica)
        holding = self.holdings.get(replica)
        if holding is not None:
            holding.generation = await self.index.generation(replica)
        return dropped

    # ------------------------------------- the rest of PrefixIndex (EventIngest applies and drops only)

    async def match(
        self, keys: Sequence[BlockKey], among: Collection[ReplicaId] | None, now: float
    ) -> Overlap:
        return await self.index.match(keys, among, now)

    async def add_speculative(
        self, replica: ReplicaId, keys: Sequence[BlockKey], ttl_s: float, now: float
    ) -> None:
        """Speculative entries stay local to each balancer (its mirror's table): nothing to do here."""

    async def drop_replica(self, replica: ReplicaId) -> int:
        return await self.drop(replica)

    async def drop_blocks(self, replica: ReplicaId, keys: Sequence[BlockKey]) -> int:
        return await self.index.drop_blocks(replica, keys)

    async def stats(self) -> IndexStats:
        return await self.index.stats()

    async def held_keys(self, replica: ReplicaId, limit: int) -> list[HeldKeys]:
        return await self.index.held_keys(replica, limit)

    async def aclose(self) -> None:
        """The index belongs to the fleet runtime, which closes it."""
