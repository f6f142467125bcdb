"""``FleetRuntime``: the Redis side of one balancer, built and owned by :mod:`balancer.app` (I/O).

Used only when ``redis.url`` is set. Per key space (one per pool and caching scheme: block size and
alignment, exactly as :class:`~balancer.routing.router.PoolRouter` splits them) it builds:

* a :class:`~balancer.index.redis.index.RedisIndex` whose Redis "pool" is the key space
  (``<model>/<block size>/<mode>``: the keys of different schemes never mix, and each has its own
  applied-event stream);
* a :class:`~balancer.fleet.writer.FencedWriter` and an :class:`~balancer.sources.pipeline.EventIngest`
  over it, which ingest only the replicas whose lease this balancer holds. These three run on the
  loop of the balancer's :class:`~balancer.sources.ingest_thread.IngestThread` with a Redis client
  of their own (``writer_client``), behind a :class:`~balancer.fleet.space_ingest.SpaceIngest`: a
  flood's decoding and the writer's planning and script calls never run on the request loop;
* a :class:`~balancer.index.redis.mirror.Mirror` that installs each table it builds into the key space the
  router reads (``KeySpace.table``). Routing reads only that table: it never waits on Redis. The
  mirror too runs on the ingest thread's loop, with a Redis client of its own (``mirror_client``),
  behind a :class:`~balancer.fleet.space_mirror.SpaceMirror`: reading, decoding and applying what
  the fleet's writers wrote never run on the request loop, which only reads the table (a
  :class:`~balancer.index.locked.LockedPrefixTable`) and adds its speculative entries to it.

A replica found by discovery after start gets the same (:meth:`FleetRuntime.add_replica`; its key
space's Redis side is built then if new); one that leaves is forgotten by the lease manager, which
drops its blocks fleet-wide and deletes its lease if this balancer held it
(:meth:`FleetRuntime.remove_replica`).

Two Redis clients stay on the request loop: ``text`` (leases, policy, drains) and ``raw`` (the snapshot
leases). What crosses between the loops: the writer's ``on_lost`` (handed to the request loop with
``call_soon_threadsafe``), its ``on_redis`` verdicts (guarded by a lock), the tables a mirror builds
(installed on the request loop with ``call_soon_threadsafe``), the mirrors' counters (plain values,
read) and the :class:`~balancer.fleet.space_ingest.SpaceIngest` and
:class:`~balancer.fleet.space_mirror.SpaceMirror` hops (a snapshot is written by one).

Around them: the :class:`~balancer.fleet.leases.LeaseManager`, the
:class:`~balancer.fleet.policy_sync.PolicySync`, the
:class:`~balancer.fleet.drain_sync.DrainSync` (replicas drained by hand) and the
:class:`~balancer.fleet.snapshots.SnapshotKeeper`. ``/readyz`` stays 503 until every mirror has
warmed up; while Redis is unreachable the balancer stays ready on its mirrors and ``/readyz`` and
``kvlb_redis_up`` show it degraded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from balancer.config import RedisConfig, ReplicaConfig
from balancer.errors import ConfigError
from balancer.fleet.drain_sync import DrainSync
from balancer.fleet.leases import FleetReplica, LeaseManager, LeaseTiming
from balancer.fleet.policy_sync import PolicySync
from balancer.fleet.redis_back import RedisBack
from balancer.fleet.redis_checks import (
    check_tls_ca_file,
    eviction_risk,
    read_policies,
    redis_trouble,
    url_database,
)
from balancer.fleet.snapshots import SnapshotKeeper
from balancer.fleet.space_ingest import SpaceIngest
from balancer.fleet.space_mirror import SpaceMirror
from balancer.fleet.writer import FencedWriter
from balancer.index.redis.client import REDIS_ERRORS, RedisClient, connect
from balancer.index.redis.index import RedisIndex
from balancer.index.redis.lease import IngestionLease, LeaseSettings
from balancer.index.redis.mirror import Mirror
from balancer.index.redis.schema import RedisIndexSettings
from balancer.index.table import PrefixTable
from balancer.log_limit import LimitedWarnings
from balancer.routing.router import KeySpace
from balancer.service.state import ServiceState
from balancer.sources.base import EventSource
from balancer.sources.build import build_sources, ingest_settings_for, poll_settings_for, zmq_settings_for
from balancer.sources.ingest_thread import IngestThread, yield_gil
from balancer.sources.pipeline import EventIngest
from balancer.tasks import cancel_all, spawn
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

_XREAD_BLOCK_S = 1.0
_EVICTION_CHECK_S = 60.0
"""How often Redis's ``maxmemory-policy`` is read (one ``INFO memory``)."""
_FAILURE_HORIZON_S = 10.0
"""How long a component's failed Redis call counts if it makes no other (twice the longest backoff,
5 s): every component retries a failure within it while the trouble lasts."""


def space_name(model: str, block_size: int, mode: str) -> str:
    """The Redis pool name of a key space (the hash tag of all its keys)."""
    return f"{model}/{block_size}/{mode}"


def instance_name(configured: str | None, worker: int | None, default: Callable[[], str]) -> str:
    """This balancer's name among the fleet's members and as the holder of its leases: the configured
    ``redis.instance_id`` (``default()`` when unset), with ``-w<index>`` appended for a worker of
    ``kvlb serve --workers N`` (``worker``; ``None`` for a single process). Every worker is a member
    of its own: they ingest their own leases. Until 2026-12-01 a configured id was taken as it was by
    every worker, which then held the same leases together (both ingesting) and counted as one."""
    name = configured or default()
    return name if worker is None else f"{name}-w{worker}"


def _default_instance() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def redis_client(config: RedisConfig, *, decode: bool, extra_timeout_s: float = 0.0) -> RedisClient:
    """A pooled client for ``config.url``: one server, or a Redis Cluster with ``config.cluster``
    (TLS and AUTH come from the URL; the CA from the config)."""
    assert config.url is not None
    return connect(
        config.url,
        cluster=config.cluster,
        decode=decode,
        socket_timeout_s=config.socket_timeout_s + extra_timeout_s,
        connect_timeout_s=config.socket_timeout_s,
        tls_ca_file=config.tls_ca_file,
    )


@dataclass(slots=True)
class _Space:
    name: str
    space: KeySpace
    index: RedisIndex
    ingest: SpaceIngest
    """The writer and ingest over ``index``, on the ingest thread."""
    mirror: SpaceMirror
    """The mirror of ``index``'s stream, on the ingest thread."""
    seen_entries: int = 0
    seen_resyncs: int = 0
    seen_skipped: int = 0
    seen_byte_trims: int = 0


class FleetRuntime:
    """Every Redis-backed part of one balancer; ``start`` after the pools, ``stop`` before them."""

    def __init__(self, state: ServiceState, *, thread: IngestThread, worker: int | None = None) -> None:
        """``thread``: where the writers and the ingest run (started by :meth:`start`; its owner
        stops it after :meth:`stop`). ``worker``: this process's index among the workers of
        ``kvlb serve --workers N`` (N > 1), else ``None`` (:func:`instance_name`)."""
        self.state = state
        self.config = state.settings.redis
        check_tls_ca_file(self.config)
        self.instance = instance_name(self.config.instance_id, worker, _default_instance)
        self.text = redis_client(self.config, decode=True)
        self.raw = redis_client(self.config, decode=False, extra_timeout_s=_XREAD_BLOCK_S)
        self.writer_client = redis_client(self.config, decode=True)
        """The writers' client: used on the ingest thread's loop only (connections open on first use)."""
        self.mirror_client = redis_client(self.config, decode=False, extra_timeout_s=_XREAD_BLOCK_S)
        """The mirrors' client (stream reads, snapshots): used on the ingest thread's loop only."""
        self.thread = thread
        self._loop: asyncio.AbstractEventLoop | None = None
        """The request loop (set by :meth:`start`): a fenced writer's news is handed over to it."""
        self.redis_back = RedisBack()
        """Wakes the writers sleeping in their error backoff when any component's Redis call works."""
        self._redis_lock = threading.Lock()
        """Guards ``_redis_results``: the writers (ingest thread) and the request loop set them."""
        self._spaces: list[_Space] = []
        self._by_space: dict[int, _Space] = {}
        """``id(KeySpace)`` → its Redis side."""
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._redis_results: dict[str, tuple[float, BaseException | None]] = {}
        """Component (``lease``, ``policy``, ``drain``, ``writer <space>``) → when its last Redis call
        ended and its error (``None``: it worked); what ``redis_down`` and ``degraded`` read."""
        self._eviction_risk: str | None = None
        """Why Redis may evict kvlb's keys (its ``maxmemory-policy``), or ``None``."""
        self._eviction_checked_at = 0.0
        self._warnings = LimitedWarnings(
            log,
            state.metrics.log_suppressed_total,
            clock=time.monotonic,
            forgotten=state.metrics.log_causes_forgotten_total,
        )
        self.leases: LeaseManager | None = None
        self.policy: PolicySync | None = None
        self.drains: DrainSync | None = None
        self.snapshots: SnapshotKeeper | None = None
        self._seen_repairs = 0
        state.metrics.parent_hints_dropped.source = lambda: {
            entry.name: entry.index.hints_dropped for entry in self._spaces
        }

    # ------------------------------------------------------------------ building

    def _build(self) -> list[FleetReplica]:
        replicas: list[FleetReplica] = []
        for pool in self.state.pools.values():
            for (block_size, mode), space in pool.router.spaces.items():
                self._space_entry(pool.model, block_size, mode, space)
            for replica in pool.replicas.values():
                replicas.append(self._fleet_replica(replica, pool.router.space_of[ReplicaId(replica.id)]))
        return replicas

    def _space_entry(self, model: str, block_size: int, mode: str, space: KeySpace) -> _Space:
        """The Redis side of one key space (index, writer, ingest, mirror), built once."""
        entry = self._by_space.get(id(space))
        if entry is not None:
            return entry
        state, config = self.state, self.config
        name = space_name(model, block_size, mode)
        try:
            settings = RedisIndexSettings(
                pool=name,
                key_prefix=config.key_prefix,
                capacity_blocks=space.table.limits.capacity_blocks,
                stream_maxlen=config.stream_maxlen,
                stream_max_bytes=config.stream_max_bytes,
            )
        except ValueError as exc:
            raise ConfigError(f"pool {model!r}: {exc}") from None
        index = RedisIndex(self.writer_client, space.hasher, settings)
        writer = FencedWriter(
            index,
            metrics=state.metrics,
            on_lost=self._lost_threadsafe,
            on_redis=self._redis_reporter(f"writer {name}"),
            redis_back=self.redis_back,
        )
        ingest_settings = ingest_settings_for(state.settings.limits)
        ingest = SpaceIngest(
            self.thread, writer, EventIngest(writer, metrics=state.metrics, settings=ingest_settings)
        )
        mirror = Mirror(
            self.mirror_client, space.hasher, settings, state.monotonic,
            # the mirror follows the Redis index, which clears a rank at every gap: no gap hold
            limits=dataclasses.replace(space.table.limits, gap_hold_s=0.0),
            suppressed=state.metrics.log_suppressed_total, between_entries=yield_gil,
            forgotten=state.metrics.log_causes_forgotten_total,
        )  # fmt: skip
        entry = _Space(name, space, index, ingest, SpaceMirror(self.thread, mirror, _installer(space), name))
        self._spaces.append(entry)
        self._by_space[id(space)] = entry
        state.ingests.append(ingest)
        return entry

    def _fleet_replica(self, replica: ReplicaConfig, space: KeySpace) -> FleetReplica:
        entry = self._by_space[id(space)]
        keys = entry.index.keys
        lease = IngestionLease(self.text, keys, ReplicaId(replica.id), self.instance, self._lease_settings())
        return FleetReplica(replica, keys, entry.ingest, lease)

    async def _start_space(self, entry: _Space) -> None:
        assert self.snapshots is not None
        self.snapshots.add(entry.mirror, entry.index.keys)
        await entry.ingest.start()
        await entry.mirror.start()

    def _lease_settings(self) -> LeaseSettings:
        return LeaseSettings(ttl_s=self.config.lease_ttl_s, renew_every_s=self.config.tick_s)

    def _sources(self, replica: ReplicaConfig, resume: Mapping[int, int]) -> Sequence[EventSource]:
        if not self.state.kv_events(ReplicaId(replica.id)):
            return []  # pools[].kv_events: false: routing decisions and receipts only
        assert self.thread.zmq is not None and self.thread.session is not None
        return build_sources(  # the ingest thread's ZMQ context and session: its loop runs them
            replica,
            zmq_ctx=self.thread.zmq,
            session=self.thread.session,
            metrics=self.state.metrics,
            zmq_settings=zmq_settings_for(self.state.settings.limits),
            poll_settings=poll_settings_for(self.state.settings.limits),
            resume=resume,
        )

    async def start(self) -> None:
        """Build every part and start the tasks (mirrors warm up in the background)."""
        state, config = self.state, self.config
        self._loop = asyncio.get_running_loop()
        await self.thread.start()
        replicas = self._build()
        self.leases = LeaseManager(
            self.text,
            replicas,
            members_key=f"{config.key_prefix}:members",
            instance=self.instance,
            timing=LeaseTiming(
                tick_s=config.tick_s, ttl_s=config.lease_ttl_s, replica_timeout_s=config.replica_timeout_s
            ),
            health=state.health,
            metrics=state.metrics,
            build_sources=self._sources,
            on_redis=self._redis_reporter("lease"),
        )
        self.policy = PolicySync(
            self.text,
            state.policy,
            key_prefix=config.key_prefix,
            poll_s=config.policy_poll_s,
            metrics=state.metrics,
            on_redis=self._redis_reporter("policy"),
            audit=state.audit,
        )
        self.drains = DrainSync(
            self.text,
            state.health,
            key_prefix=config.key_prefix,
            poll_s=config.policy_poll_s,
            metrics=state.metrics,
            on_redis=self._redis_reporter("drain"),
            wall_clock=state.wall_clock,
        )
        state.drain_committer = self.drains.commit
        state.fleet_kept_drains = self.drains.kept_listing
        self.snapshots = SnapshotKeeper(
            self.raw,
            owner=self.instance,
            interval_s=config.snapshot_interval_s,
            every_entries=config.stream_maxlen // 4,
            every_bytes=config.stream_max_bytes // 4,
            ttl_s=config.lease_ttl_s,
            metrics=state.metrics,
        )
        for entry in self._spaces:
            await self._start_space(entry)
        self._spawn(self.leases.run(self._stop), "kvlb-leases")
        self._spawn(self.policy.run(self._stop), "kvlb-policy-sync")
        self._spawn(self.drains.run(self._stop), "kvlb-drain-sync")
        self._spawn(self._housekeeping(), "kvlb-fleet-housekeeping")
        state.readiness_checks.append(self.not_ready)
        state.degraded_checks.append(self.degraded)
        state.fleet_status = self.status
        log.info("fleet member %s: %d key space(s) on Redis", self.instance, len(self._spaces))

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(spawn(coro, name))

    # ------------------------------------------------------------------ discovered replicas

    async def add_replica(self, model: str, replica: ReplicaConfig) -> None:
        """A replica found after start (already in the pool's router): its key space's Redis side is
        built and started if new, and the lease manager may take its lease from the next tick."""
        assert self.leases is not None
        pool = self.state.pools[model]
        space = pool.router.space_of[ReplicaId(replica.id)]
        block_size, mode = next(k for k, v in pool.router.spaces.items() if v is space)
        if id(space) not in self._by_space:
            await self._start_space(self._space_entry(model, block_size, mode, space))
        self.leases.add(self._fleet_replica(replica, space))

    def engine_gone(self, replica: ReplicaId, why: str) -> None:
        """``replica``'s health probe found nothing listening at its engine: the sources of this
        balancer's holding, if any, stop waiting on it (a signal to the ingest thread, at once)."""
        for entry in self._spaces:
            entry.ingest.engine_gone(replica, why)

    def engine_back(self, replica: ReplicaId) -> None:
        """``replica``'s health probe passes again after :meth:`engine_gone`."""
        for entry in self._spaces:
            entry.ingest.engine_back(replica)

    async def remove_replica(self, replica: ReplicaId) -> bool:
        """A replica that left: if this balancer ingests it, its ingest stops, its blocks are dropped
        fleet-wide, its lease, position and generation deleted. ``True`` when it held the lease."""
        assert self.leases is not None
        return await self.leases.remove(replica)

    # ------------------------------------------------------------------ running

    def _lost(self, replica: ReplicaId, generation: int) -> None:
        if self.leases is not None:
            self.leases.lost(replica, generation)

    def _lost_threadsafe(self, replica: ReplicaId, generation: int) -> None:
        """A writer (on the ingest thread) was fenced out of ``replica`` while writing with
        ``generation``: tell the lease manager, on the request loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._lost, replica, generation)

    def _redis_reporter(self, component: str) -> Callable[[BaseException | None], None]:
        """The ``on_redis`` of one component: how each of its Redis calls went (``None``: it worked);
        called on both loops (the writers' on the ingest thread). Each component keeps its own last
        result: until 2026-12-01 one shared "last call wins" verdict let the reads that worked (a
        Redis out of memory or read-only refuses writes only) clear the failures of the writes, so
        ``/readyz`` and ``kvlb_redis_up`` showed the trouble a quarter of the time. A call that
        worked also wakes the writers sleeping in their backoff (:mod:`balancer.fleet.redis_back`)."""

        def report(error: BaseException | None) -> None:
            with self._redis_lock:
                self._redis_results[component] = (time.monotonic(), error)
            if error is None:
                self.redis_back.succeeded()

        return report

    def _redis_failure(self) -> BaseException | None:
        """The latest failure among the components whose last call failed within
        ``_FAILURE_HORIZON_S`` (a writer that stopped writing, its lease gone, does not stay failed)."""
        now = time.monotonic()
        with self._redis_lock:
            failing = [
                (at, error)
                for at, error in self._redis_results.values()
                if error is not None and now - at < _FAILURE_HORIZON_S
            ]
        return max(failing, key=lambda result: result[0])[1] if failing else None

    async def _check_eviction(self) -> None:
        """Read Redis's ``maxmemory-policy`` (every ``_EVICTION_CHECK_S``); log a change of verdict."""
        now = time.monotonic()
        if now < self._eviction_checked_at + _EVICTION_CHECK_S and self._eviction_checked_at:
            return
        self._eviction_checked_at = now
        try:
            risk = eviction_risk(await read_policies(self.text))
        except REDIS_ERRORS:  # unreachable (said elsewhere), or INFO not granted: keep the last verdict
            return
        if risk != self._eviction_risk:
            if risk is not None:
                log.warning('%s (docs/operations.md, "Redis down")', risk)
            else:
                log.info("redis maxmemory-policy is noeviction again")
        self._eviction_risk = risk

    async def _housekeeping(self) -> None:
        """Every tick: write due snapshots and refresh the ``kvlb_redis_*`` gauges; every minute, check
        that Redis does not evict keys (:mod:`balancer.fleet.redis_checks`)."""
        assert self.snapshots is not None
        while not self._stop.is_set():
            self.refresh_metrics()  # before the snapshot, which may take a while: set at start
            await self._check_eviction()
            try:
                await self.snapshots.tick()
            except Exception as exc:  # a failed snapshot must not end the loop
                self.state.metrics.redis_errors_total.labels("snapshot").inc()
                self._warnings.warning("snapshot_failed", "", "snapshot: %s", exc)  # every tick_s: limited
            else:
                self._warnings.resolved("snapshot_failed", "")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.config.tick_s)

    def refresh_metrics(self) -> None:
        metrics = self.state.metrics
        metrics.set_redis_up(not self.redis_down())
        repairs = sum(e.index.repaired_keys for e in self._spaces)
        if self.leases is not None:
            repairs += sum(r.lease.repaired_keys for r in self.leases.replicas.values())
        if repairs > self._seen_repairs:
            new = repairs - self._seen_repairs
            metrics.redis_wrongtype_keys_total.inc(new)
            log.warning("redis: %d wrong-typed keys of ours deleted and repaired", new)
        self._seen_repairs = repairs
        for entry in self._spaces:
            mirror, counters = entry.mirror, entry.mirror.counters
            if mirror.lag_s is not None:
                metrics.redis_mirror_lag_seconds.labels(entry.name).set(mirror.lag_s)
            metrics.redis_mirror_entries_total.labels(entry.name).inc(
                counters.entries_applied - entry.seen_entries
            )
            metrics.redis_mirror_resyncs_total.labels(entry.name).inc(counters.resyncs - entry.seen_resyncs)
            entry.seen_entries, entry.seen_resyncs = counters.entries_applied, counters.resyncs
            skipped = metrics.redis_mirror_skipped_entries_total.labels(entry.name)
            skipped.inc(counters.decode_errors - entry.seen_skipped)
            entry.seen_skipped = counters.decode_errors
            trims = entry.index.stream_byte_trims
            metrics.redis_stream_byte_trimmed_entries_total.labels(entry.name).inc(
                trims - entry.seen_byte_trims
            )
            entry.seen_byte_trims = trims
            metrics.redis_mirror_partial.labels(entry.name).set(1 if mirror.partial else 0)

    def redis_down(self) -> bool:
        mirrors_down = any(not e.mirror.connected and e.mirror.counters.redis_errors for e in self._spaces)
        return mirrors_down or self._redis_failure() is not None

    def not_ready(self) -> list[str]:
        return [f"mirror of {e.name} not warm yet" for e in self._spaces if not e.mirror.ready.is_set()]

    def degraded(self) -> list[str]:
        reasons = []
        if self.redis_down():
            error = self._redis_failure()
            trouble = redis_trouble(error, url_database(self.config.url or ""))
            reasons.append(f"{trouble}: routing on the local mirrors, ingesters buffering")
        if self._eviction_risk is not None:
            reasons.append(self._eviction_risk)
        reasons += [
            f"mirror of {e.name} is partial (stream trimmed)" for e in self._spaces if e.mirror.partial
        ]
        return reasons

    def status(self) -> dict[str, Any]:
        """For ``/admin/fleet``-style views and tests."""
        return {
            "instance": self.instance,
            "members": [] if self.leases is None else list(self.leases.members),
            "leases": [] if self.leases is None else sorted(self.leases.held),
            "redis_up": not self.redis_down(),
            "writer_threads": {e.name: e.ingest.writer.thread for e in self._spaces},
            "mirror_threads": {e.name: e.mirror.mirror.thread for e in self._spaces},
            "mirrors": {
                e.name: {
                    "ready": e.mirror.ready.is_set(),
                    "entry": e.mirror.last_number,
                    "partial": e.mirror.partial,
                    "lag_s": e.mirror.lag_s,
                    "resyncs": e.mirror.counters.resyncs,
                    "snapshots_loaded": e.mirror.counters.snapshots_loaded,
                }
                for e in self._spaces
            },
        }

    # ------------------------------------------------------------------ stopping

    async def stop(self) -> None:
        """Hand the leases over (drained, clean), stop every task, close ingest and connections."""
        self._stop.set()
        for task in self._tasks:
            if task.get_name() == "kvlb-leases":  # no take-over may race the hand-over below
                await cancel_all([task])
        if self.leases is not None:
            try:
                async with asyncio.timeout(self.config.lease_ttl_s):
                    await self.leases.stop()
            except TimeoutError:
                log.warning("lease hand-over timed out; the leases will expire")
        if self.snapshots is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.snapshots.release(), self.config.socket_timeout_s)
        tasks, self._tasks = self._tasks, []
        await cancel_all(tasks)
        if self.thread.loop is not None:  # the thread's clients close on the loop that used them
            for entry in self._spaces:
                await entry.mirror.aclose()
                await entry.ingest.aclose()
            await self.thread.call(self.writer_client.aclose)
            await self.thread.call(self.mirror_client.aclose)
        if self.policy is not None:
            await self.policy.aclose()
        if self.drains is not None and self.state.drain_committer == self.drains.commit:
            self.state.drain_committer = None
        if self.drains is not None and self.state.fleet_kept_drains == self.drains.kept_listing:
            self.state.fleet_kept_drains = None
        await self.text.aclose()
        await self.raw.aclose()


def _installer(space: KeySpace) -> Callable[[PrefixTable], None]:
    def install(table: PrefixTable) -> None:
        space.table = table

    return install
