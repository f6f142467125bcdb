"""``LeaseManager``: which balancer ingests which replica, and replica liveness (I/O, Redis).

Every ``tick_s`` each balancer:

1. **Heartbeats** into the fleet's member set (a ZSET scored with Redis server ``TIME``, so every
   balancer judges expiry on one clock) and reads the live members.
2. **Renews** the leases it holds (``PEXPIRE``, only if still its own). One found gone is *lost*:
   its ingest stops at once, without draining (the new holder resumes from Redis).
3. **Spreads** leases: its fair share is ``ceil(replicas / live members)``. Below it, it takes free
   leases, preferring the replicas that rendezvous hashing gives it; above it, it hands one over
   per tick (sources stopped, queue drained, positions marked clean, lease deleted). For
   ``ttl_s + tick_s`` after a failed tick it takes none: after a Redis outage longer than the TTL
   every lease has expired, and each holder should take its own back (keeping its pipeline) before
   anyone takes another's (which would resync a TRT-LLM replica: the events its holder drained
   and still queues are gone from the engine, and the new holder sees the ``event_id`` gap).
4. **Liveness** of the replicas it holds: one that sent no event and failed its health probes for
   ``replica_timeout_s`` is dropped from the index fleet-wide (``RedisIndex.drop_replica`` bumps its
   generation and appends a drop entry that every mirror applies). It is dropped again only after
   it sends events again.

Replicas found by discovery join with :meth:`LeaseManager.add` and count in the fair share from the
next tick. :meth:`LeaseManager.remove` forgets one that left; if this balancer holds its lease, it
stops the ingest, drops the replica's blocks fleet-wide and deletes the lease and the replica's
stored positions and generation (never mid-tick): a balancer whose discovery still lists it takes
the lease next and starts it without positions, as a new replica. One it did not hold (or whose
retirement failed) it remembers (:mod:`balancer.fleet.orphans`): ``ttl_s + tick_s`` later, if Redis
still keeps its position or generation and nobody holds its lease, it takes the lease and does the
same (another holder, alive, retires it when its own discovery removes it).

Taking a lease bumps the replica's generation (fencing the previous holder) and returns the
positions applied so far: ZMQ sources resume right after them (engine replay, or ``Resync`` when the
replay buffer no longer covers the gap). A TRT-LLM drain cannot be replayed: its positions are the
last ``event_id`` applied per rank, and the new holder's decoder checks that the first event it
drains of each rank follows on; if not (the previous holder drained events and died before they
reached Redis) that rank resyncs. Unless the previous holder stopped cleanly, a rank that has blocks
in Redis but no stored ``event_id`` (written by a kvlb before 2026-11-30) is resynced first (the
engine's spec asks for this: ``EngineSpec.resync_on_unclean_takeover``).

The manager runs on the request loop with its own Redis client; the replicas' sources, queues and
writers run on the ingest thread (:class:`~balancer.fleet.space_ingest.SpaceIngest`: each start,
stop, drop and generation change is one hop there), so a flood's decoding and writing does not hold
up a tick (the threads share only the GIL), and so does not cost a lease.

Lease expiry uses the Redis server's clock (``PX``); ``now`` values here are local monotonic seconds
(health) and wall seconds (event ages), never compared with Redis time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import xxhash

from balancer.config import ReplicaConfig
from balancer.engines.registry import engine_spec
from balancer.events import Resync
from balancer.fleet.orphans import Orphans
from balancer.fleet.space_ingest import SpaceIngest
from balancer.health.book import HealthBook
from balancer.index.redis.client import REDIS_ERRORS, RedisClient
from balancer.index.redis.lease import IngestionLease, encode_positions
from balancer.index.redis.schema import RedisKeys
from balancer.log_limit import LimitedWarnings
from balancer.metrics import Metrics
from balancer.sources.base import EventSource
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

_HEARTBEAT = """
-- KEYS[1]: members ZSET; ARGV: member, ttl_ms -> live members (scored by Redis TIME, ms)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""

_HAND_OVER = """
-- KEYS: counters (the pool's slot), lease, seq; ARGV: owner, replica, positions ('' = leave)
-- -> 1 if ours
local lease_type = redis.call('TYPE', KEYS[2])['ok']
if lease_type ~= 'string' then  -- absent, or garbage written over it (deleted): not ours now
  if lease_type ~= 'none' then redis.call('DEL', KEYS[2]) end
  return 0
end
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
local seq_type = redis.call('TYPE', KEYS[3])['ok']
if seq_type ~= 'hash' and seq_type ~= 'none' then redis.call('DEL', KEYS[3]) end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[3], ARGV[2], ARGV[3]) end
return redis.call('DEL', KEYS[2])
"""

ORPHAN_ATTEMPTS = 3
"""Times a replica that left without being retired is looked at while another balancer holds its
lease, ``ttl_s + tick_s`` apart (:meth:`LeaseManager._retire_orphans`)."""

BuildSources = Callable[[ReplicaConfig, Mapping[int, int]], Sequence[EventSource]]


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    tick_s: float = 1.0
    """Period of heartbeats, renewals, take-overs and liveness checks (seconds)."""
    ttl_s: float = 5.0
    """Lease and membership lifetime without renewal (seconds): a dead holder's replicas are taken
    over between ``ttl_s`` and ``ttl_s + tick_s`` after its last renewal."""
    drain_s: float = 2.0
    """On a hand-over, queued batches get this long to reach Redis before the lease goes."""
    replica_timeout_s: float = 30.0
    """No events and failed health this long → the replica is dropped from the index fleet-wide."""


@dataclass(slots=True)
class FleetReplica:
    """One replica as the lease manager sees it."""

    config: ReplicaConfig
    keys: RedisKeys
    ingest: SpaceIngest
    """Its key space's writer and ingest, on the ingest thread: every step is one hop there."""
    lease: IngestionLease
    """Used on this (the request) loop only; the writer reads nothing of it but the owner token."""


@dataclass(slots=True)
class _Held:
    heard_at: float
    """Monotonic time the replica's sources last showed a new message (or the lease was taken)."""
    messages: int = 0
    """Messages its sources had received at ``heard_at``."""
    generation: int = 0
    """The generation its lease was taken (or taken back) with: a writer's report that it lost a
    holding of an older generation is about an earlier holding, and is ignored."""
    failing_since: float | None = None
    dropped: bool = False


class LeaseManager:
    """Takes, keeps, spreads and gives up this balancer's ingestion leases."""

    def __init__(
        self,
        client: RedisClient,
        replicas: Sequence[FleetReplica],
        *,
        members_key: str,
        instance: str,
        timing: LeaseTiming,
        health: HealthBook,
        metrics: Metrics,
        build_sources: BuildSources,
        on_redis: Callable[[BaseException | None], None] = lambda error: None,
    ) -> None:
        self.client = client
        self.replicas = {ReplicaId(r.config.id): r for r in replicas}
        self.instance = instance
        self.timing = timing
        self.members: list[str] = []
        self.held: dict[ReplicaId, _Held] = {}
        self._members_key = members_key
        self._health = health
        self._metrics = metrics
        self._warnings = LimitedWarnings(
            log,
            metrics.log_suppressed_total,
            clock=time.monotonic,
            forgotten=metrics.log_causes_forgotten_total,
        )
        self._build_sources = build_sources
        self._on_redis = on_redis
        self._lost: dict[ReplicaId, int] = {}
        """Replica → the newest generation a writer reported lost (applied at the next tick)."""
        self._quiet_until = 0.0
        """Monotonic time before which no lease is newly taken: set by a failed tick, so that after a
        Redis outage every holder first gets ``ttl_s`` to take its own expired leases back."""
        self._orphans: Orphans[tuple[FleetReplica, int]] = Orphans()
        """Replicas that left without being retired here (not held, or the retirement failed)."""
        self._lock = asyncio.Lock()
        """Held by a tick and by :meth:`remove`, so a replica never leaves in the middle of a tick."""
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._hand_over = client.register_script(_HAND_OVER)

    def lost(self, replica: ReplicaId, generation: int) -> None:
        """Called by a writer fenced out of ``replica`` while writing with ``generation``: stop its
        ingest at the next tick, unless it was taken anew since (with a newer generation). The
        report crosses from the ingest thread and may arrive after this balancer gave the replica
        up and took it again: acting on it then stopped the new holding (seen in the
        ``cluster_master_killed`` fault: a TRT-LLM replica would resync for nothing)."""
        self._lost[replica] = max(generation, self._lost.get(replica, generation))

    async def run(self, stop: asyncio.Event) -> None:
        """Tick until ``stop`` is set; Redis errors are counted and the next tick retries."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                await self.tick()
                self._on_redis(None)
                self._warnings.resolved("lease_redis_error", "")
            except REDIS_ERRORS as exc:
                self._on_redis(exc)
                self._quiet_until = time.monotonic() + self.timing.ttl_s + self.timing.tick_s
                self._metrics.redis_errors_total.labels("lease").inc()
                self._warnings.warning("lease_redis_error", "", "lease manager: redis error: %s", exc)
            wait_s = max(0.0, self.timing.tick_s - (time.monotonic() - started))  # a fixed period
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait_s)

    def add(self, replica: FleetReplica) -> None:
        """A replica found by discovery: from the next tick its lease counts in the fair share and
        may be taken. An id already known keeps its entry."""
        self._orphans.cancel(ReplicaId(replica.config.id))
        self.replicas.setdefault(ReplicaId(replica.config.id), replica)

    async def remove(self, replica: ReplicaId) -> bool:
        """A replica that left (discovery): forget it, and if this balancer holds its lease, stop its
        ingest, drop its blocks fleet-wide and delete the lease, its positions and generation. ``True``
        when the lease was ours. Redis errors are logged: the lease then expires on its own, as it is
        no longer renewed; the replica is retired later, as one this balancer did not hold."""
        async with self._lock:
            entry = self.replicas.pop(replica, None)
            self._lost.pop(replica, None)
            if entry is None:
                return False
            if self.held.pop(replica, None) is None:
                self._orphan(replica, entry)
                return False
            await entry.ingest.give_up(replica)  # sources and applier stopped, holding released
            try:
                await entry.ingest.drop(replica)
                await entry.lease.retire()  # positions and generation too: nothing resumes after the drop
            except REDIS_ERRORS as exc:
                self._metrics.redis_errors_total.labels("lease").inc()
                log.warning(
                    "replica %s left, but its lease was not released (retried later): %s", replica, exc
                )
                self._orphan(replica, entry)
                return True
            self._metrics.redis_lease_events_total.labels("released").inc()
            self._metrics.redis_leases_held.set(len(self.held))
            log.info("replica %s left: ingest stopped, blocks dropped, lease retired", replica)
            return True

    async def tick(self) -> None:
        async with self._lock:
            await self._tick()

    async def _tick(self) -> None:
        ttl_ms = max(1, round(self.timing.ttl_s * 1000))
        members = await self._heartbeat(keys=[self._members_key], args=[self.instance, ttl_ms])
        self.members = [m.decode() if isinstance(m, bytes) else str(m) for m in cast("list[Any]", members)]
        self._metrics.redis_fleet_members.set(len(self.members))
        for replica, generation in list(self._lost.items()):
            del self._lost[replica]
            held = self.held.get(replica)
            if held is None:
                continue
            if held.generation > generation:
                log.info(
                    "replica %s: ignoring a lost write of generation %d (held with %d since)",
                    replica,
                    generation,
                    held.generation,
                )
                continue
            await self._give_up(replica, graceful=False)
        await self._renew()
        await self._check_liveness()
        await self._spread()
        await self._retire_orphans()
        self._metrics.redis_leases_held.set(len(self.held))

    def _orphan(self, replica: ReplicaId, entry: FleetReplica, attempt: int = 1) -> None:
        """Retire ``replica`` later: once a dead holder's lease has expired (``ttl_s + tick_s``)."""
        due = time.monotonic() + self.timing.ttl_s + self.timing.tick_s
        forgotten = self._orphans.add(replica, (entry, attempt), due)
        if forgotten:
            self._metrics.redis_lease_events_total.labels("orphan_overflow").inc(forgotten)

    async def _retire_orphans(self) -> None:
        """Retire the replicas due that Redis still keeps a position or generation of, whose lease is
        free: take the lease (the generation bump fences any earlier writer), drop the blocks, retire
        (the pool's generation floor is raised first). A held lease is left to its holder, and looked
        at again ``ORPHAN_ATTEMPTS`` times in all (its holder may die before its discovery removes the
        replica too)."""
        if time.monotonic() < self._quiet_until:  # after an outage the holders take theirs back first
            return
        for replica, (entry, attempt) in self._orphans.take_due(time.monotonic()):
            keys = entry.keys
            pipe = self.client.pipeline(transaction=False)
            pipe.hexists(keys.applied_seq, replica)
            pipe.hexists(keys.generations, replica)
            if not any(await pipe.execute()):
                continue  # retired already (by its holder), or never leased nor dropped
            try:
                if not (await entry.lease.acquire()).acquired:
                    if attempt < ORPHAN_ATTEMPTS:  # its holder lives: its own discovery retires it
                        self._orphan(replica, entry, attempt + 1)
                    continue
                await entry.ingest.drop(replica)
                await entry.lease.retire()
            except REDIS_ERRORS:
                self._orphan(replica, entry, attempt)  # the tick fails and counts the error
                raise
            self._metrics.redis_lease_events_total.labels("orphan_retired").inc()
            log.info("replica %s left while nobody retired it: blocks dropped, lease retired", replica)

    async def _renew(self) -> None:
        """Renew every held lease at once (one round trip of time however many are held, which
        matters when Redis is slow), then take back or give up those that expired."""
        held = list(self.held)
        renewed = await asyncio.gather(*(self.replicas[replica].lease.renew() for replica in held))
        for replica, ok in zip(held, renewed, strict=True):
            if ok or await self._retake(replica):
                continue
            log.warning("lease of %s lost", replica)
            await self._give_up(replica, graceful=False)

    async def _retake(self, replica: ReplicaId) -> bool:
        """A lease that expired while Redis was unreachable (longer than ``ttl_s``) may still be free.
        Take it back and keep the running pipeline, with the events it holds, when nobody wrote the
        replica meanwhile: Redis holds exactly our last positions. The generation stays the one the
        writer uses when nobody took the lease since (until 2026-12-01 it was bumped, which refused
        the writer's own write in flight, and that write, the batches queued during the outage, was
        sent again: up to 0.7 s a replica after a Redis restart under load). Else the replica is
        given up and taken anew like any other (a TRT-LLM drain then resyncs)."""
        entry = self.replicas[replica]
        holding = await entry.ingest.holding(replica)
        if holding is None or holding.lost:
            return False
        # Kept when nobody took the lease since: the write in flight (the batches queued during
        # the outage) then lands instead of being fenced and sent again
        grant = await entry.lease.acquire(keep_generation=holding.generation)
        if not grant.acquired:
            return False
        # Compared on the ingest loop, where a write may have landed since ``holding`` was read
        if not await entry.ingest.adopt_generation(replica, grant.generation, grant.applied):
            return False  # written by another, or fenced meanwhile: given up like any lost lease
        self.held[replica].generation = grant.generation
        self._metrics.redis_lease_events_total.labels("retaken").inc()
        kept = "kept" if grant.generation == holding.generation else "new"
        log.info("lease of %s expired and taken back (generation %d, %s)", replica, grant.generation, kept)
        return True

    async def _spread(self) -> None:
        share = math.ceil(len(self.replicas) / max(1, len(self.members)))
        if len(self.held) > share:
            worst = min(self.held, key=self._preference)
            log.info("handing %s over (holding %d, fair share %d)", worst, len(self.held), share)
            await self._give_up(worst, graceful=True)
            return
        if time.monotonic() < self._quiet_until:
            return  # after Redis errors: let the holders take their expired leases back first
        for replica in sorted(self.replicas, key=self._preference, reverse=True):
            if len(self.held) >= share:
                break
            if replica not in self.held:
                await self._take(replica)

    def _preference(self, replica: ReplicaId) -> tuple[int, int]:
        """Rendezvous hashing: (how many live members rank below us for ``replica``, our score)."""

        def score(member: str) -> int:
            return xxhash.xxh3_64_intdigest(f"{member}|{replica}".encode())

        mine = score(self.instance)
        return sum(score(m) < mine for m in self.members if m != self.instance), mine

    async def _take(self, replica: ReplicaId) -> None:
        entry = self.replicas[replica]
        grant = await entry.lease.acquire()
        if not grant.acquired:
            return
        positions, applied = dict(grant.positions), grant.applied
        if grant.clean:  # from now on an unclean stop must be noticed again
            applied = encode_positions(positions, writes=grant.writes)
            await self.client.hset(entry.keys.applied_seq, replica, applied)
        resyncs: tuple[Resync, ...] = ()
        needs_resync = engine_spec(entry.config.engine).resync_on_unclean_takeover
        if needs_resync and grant.applied and not grant.clean:
            # A rank whose last applied event id is stored is checked by its decoder on the first
            # drain (a gap resyncs it then: reason "gap"); one without (written before kvlb stored
            # them) cannot be checked, so it is resynced now (reason "lease")
            ranks = {int(r) for r in await cast("Any", self.client.smembers(entry.keys.ranks(replica)))}
            unchecked = sorted(ranks - positions.keys()) if ranks or positions else [0]
            resyncs = tuple(Resync(rank, "lease") for rank in unchecked)
        sources = self._build_sources(entry.config, positions)
        await entry.ingest.take(
            replica, entry.config.engine, entry.lease, grant.generation, positions,
            writes=grant.writes, applied=applied, sources=sources, resyncs=resyncs,
        )  # fmt: skip
        self.held[replica] = _Held(time.monotonic(), self._messages(replica), generation=grant.generation)
        self._metrics.redis_lease_events_total.labels("acquired").inc()
        log.info("ingesting %s (generation %d, resuming after %s)", replica, grant.generation, positions)

    async def _give_up(self, replica: ReplicaId, *, graceful: bool) -> None:
        self.held.pop(replica, None)
        entry = self.replicas[replica]
        drain_s = self.timing.drain_s if graceful else 0.0
        drained, holding = await entry.ingest.give_up(replica, drain_s=drain_s)
        if not graceful:
            self._metrics.redis_lease_events_total.labels("lost").inc()
            return
        clean = ""
        if drained and holding is not None:
            clean = encode_positions(holding.positions, clean=True, writes=holding.writes)
        keys = [entry.keys.counters, entry.keys.lease(replica), entry.keys.applied_seq]
        await self._hand_over(keys=keys, args=[entry.lease.owner, replica, clean])
        self._metrics.redis_lease_events_total.labels("released").inc()

    async def _check_liveness(self) -> None:
        """Drop a replica that sent nothing and failed its probes for ``replica_timeout_s``. Both are
        timed on the monotonic clock: "sent nothing" means its sources' message count stood still."""
        now = time.monotonic()
        timeout_s = self.timing.replica_timeout_s
        for replica, held in list(self.held.items()):
            record = self._health.replicas.get(replica)
            if record is None or record.probe_ok:
                held.failing_since = None
            elif held.failing_since is None:
                held.failing_since = now
            messages = self._messages(replica)
            if messages != held.messages:
                held.messages, held.heard_at = messages, now
                held.dropped = False  # it talks again: it may be dropped again later
            if held.dropped:
                continue
            silent_s = now - held.heard_at
            failing_s = 0.0 if held.failing_since is None else now - held.failing_since
            if silent_s >= timeout_s and failing_s >= timeout_s:
                log.warning("replica %s: no events for %.0f s and unhealthy: dropping it", replica, silent_s)
                await self.replicas[replica].ingest.drop(replica)
                held.dropped = True
                self._metrics.redis_replicas_dropped_total.labels(replica).inc()

    def _messages(self, replica: ReplicaId) -> int:
        """Messages the replica's event sources have received so far."""
        status = self.replicas[replica].ingest.status().get(replica)
        return 0 if status is None else sum(s.messages for s in status.sources)

    async def stop(self) -> None:
        """Hand every held replica over (drained, positions marked clean) and leave the member set."""

        async def hand_over(replica: ReplicaId) -> None:
            try:
                await self._give_up(replica, graceful=True)
            except REDIS_ERRORS as exc:
                log.warning("lease of %s not handed over cleanly: %s", replica, exc)

        await asyncio.gather(*(hand_over(replica) for replica in list(self.held)))  # drains in parallel
        with contextlib.suppress(*REDIS_ERRORS):
            await self.client.zrem(self._members_key, self.instance)
