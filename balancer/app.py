"""Composition root (I/O): builds every component from :class:`Settings`, owns every task, and shuts
down in order.

Start order: tokenizers (in a thread) → pools (routers, key spaces, health records) → event ingest
per key space (sources and appliers; the fleet runtime with Redis) → load scrapers and health
probers → discovery (``discovery.kind`` file or kubernetes) → HTTP server → gRPC server (when
``listen.grpc_port`` is set). Everything per replica, and the discovery that adds and removes
replicas at run time, lives in :mod:`balancer.service.lifecycle`. ``stop`` undoes it in reverse:
stop accepting (HTTP and gRPC together) and let in-flight requests finish within
``shutdown_grace_s`` (then cancel them: HTTP through :mod:`balancer.api.inflight`), cancel
discovery, probers and scrapers, stop the fleet, close event ingest, close HTTP sessions and the ZMQ
context. Nothing here is global: a test builds as many :class:`Balancer` s as it likes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import random
import socket
import time
from collections.abc import Coroutine, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import aiohttp
import zmq.asyncio
from aiohttp import web
from prometheus_client import CollectorRegistry

from balancer.api.gathered import grpc_replicas, grpc_whatif
from balancer.api.http import build_web_app
from balancer.api.inflight import InflightRequests
from balancer.api.siblings import Siblings, catch_up, grpc_fan_out, sibling_middleware
from balancer.config import PoolConfig, Settings
from balancer.discovery import Discovery, build_discovery
from balancer.engines.registry import engine_spec
from balancer.errors import ConfigError, bind_error
from balancer.health.book import BreakerConfig, HealthBook
from balancer.index.locked import LockedPrefixTable
from balancer.index.slots import TableLimits
from balancer.load.share import LoadShare
from balancer.load.tracker import LoadConfig
from balancer.metrics import Metrics
from balancer.policy import PolicyWeights
from balancer.routing.router import PoolRouter, RouteLimits
from balancer.serve_options import ServeOptions
from balancer.service.admission import Admission, AdmissionLimits
from balancer.service.audit import AuditLog
from balancer.service.decisions import DecisionLog, DecisionRing
from balancer.service.lifecycle import ReplicaLifecycle
from balancer.service.policy_control import PolicyControl
from balancer.service.series import SeriesSampler
from balancer.service.server_log import server_logger
from balancer.service.spec_share import SpeculationShare
from balancer.service.state import Pool, ServiceState
from balancer.service.tenant_rate import SharedRates, TenantRates, burst_per_worker, per_worker
from balancer.service.tls import server_ssl_context
from balancer.service.tokenizer_gate import TokenizerGate
from balancer.sources.build import RelayRole
from balancer.tasks import cancel_all, spawn
from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.token_ids import TokenIdMemo
from balancer.tokenizer.tokenizer import (
    HfTokenizer,
    TokenIdTokenizer,
    TokenizeLimits,
    Tokenizer,
    load_tokenizer,
)
from balancer.types import ReplicaId
from balancer.upstream.client import UpstreamClient
from balancer.upstream.keys import KeyWatcher
from balancer.worker_record import crash_loop_reasons, read_record

if TYPE_CHECKING:  # imported where configured (fleet mode, a gRPC port): a start without them skips
    # the Redis client and gRPC (tests/unit/test_lazy_imports.py)
    from balancer.api.grpc.server import GrpcServer
    from balancer.fleet.runtime import FleetRuntime

log = logging.getLogger(__name__)

STALE_SCRAPES = 3
"""Scraped engine stats count as fresh for this many scrape periods (at least 5 s)."""


def load_pool_tokenizer(path: str | None, limits: TokenizeLimits) -> Tokenizer:
    """A pool's tokenizer; ``None`` is DeepSeek-V3 (token-id prompts only if its package is missing).
    Blocking: call in a thread."""
    if path is not None:
        return load_tokenizer(path, limits=limits)
    try:
        return default_tokenizer(limits)
    except ConfigError as exc:
        log.warning("%s; only token-id prompts can be routed", exc)
        return TokenIdTokenizer(limits)


HTTP_STOP_BACKSTOP_S = 2.0
"""Seconds past ``shutdown_grace_s`` before aiohttp's own shutdown wait would end (it never should:
the requests left are cancelled at the grace and end at once)."""


class Balancer:
    """The whole service: ``async with Balancer(settings) as b:`` serves on ``b.url``."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry | None = None,
        tokenizers: Mapping[str, Tokenizer] | None = None,
        options: ServeOptions | None = None,
        discovery: Discovery | None = None,
    ) -> None:
        """``tokenizers`` maps a model to a ready tokenizer (tests share one instead of loading);
        ``discovery`` replaces the one ``settings.discovery`` describes."""
        self.settings = settings
        self.options = options or ServeOptions()
        self.metrics = Metrics.create(
            registry, ttft_slo_s=settings.slo.ttft_s, ttft_target_ratio=settings.slo.ttft_target_ratio
        )
        if self.options.worker is not None:  # the supervisor's count of this worker's restarts
            self.metrics.process_restarts_total.inc(self.options.worker.restarts)
        self._given_tokenizers = dict(tokenizers or {})
        self.state: ServiceState | None = None
        self.url = ""
        self._zmq: zmq.asyncio.Context | None = None
        self._control: aiohttp.ClientSession | None = None
        self._upstream = UpstreamClient(settings.timeouts, settings.upstream)
        self.metrics.upstream_connections.source = lambda: self._upstream.counters
        self._discovery = discovery
        self.replicas: ReplicaLifecycle | None = None
        """Per-replica tasks and ingest, and the discovery (built at start)."""
        self.fleet: FleetRuntime | None = None
        """The Redis side (leases, mirrors, shared policy) when ``redis.url`` is set."""
        self._runner: web.AppRunner | None = None
        self._inflight = InflightRequests()
        """The HTTP requests being handled: the ones left at the end of the grace are cancelled."""
        self._grpc: GrpcServer | None = None
        self._siblings: Siblings | None = None
        self._speculation: SpeculationShare | None = None
        self._load_share: LoadShare | None = None
        self._speculation_task: concurrent.futures.Future[None] | None = None
        self.grpc_port: int | None = None
        """The bound gRPC port once started (``None``: gRPC disabled)."""
        self.key_watcher = KeyWatcher.for_settings(settings, self.metrics)
        """Re-reads rotated engine key files (``None``: no ``api_key_file`` in the config)."""
        self._key_watch: asyncio.Task[None] | None = None

    def _key_rotated(self, path: str) -> None:
        """A new engine key from ``path`` is in use: the replicas reading it whose breaker is open
        (the old key's refusals, most likely) get their trial at once instead of after
        ``open_s``; one that still fails opens it again."""
        state = self.state
        if state is None:
            return
        now = state.monotonic()
        for pool in state.pools.values():
            for replica, config in pool.replicas.items():
                reads_it = config.api_key is not None and config.api_key.file == path
                if reads_it and state.health.trial_now(replica, now):
                    log.info("replica %s: its breaker tries again at once (new engine key)", replica)

    async def start(self) -> None:
        """Build and start everything; on failure, undo what was started and re-raise."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    def _tenant_rates(self) -> TenantRates | None:
        """The buckets of ``limits.tenant_rate_per_s`` (``None``: off); with ``--workers N`` the
        whole rates and bursts, the buckets' times shared through the load table
        (:meth:`_share_load`), or, without the table, this worker's 1/N of them."""
        limits = self.settings.limits
        if not limits.tenant_rate_per_s:
            return None
        worker = self.options.worker
        workers = 1 if worker is None or worker.load_table is not None else worker.count
        burst = limits.tenant_burst or max(1, math.ceil(limits.tenant_rate_per_s))
        new_rate = limits.tenant_rate_new_per_s or limits.tenant_rate_per_s
        rates = TenantRates(
            per_worker(limits.tenant_rate_per_s, workers),
            burst_per_worker(burst, workers),
            limits.tenant_rate_tenants,
            per_worker(new_rate, workers),
            on_evict=self.metrics.admission_tenant_rate_evictions_total.inc,
            new_burst=burst_per_worker(max(burst, math.ceil(new_rate)), workers),
        )
        self.metrics.admission_tenant_rate_buckets.set_function(lambda: rates.tenants)
        return rates

    async def _start(self) -> None:
        settings = self.settings
        if settings.redis.url is not None:  # before the pools' tokenizers: kvlb serve stops with exit 2
            from balancer.fleet.redis_checks import check_database  # lazy: Redis only

            await check_database(settings.redis)
        health = HealthBook(
            BreakerConfig(probe_timeouts_to_drop=settings.health_timeouts_to_drop),
            drain_keep_s=settings.health_drain_keep_s,
        )
        if self.key_watcher is not None:  # before any call to an engine: a key changed since the load
            self._key_watch = spawn(self.key_watcher.run(), "kvlb-key-watch")
        pools = await self._build_pools(health, random.Random(settings.policy.seed))
        weights = PolicyWeights.from_dict(settings.policy.weights)
        limits = settings.limits
        admission = Admission(
            AdmissionLimits(
                limits.max_inflight,
                limits.max_queued,
                limits.queue_timeout_s,
                limits.max_inflight_body_bytes,
                max_inflight_per_tenant=limits.max_inflight_per_tenant or limits.max_inflight,
                max_queued_per_tenant=(
                    limits.max_queued
                    if limits.max_queued_per_tenant is None
                    else limits.max_queued_per_tenant
                ),
                max_tenants=limits.max_tenants,
                max_inflight_prompt_tokens_per_tenant=limits.max_inflight_prompt_tokens_per_tenant or None,
            )
        )
        self.metrics.inflight_requests.set_function(lambda: admission.inflight)
        self.metrics.admission_tenants.set_function(lambda: admission.tenants)
        self.metrics.admission_body_bytes.set_function(lambda: admission.body_bytes)
        self.metrics.admission_tokenizing_bytes.set_function(lambda: admission.tokenizing_bytes)
        self.state = state = ServiceState(
            settings=settings,
            pools=pools,
            health=health,
            upstream=self._upstream,
            metrics=self.metrics,
            policy=PolicyControl(settings.policy.name, weights, time.time()),
            admission=admission,
            series=self._series(),
            decisions=self._decision_log(),
            audit=AuditLog(settings.console.audit_log_size, self.metrics.console_audit_dropped_total.inc),
            token_id_memo=TokenIdMemo(limits.token_id_memo_runs),
            wall_clock=self.options.wall_clock,
        )
        if self.key_watcher is not None:
            self.key_watcher.on_rotated = self._key_rotated
        self.metrics.token_id_memo.source = lambda: state.token_id_memo
        state.tenant_rates = self._tenant_rates()
        if limits.max_tokenizing_per_tenant is not None:
            state.tokenizer_gate = TokenizerGate(limits.max_tokenizing_per_tenant, limits.queue_timeout_s)
        for model in pools:
            state.decisions.ring(model)  # its gauges exist from the start
        self.metrics.index_tables.source = lambda: {  # read at scrape time: a mirror installs its own
            f"{pool.model}/{block_size}/{mode}": space.table.counters
            for pool in pools.values()
            for (block_size, mode), space in pool.router.spaces.items()
        }
        self.metrics.key_memos.source = lambda: {
            f"{pool.model}/{block_size}/{mode}": space.memo
            for pool in pools.values()
            for (block_size, mode), space in pool.router.spaces.items()
        }
        self.metrics.load_trackers.source = lambda: {
            pool.model: pool.router.tracker().stats() for pool in pools.values()
        }
        self.metrics.segment_caches.source = lambda: {
            pool.tokenizer.name: cache
            for pool in pools.values()
            if isinstance(pool.tokenizer, HfTokenizer) and (cache := pool.tokenizer.segment_cache) is not None
        }
        self.metrics.segment_caches.words = lambda: {
            pool.tokenizer.name: memo
            for pool in pools.values()
            if isinstance(pool.tokenizer, HfTokenizer) and (memo := pool.tokenizer.word_memo) is not None
        }
        self._share_load(pools, state)
        self._report_crash_loops(state)
        for pool in pools.values():
            for replica in pool.replicas:
                state.health.add(replica)
        self._zmq = zmq.asyncio.Context()
        self._control = aiohttp.ClientSession()
        await self._start_replicas(state)
        await self._start_http(state)
        await self._start_grpc(state)

    def _share_load(self, pools: Mapping[str, Pool], state: ServiceState) -> None:
        """With ``--workers N``: publish every pool's own per-replica load and the admitted count
        into this worker's row of the supervisor's table, and let every router (its view and its
        per-replica cap) and the admission (``limits.max_inflight``,
        ``limits.max_inflight_per_tenant`` when it is below it, and
        ``limits.max_inflight_prompt_tokens_per_tenant`` when it is set) add the other workers'
        rows; the buckets of ``limits.tenant_rate_per_s`` (when set) start from the other workers'
        times."""
        worker = self.options.worker
        if worker is None or worker.count < 2 or worker.load_table is None:
            return
        metrics = self.metrics
        admission = state.admission
        share = self._load_share = LoadShare(
            worker.load_table,
            worker.index,
            worker.count,
            self.settings.limits.load_share_slots,
            self.settings.limits.load_share_tenant_slots,
            on_overflow=metrics.load_share_overflow_replicas_total.inc,
            on_tenant_overflow=metrics.load_share_overflow_tenants_total.inc,
            on_torn=metrics.load_share_torn_reads_total.inc,
        )
        for pool in pools.values():
            pool.router.tracker().on_change = share.publisher(pool.model)
            pool.router.peer_load = share.reader(pool.model)
        admission.on_change = share.publish_admitted
        admission.peers = share.peer_admitted
        share.publish_admitted(admission.inflight)
        if admission.limits.max_inflight_per_tenant < admission.limits.max_inflight:
            # At the global cap (the default) the tenant's count cannot bind before the global one:
            # nothing is shared for it.
            admission.on_tenant_change = share.publish_tenant
            admission.tenant_peers = share.peer_tenant_admitted
        if admission.limits.max_inflight_prompt_tokens_per_tenant is not None:
            admission.on_tenant_tokens = share.publish_tenant_tokens
            admission.tenant_token_peers = share.peer_tenant_prompt_tokens
        if state.tenant_rates is not None:
            state.tenant_rate_share = SharedRates(share.peer_tenant_tat, share.publish_tenant_tat)

    def _series(self) -> SeriesSampler:
        """The console's bounded time series (``console.series_*``)."""
        console = self.settings.console
        metrics = self.metrics
        overflow = metrics.console_series_overflow_total
        return SeriesSampler(
            console.series_interval_s,
            console.series_intervals,
            console.series_max_replicas,
            # every request past an interval's replica names counts one: the memoised child
            on_overflow=lambda kind: metrics.children.of(overflow, kind).inc(),
        )

    def _decision_log(self) -> DecisionLog:
        """The console's rings; their gauges read the ring when scraped, and the eviction counter's
        children are looked up once (a labels() call costs microseconds on the commit path)."""
        console, metrics = self.settings.console, self.metrics
        evicted: dict[tuple[str, str], Any] = {}

        def on_evict(pool: str, reason: str, count: int) -> None:
            child = evicted.get((pool, reason))
            if child is None:
                child = evicted[(pool, reason)] = metrics.console_ring_evicted_total.labels(pool, reason)
            child.inc(count)

        def on_ring(pool: str, ring: DecisionRing) -> None:
            metrics.console_ring_entries.labels(pool).set_function(lambda: ring.stats.entries)
            metrics.console_ring_bytes.labels(pool).set_function(lambda: ring.stats.bytes)

        worker = self.options.worker
        return DecisionLog(
            console.decision_ring_size,
            console.decision_ring_bytes,
            on_evict=on_evict,
            on_ring=on_ring,
            id_offset=0 if worker is None else worker.index,
            id_step=1 if worker is None else worker.count,
        )

    async def _build_pools(self, health: HealthBook, rng: random.Random) -> dict[str, Pool]:
        """One pool per configured model; every pool's router reads the shared ``health`` book and
        breaks ties with the one ``rng`` (``policy.seed``)."""
        limits = TokenizeLimits(
            max_prompt_tokens=self.settings.limits.max_prompt_tokens,
            segment_cache_bytes=self.settings.limits.segment_cache_bytes,
        )
        loaded: dict[str | None, Tokenizer] = {}
        pools: dict[str, Pool] = {}
        for config in self.settings.pools:
            tokenizer = self._given_tokenizers.get(config.model)
            if tokenizer is None:
                if config.tokenizer not in loaded:
                    loaded[config.tokenizer] = await asyncio.to_thread(
                        load_pool_tokenizer, config.tokenizer, limits
                    )
                tokenizer = loaded[config.tokenizer]
            pools[config.model] = self._build_pool(config, tokenizer, health, rng)
        return pools

    def _build_pool(
        self, config: PoolConfig, tokenizer: Tokenizer, health: HealthBook, rng: random.Random
    ) -> Pool:
        settings = self.settings
        stale_after_s = max(5.0, STALE_SCRAPES * settings.scrape_interval_s)
        route_limits = RouteLimits(
            max_inflight_per_replica=settings.limits.max_inflight_per_replica,
            # without events, the routed blocks are the index: they live as long as an engine's cache
            speculative_ttl_s=settings.limits.speculative_ttl_s if config.kv_events else config.approx_ttl_s,
            pending_ttl_s=settings.timeouts.first_byte_s,
            receipt_drops=settings.limits.receipt_drops,
            # also with Redis, whose mirrors clear at every gap: their tables learn from receipts
            receipts_teach=settings.limits.gap_hold_s > 0,
        )
        router = PoolRouter(
            config.model,
            TableLimits(
                capacity_blocks=settings.limits.index_capacity_blocks,
                max_speculative_keys=settings.limits.max_speculative_keys,
                gap_hold_s=settings.limits.gap_hold_s,
                gap_keep_s=settings.limits.gap_keep_s,
            ),
            LoadConfig(stale_after_s=stale_after_s),
            health=health,
            route_limits=route_limits,
            rng=rng,
        )
        for replica in config.replicas:
            spec = engine_spec(replica.engine)
            router.add_replica(ReplicaId(replica.id), replica.block_size, spec.alignment(), spec.block_hashes)
        router.tracker()  # built once every key space exists (its block size is the pool's smallest)
        replicas = {ReplicaId(r.id): r for r in config.replicas}
        return Pool(
            config.model,
            router,
            tokenizer,
            replicas,
            kv_events=config.kv_events,
            api_key=config.api_key,
            stream_usage=config.stream_usage,
        )

    async def _start_replicas(self, state: ServiceState) -> None:
        """Event ingest (or the fleet), scrapers and probers of the static replicas, then discovery."""
        assert self._zmq is not None and self._control is not None
        worker = self.options.worker
        relay = (
            None
            if worker is None or worker.count < 2
            else RelayRole(worker.run_dir, worker.drains, self.settings.limits.relay_history_bytes)
        )
        self.replicas = replicas = ReplicaLifecycle(
            state, zmq_ctx=self._zmq, session=self._control, relay=relay
        )
        if self.settings.redis.url is not None:  # fleet mode: leases decide who ingests what
            index = None if worker is None or worker.count < 2 else worker.index
            from balancer.fleet.runtime import FleetRuntime  # lazy: Redis only

            # the writers run on the ingest thread
            self.fleet = FleetRuntime(state, thread=replicas.thread, worker=index)
            await self.fleet.start()
            replicas.fleet = self.fleet
        await replicas.start_static()
        if relay is not None and self.fleet is None:  # embedded workers: share speculative entries
            self._share_speculation(state, replicas, relay.run_dir)
        state.sources_started = True
        state.sources_started_at = state.monotonic()
        discovery = self._discovery if self._discovery is not None else build_discovery(self.settings)
        if discovery is not None:
            self.metrics.discovery_over_cap.source = discovery.over_cap  # the caps of what it keeps
            replicas.start_discovery(discovery)

    def _share_speculation(self, state: ServiceState, replicas: ReplicaLifecycle, run_dir: str) -> None:
        worker = self.options.worker
        thread = replicas.thread
        assert worker is not None and thread.loop is not None and thread.zmq is not None
        tables: dict[str, LockedPrefixTable] = {}
        for pool in state.pools.values():
            for (block_size, mode), space in pool.router.spaces.items():
                if isinstance(space.table, LockedPrefixTable):
                    tables[f"{pool.model}|{block_size}|{mode}"] = space.table
        share = self._speculation = SpeculationShare(run_dir, worker.index, worker.count, tables)
        share.start_publishing()
        self._speculation_task = asyncio.run_coroutine_threadsafe(share.receive(thread.zmq), thread.loop)

    def _report_crash_loops(self, state: ServiceState) -> None:
        """With ``--workers N``: ``/readyz`` (degraded) and ``kvlb_process_workers_crash_looping`` read
        the supervisor's record of the workers that cannot start or keep dying
        (:mod:`balancer.worker_record`), at the time of asking."""
        worker = self.options.worker
        if worker is None or worker.count < 2:
            return
        run_dir = worker.run_dir
        state.degraded_checks.append(lambda: crash_loop_reasons(read_record(run_dir), time.monotonic()))

        def crash_looping() -> int:
            record = read_record(run_dir)
            return 0 if record is None else len(record.crash_looping(time.monotonic()))

        self.metrics.process_workers_crash_looping.set_function(crash_looping)

    async def _start_http(self, state: ServiceState) -> None:
        app = build_web_app(state, self._inflight)
        worker = self.options.worker
        if worker is not None and worker.count > 1:
            self._siblings = Siblings(
                worker.run_dir,
                worker.index,
                worker.count,
                on_oversize=self.metrics.siblings_answers_oversize_total.inc,
            )
            await self._siblings.open()
            fan_out = self.settings.redis.url is None  # with Redis the fleet shares the policy itself
            app.middlewares.append(sibling_middleware(self._siblings, fan_out_admin=fan_out))
            if fan_out:
                state.admin_fan_out = grpc_fan_out(self._siblings, self.settings.auth.admin_token)
            state.whatif_gather = grpc_whatif(self._siblings, self.settings.auth.admin_token)
            state.replicas_gather = grpc_replicas(self._siblings, self.settings.auth.admin_token)
        listen = self.settings.listen
        ssl_context = server_ssl_context(listen)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handler_cancellation=True,
            # a backstop only: _stop_http cancels what is left at the grace, before aiohttp's wait ends
            # (the two at once made aiohttp set a result on its cancelled waiter: InvalidStateError)
            shutdown_timeout=self.options.shutdown_grace_s + HTTP_STOP_BACKSTOP_S,
            keepalive_timeout=self.settings.timeouts.client_idle_s,
            logger=server_logger(),
        )
        await self._runner.setup()
        if self._siblings is not None and self.settings.redis.url is None:  # with Redis: the fleet's
            await catch_up(self._siblings, state)  # a restarted worker takes the others' policy first
        site: web.BaseSite
        if worker is not None:  # the supervisor's listening socket, shared by every worker
            sock = socket.socket(fileno=worker.listen_fd)
            sock.setblocking(False)
            site = web.SockSite(self._runner, sock, ssl_context=ssl_context)
        else:
            site = web.TCPSite(
                self._runner, listen.host, listen.port, reuse_address=True, ssl_context=ssl_context
            )
        try:
            await site.start()
        except (OSError, OverflowError) as exc:  # a port in use, a host that resolves to nothing
            raise bind_error("listen.port", listen.host, listen.port, exc) from None
        host, port = self._runner.addresses[0][:2]
        if self._siblings is not None:  # the private port the other workers reach this one on
            private = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=ssl_context)
            await private.start()
            private_host, private_port = self._runner.addresses[-1][:2]
            scheme = "https" if ssl_context else "http"
            self._siblings.register(f"{scheme}://{private_host}:{private_port}")
        self.url = f"{'https' if ssl_context else 'http'}://{host}:{port}"
        log.info("kvlb serving %d pool(s) on %s", len(state.pools), self.url)
        if not state.pools:  # `kvlb serve` with no --config: it listens, and knows no model
            log.warning(
                "no pools configured: every /v1 request will be refused (unknown model); give the "
                "replicas with --config FILE or $KVLB_CONFIG (examples/kvlb.yaml is a start)"
            )

    async def _start_grpc(self, state: ServiceState) -> None:
        port = self.settings.listen.grpc_port
        if port is None:
            return
        from balancer.api.grpc.server import GrpcServer  # lazy: a gRPC port only

        self._grpc = GrpcServer(state, reuse_port=self.options.worker is not None)
        self.grpc_port = await self._grpc.start(self.settings.listen.host, port)
        log.info("kvlb serving gRPC on %s:%d", self.settings.listen.host, self.grpc_port)

    async def stop(self) -> None:
        """Ordered shutdown (idempotent): HTTP and gRPC (with grace) → discovery, probers and
        scrapers → fleet → ingest → sessions."""
        if self.state is not None:
            self.state.shutting_down = True
        servers: list[Coroutine[Any, Any, None]] = []
        if self._grpc is not None:
            grpc_server, self._grpc = self._grpc, None
            servers.append(grpc_server.stop(self.options.shutdown_grace_s))
        if self._runner is not None:
            runner, self._runner = self._runner, None
            servers.append(self._stop_http(runner))
        await asyncio.gather(*servers)
        if self._load_share is not None:
            share, self._load_share = self._load_share, None
            if self.state is not None:
                for pool in self.state.pools.values():
                    pool.router.peer_load = None
                    pool.router.tracker().on_change = None
                self.state.admission.peers = None
                self.state.admission.on_change = None
                self.state.admission.tenant_peers = None
                self.state.admission.on_tenant_change = None
                self.state.admission.tenant_token_peers = None
                self.state.tenant_rate_share = None
                self.state.admission.on_tenant_tokens = None
            share.close()
        if self._siblings is not None:
            siblings, self._siblings = self._siblings, None
            await siblings.aclose()
        if self.replicas is not None:
            await self.replicas.cancel_tasks()  # discovery first: no replica is added meanwhile
        if self.fleet is not None:
            fleet, self.fleet = self.fleet, None
            await fleet.stop()
        if self._speculation_task is not None:
            self._speculation_task.cancel()
            self._speculation_task = None
        if self._speculation is not None:
            self._speculation.close()
            self._speculation = None
        if self.replicas is not None:
            await self.replicas.close_ingest()
        if self._key_watch is not None:
            watch, self._key_watch = self._key_watch, None
            await cancel_all([watch])
        await self._upstream.aclose()
        if self._control is not None:
            control, self._control = self._control, None
            await control.close()
        if self._zmq is not None:
            context, self._zmq = self._zmq, None
            context.destroy(linger=0)

    async def _stop_http(self, runner: web.AppRunner) -> None:
        """Stop listening and let the requests in flight finish for ``shutdown_grace_s``, then cancel
        the rest: aiohttp alone would wait up to twice its ``shutdown_timeout`` (api/inflight.py)."""
        cleanup = asyncio.ensure_future(runner.cleanup())
        done, _ = await asyncio.wait((cleanup,), timeout=self.options.shutdown_grace_s)
        if not done:
            log.warning(
                "shutdown grace over: cancelling %d request(s) still in flight", self._inflight.cancel_all()
            )
        await cleanup

    async def __aenter__(self) -> Balancer:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
