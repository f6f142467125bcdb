"""What starts and stops with each replica, static or discovered (I/O: tasks, sockets, Redis).

Built and owned by :mod:`balancer.app`. Per replica it runs a load scraper (when
``scrape_interval_s`` > 0) and a health prober, and feeds the replica's KV events into the index:
without Redis through one :class:`~balancer.sources.pipeline.EventIngest` per key space (kept here),
with Redis through the :class:`~balancer.fleet.runtime.FleetRuntime`, whose lease manager decides
which balancer ingests it. Both run on this class's
:class:`~balancer.sources.ingest_thread.IngestThread` (its own loop, ZMQ context and HTTP session):
the embedded ingests, or the fleet's sources, queues and Redis writers, so decoding and applying
events never takes the request loop's time.

:meth:`ReplicaLifecycle.apply` is the discovery hook (:mod:`balancer.discovery`):

* :class:`~balancer.discovery.ReplicaAdded`: the replica joins its pool's router (its key space is
  created if new), its event sources (or its fleet lease), health record, scraper and prober start,
  and last it joins ``pool.replicas``: it is routable once its first probe succeeds. A pool that is
  not declared in ``pools``, or an id a static replica already uses, is logged and ignored.
* :class:`~balancer.discovery.ReplicaRemoved`: it leaves ``pool.replicas`` and the health book at
  once (no new request goes there; requests in flight finish), then its tasks are cancelled, its
  sources stop and its blocks leave the index (fleet mode: if this balancer holds its lease, the
  blocks are dropped fleet-wide, its lease, position and generation deleted), and the router forgets it
  and its load.

Discovery only removes the replicas it added. Every event is applied in full before the next.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

import aiohttp
import zmq.asyncio

from balancer.config import ReplicaConfig
from balancer.discovery import Discovery, DiscoveryEvent, ReplicaAdded
from balancer.engines.registry import engine_spec
from balancer.health.book import kept_text
from balancer.health.prober import EngineWatch, HealthProber, ProbeSettings
from balancer.index.memory import MemoryIndex
from balancer.load.scraper import MetricsScraper, ScrapeSettings
from balancer.routing.router import KeySpace
from balancer.service.state import Pool, ServiceState
from balancer.sources.base import EventSource
from balancer.sources.build import (
    RelayRole,
    build_sources,
    ingest_settings_for,
    poll_settings_for,
    zmq_settings_for,
)
from balancer.sources.ingest_thread import IngestThread, ThreadedIngest
from balancer.sources.pipeline import EventIngest
from balancer.tasks import cancel_all, spawn
from balancer.types import ReplicaId

if TYPE_CHECKING:  # fleet mode only: a start without Redis does not import its client
    from balancer.fleet.runtime import FleetRuntime

log = logging.getLogger(__name__)


class ReplicaLifecycle:
    """Per-replica tasks and event ingest of one balancer, and the discovery that changes them."""

    def __init__(
        self,
        state: ServiceState,
        *,
        zmq_ctx: zmq.asyncio.Context,
        session: aiohttp.ClientSession,
        relay: RelayRole | None = None,
    ) -> None:
        """``relay``: this is one worker of ``kvlb serve --workers N`` (TRT-LLM drained by one)."""
        self.state = state
        self._relay = relay
        self.fleet: FleetRuntime | None = None
        """Set by the app in Redis mode: leases, not this class, decide who ingests a replica."""
        self.ingests: dict[int, ThreadedIngest] = {}
        """``id(KeySpace)`` → the ingest writing its table (embedded mode only)."""
        self.thread = IngestThread()
        """Where event ingestion runs: the embedded ingests (started with the first one), or in fleet
        mode the fleet's writers and ingests (started by the fleet runtime); stopped last."""
        self.discovered: dict[ReplicaId, str] = {}
        """Replicas added by discovery → their pool's model."""
        self.discovery: Discovery | None = None
        self._zmq = zmq_ctx
        self._session = session
        self._ingest_running = False
        self._tasks: dict[ReplicaId, list[asyncio.Task[None]]] = {}
        self._discovery_task: asyncio.Task[None] | None = None
        settings = state.settings
        interval_s = settings.scrape_interval_s
        self._scrape = (
            None
            if interval_s <= 0
            else ScrapeSettings(interval_s=interval_s, timeout_s=max(1.0, min(interval_s, 5.0)))
        )
        self._probe = ProbeSettings(
            interval_s=settings.health_interval_s,
            timeout_s=max(1.0, settings.timeouts.connect_s),
            models_recheck_s=settings.health_models_recheck_s,
        )
        self._ingest_settings = ingest_settings_for(settings.limits)

    # ------------------------------------------------------------------ static replicas

    async def start_static(self) -> None:
        """Ingest (embedded mode), scrapers and probers of every ``pools[].replicas`` entry."""
        if self.fleet is None:
            await self.thread.start()
            for pool in self.state.pools.values():
                for replica_id, config in pool.replicas.items():
                    await self._add_sources(config, pool.router.space_of[replica_id])
            self._ingest_running = True
            for ingest in self.ingests.values():
                await ingest.start()
        for pool in self.state.pools.values():
            for config in pool.replicas.values():
                self._start_tasks(pool, config)

    # ------------------------------------------------------------------ discovery

    def start_discovery(self, discovery: Discovery) -> None:
        """Run ``discovery`` in a task of its own, applying each change with :meth:`apply`."""
        self.discovery = discovery
        self._discovery_task = spawn(discovery.run(self.apply), "kvlb-discovery")

    async def stop_discovery(self) -> None:
        task, self._discovery_task = self._discovery_task, None
        if task is not None:
            await cancel_all([task])

    async def apply(self, event: DiscoveryEvent) -> None:
        """The discovery hook: apply one change (an update arrives as a removal, then an addition)."""
        if isinstance(event, ReplicaAdded):
            await self.add(event.pool_model, event.replica)
        else:
            await self.remove(event.replica_id)

    async def add(self, model: str, config: ReplicaConfig) -> bool:
        """Start routing to a discovered replica; ``False`` when it is ignored (logged)."""
        state = self.state
        replica = ReplicaId(config.id)
        pool = state.pools.get(model)
        if pool is None:
            log.warning("discovered replica %s serves %r, which is not in pools: ignored", replica, model)
            return False
        if replica in self.discovered:  # a change the discovery did not announce as a removal
            await self.remove(replica)
        owner = next((p.model for p in state.pools.values() if replica in p.router.space_of), None)
        if owner is not None:
            log.warning("discovered replica %s: id already used in pool %r: ignored", replica, owner)
            return False
        if config.api_key is None and pool.api_key is not None:  # the pool's default key
            config = dataclasses.replace(config, api_key=pool.api_key)
        spec = engine_spec(config.engine)
        space = pool.router.add_replica(replica, config.block_size, spec.alignment(), spec.block_hashes)
        self.discovered[replica] = model
        try:
            if self.fleet is not None:
                await self.fleet.add_replica(model, config)
            else:
                ingest = await self._add_sources(config, space)
                if self._ingest_running:
                    await ingest.start()  # a new key space's ingest; idempotent otherwise
            kept = state.health.add(replica, now=state.monotonic())  # a kept drain applies
            if kept is not None:
                log.info("replica %s added again: %s", replica, kept_text(kept.note, kept.removed_at_wall_ts))
            self._start_tasks(pool, config)
            pool.replicas[replica] = config
        except Exception:
            self.discovered.pop(replica, None)
            await self._tear_down(pool, replica)
            raise
        log.info("replica %s (%s, %s) added to pool %r", replica, config.engine, config.url, model)
        return True

    async def remove(self, replica: ReplicaId) -> bool:
        """Stop routing to a discovered replica and forget it; ``False`` if discovery did not add it."""
        model = self.discovered.pop(replica, None)
        if model is None:
            return False
        pool = self.state.pools[model]
        state = self.state
        drained = (rec := state.health.replicas.get(replica)) is not None and rec.draining
        dropped = state.health.kept_drains_dropped
        kept = state.health.remove(replica, state.monotonic(), state.wall_clock())
        state.metrics.replica_kept_drains_dropped_total.inc(state.health.kept_drains_dropped - dropped)
        await self._tear_down(pool, replica)
        log.info("replica %s removed from pool %r", replica, model)
        if kept is not None:
            log.info(
                "replica %s removed while drained: its drain is kept for %.0f s",
                replica,
                state.health.drain_keep_s,
            )
        if drained and self.fleet is not None and self.fleet.drains is not None:
            await self.fleet.drains.mark_removed(replica)
        return True

    async def _tear_down(self, pool: Pool, replica: ReplicaId) -> None:
        """Undo whatever :meth:`add` did for ``replica`` (each step is a no-op if it was not done).

        Routing stops first (its health record goes, so the router never picks it again); the replica
        leaves ``pool.replicas``, and so ``/admin/replicas``, last, once its blocks have left the index."""
        state = self.state
        state.health.remove(replica)
        await cancel_all(self._tasks.pop(replica, []))
        state.scrapers.pop(replica, None)
        space = pool.router.space_of.get(replica)
        if self.fleet is not None:
            await self.fleet.remove_replica(replica)
        elif space is not None and (ingest := self.ingests.get(id(space))) is not None:
            await ingest.remove_replica(replica)  # its blocks leave the table
        pool.router.remove_replica(replica)
        pool.replicas.pop(replica, None)
        state.metrics.forget_replica(replica)  # its series leave /metrics (bounded with churn)

    # ------------------------------------------------------------------ per replica

    async def _add_sources(self, config: ReplicaConfig, space: KeySpace) -> ThreadedIngest:
        """Register the replica's event sources with its key space's ingest (built on first use),
        on the ingest thread with its ZMQ context and session."""
        thread = self.thread
        await thread.start()
        ingest = self.ingests.get(id(space))
        if ingest is None:
            index = MemoryIndex.over(space.table)
            ingest = ThreadedIngest(
                thread, EventIngest(index, metrics=self.state.metrics, settings=self._ingest_settings)
            )
            self.ingests[id(space)] = ingest
            self.state.ingests.append(ingest)
        sources: list[EventSource] = []  # pools[].kv_events: false: routing decisions and receipts only
        if self.state.kv_events(ReplicaId(config.id)):
            assert thread.zmq is not None and thread.session is not None
            sources = build_sources(
                config,
                zmq_ctx=thread.zmq,
                session=thread.session,
                metrics=self.state.metrics,
                zmq_settings=zmq_settings_for(self.state.settings.limits),
                poll_settings=poll_settings_for(self.state.settings.limits),
                relay=self._relay,
            )
        await ingest.add_replica(ReplicaId(config.id), config.engine, sources)
        return ingest

    def _start_tasks(self, pool: Pool, config: ReplicaConfig) -> None:
        replica = ReplicaId(config.id)
        tasks = self._tasks.setdefault(replica, [])
        replays = engine_spec(config.engine).transport == "zmq"
        self.state.metrics.init_replica(replica, config.engine, replays=replays, events=pool.kv_events)
        if self._scrape is not None:
            scraper = MetricsScraper(
                replica,
                config.url,
                config.engine,
                engine_spec(config.engine).scrape_targets,
                session=self._session,
                observe=pool.router.tracker().observe,
                metrics=self.state.metrics,
                settings=self._scrape,
                metrics_path=config.metrics_path,
                api_key=config.api_key,
            )
            self.state.scrapers[replica] = scraper
            tasks.append(spawn(scraper.run(), f"kvlb-scrape-{replica}"))
        prober = HealthProber(
            replica,
            config.url,
            session=self._session,
            health=self.state.health,
            settings=self._probe,
            model=pool.model if engine_spec(config.engine).checks_model_name else None,
            api_key=config.api_key,
            key_check=True,
            engine_watch=self._engine_watch(pool, replica),
        )
        tasks.append(spawn(prober.run(), f"kvlb-probe-{replica}"))

    def _engine_watch(self, pool: Pool, replica: ReplicaId) -> EngineWatch | None:
        """Who hears from ``replica``'s prober that its engine is gone or back: the sources of the
        ingest that holds it (the fleet runtime's, or its key space's embedded ingest)."""
        if self.fleet is not None:
            return self.fleet
        space = pool.router.space_of.get(replica)
        return None if space is None else self.ingests.get(id(space))

    # ------------------------------------------------------------------ shutdown

    async def cancel_tasks(self) -> None:
        """Cancel every scraper and prober (discovery first, so none is started meanwhile)."""
        await self.stop_discovery()
        tasks, self._tasks = self._tasks, {}
        await cancel_all([task for group in tasks.values() for task in group])

    async def close_ingest(self) -> None:
        """Close the embedded-mode ingests, newest first (the fleet closes its own), then their
        thread."""
        self._ingest_running = False
        ingests, self.ingests = list(self.ingests.values()), {}
        for ingest in reversed(ingests):
            await ingest.aclose()
        await self.thread.stop()
