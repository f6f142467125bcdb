"""What both faces and the service layer share: pools, health, admission, the policy in force.

The composition root (:mod:`balancer.app`) builds one :class:`ServiceState` and hands it to the
HTTP app and the gRPC server; nothing here is module-level. Every mutation happens between awaits on
the one event loop, so there are no locks. In-flight requests are counted once each way: admitted
requests by :class:`~balancer.service.admission.Admission`, committed ones per replica by each pool's
router (its load tracker's reservations).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from balancer.config import ReplicaConfig, Settings
from balancer.config.settings import Secret
from balancer.health.book import DrainNote, HealthBook, KeptDrainListing
from balancer.load.scraper import MetricsScraper
from balancer.metrics import Metrics
from balancer.routing.router import PoolRouter
from balancer.service.admission import Admission
from balancer.service.audit import AuditLog
from balancer.service.decisions import DecisionLog
from balancer.service.policy_control import PolicyControl
from balancer.service.series import SeriesSampler
from balancer.service.tenant_rate import SharedRates, TenantRates
from balancer.service.tokenizer_gate import TokenizerGate
from balancer.sources.pipeline import IngestView, ReplicaIngestStatus
from balancer.tokenizer.token_ids import TokenIdMemo
from balancer.tokenizer.tokenizer import Tokenizer
from balancer.types import ReplicaId
from balancer.upstream.client import UpstreamClient


@dataclass(slots=True)
class Outcome:
    """How one request ended, for the ``kvlb_http_requests_total`` labels (set as it goes)."""

    replica: str = ""
    policy: str = ""
    status: str | None = None
    """Overrides the response status label: ``stream_error`` (the replica broke mid-stream) or
    ``499`` (the client went away)."""


@dataclass(slots=True)
class Pool:
    """Every replica serving one model, its router and its tokenizer."""

    model: str
    router: PoolRouter
    tokenizer: Tokenizer
    replicas: dict[ReplicaId, ReplicaConfig]
    kv_events: bool = True
    """Whether the pool's engines publish KV events (``pools[].kv_events``); without, no event source
    runs and the index learns from routing decisions and receipts only."""
    api_key: Secret | None = None
    """The pool's default engine API key (``pools[].api_key_file``/``api_key_env``), given to the
    discovered replicas that have none of their own."""
    stream_usage: bool = True
    """Whether every stream asks its engine for usage (``pools[].stream_usage``)."""


@dataclass(slots=True)
class ServiceState:
    """Everything a request handler reaches; built by :class:`balancer.app.Balancer`."""

    settings: Settings
    pools: dict[str, Pool]
    health: HealthBook
    upstream: UpstreamClient
    metrics: Metrics
    policy: PolicyControl
    admission: Admission
    """The bounded admission queue of ``limits.max_inflight`` / ``limits.max_queued``."""
    tenant_rates: TenantRates | None = None
    """The per-tenant buckets of ``limits.tenant_rate_per_s`` (:func:`check_tenant_rate`); ``None``: off."""
    tokenizer_gate: TokenizerGate | None = None
    """The tenants' turns in the tokenizer's threads (``limits.max_tokenizing_per_tenant``); ``None``: off."""
    tenant_rate_share: SharedRates | None = None
    """With ``kvlb serve --workers N``: the buckets' times shared with the other workers (the shared
    load table); ``None``: this worker's buckets are all."""
    series: SeriesSampler | None = None
    """The console's time series (``GET /admin/series``), fed by dispatch; ``None``: not sampled."""
    monotonic: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    ingests: list[IngestView] = field(default_factory=list)
    scrapers: dict[ReplicaId, MetricsScraper] = field(default_factory=dict)
    sources_started: bool = False
    sources_started_at: float | None = None
    """When the event sources started (``monotonic``): ``health_ready_wait_s`` counts from here."""
    ready_once: bool = False
    """Whether :meth:`readiness` found nothing wrong once: from then on a pool without a healthy
    replica is degraded, not a reason to be unready."""
    shutting_down: bool = False
    admin_fan_out: Callable[[str, str, bytes, str | None], Awaitable[None]] | None = None
    """``(method, path, body, actor)``: sends an admin change made through gRPC to the sibling
    workers of ``kvlb serve --workers N`` (embedded mode; HTTP changes go through the siblings
    middleware). ``None``: one process, or the fleet shares the change."""
    whatif_gather: Callable[[bytes, dict[str, Any]], Awaitable[dict[str, Any]]] | None = None
    """``(body, answer)``: this worker's ``Admin.WhatIf`` answer to the JSON ``body`` merged with the
    sibling workers' replays of it (``kvlb serve --workers N``; HTTP goes through the siblings
    middleware). ``None``: one process."""
    replicas_gather: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] | None = None
    """``(answer)``: ``{"replicas", "kept_drains", "kept_drains_total", "workers", "workers_missing"}``,
    this worker's ``Admin.ListReplicas`` answer with the ``prediction`` of every sibling worker's
    receipts and every worker's kept drains, as ``GET /admin/replicas`` answers (``kvlb serve
    --workers N``; HTTP goes through the siblings middleware). ``None``: one process."""
    fleet_kept_drains: Callable[[], list[KeptDrainListing]] | None = None
    """The drains the fleet keeps in Redis for replicas no pool lists here (set by the fleet);
    ``None``: embedded (only :attr:`health`'s own)."""
    drain_committer: Callable[[ReplicaId, DrainNote | None], Awaitable[bool]] | None = None
    """``(replica, note)``: a drain (with who, when and why) or, ``None``, an undrain. Set by the
    fleet (Redis), stores a drain or undrain for every balancer before it is applied here; raises
    when it could not (then it is applied nowhere). ``None``: embedded, the drain is this process's
    (and its sibling workers', fanned out)."""
    readiness_checks: list[Callable[[], list[str]]] = field(default_factory=list)
    """More reasons not to be ready (the fleet: mirrors not warm yet)."""
    degraded_checks: list[Callable[[], list[str]]] = field(default_factory=list)
    """Reasons the service runs degraded but still serves (the fleet: Redis unreachable)."""
    fleet_status: Callable[[], dict[str, Any]] | None = None
    """The fleet's view for ``GET /admin/fleet`` (``None``: embedded, no Redis)."""
    decisions: DecisionLog = field(default_factory=lambda: DecisionLog(10_000, 128 * 1024 * 1024))
    """Recent committed decisions per pool (``console.decision_ring_*``; the app builds it)."""
    audit: AuditLog = field(default_factory=lambda: AuditLog(1_000))
    """Policy changes (``console.audit_log_size``; the app builds it)."""
    token_id_memo: TokenIdMemo = field(default_factory=lambda: TokenIdMemo(0))
    """Runs of token-id prompts decoded before (``limits.token_id_memo_runs``; off by default here,
    the composition root sizes it)."""
    whatif_running: int = 0
    """What-if replays running now (``balancer.api.console`` bounds them)."""

    def replicas(self) -> Iterable[tuple[Pool, ReplicaConfig]]:
        for pool in self.pools.values():
            for config in pool.replicas.values():
                yield pool, config

    def kv_events(self, replica: ReplicaId) -> bool:
        """Whether ``replica``'s pool takes KV events (``True`` for a replica of no pool)."""
        for pool in self.pools.values():
            if replica in pool.replicas or replica in pool.router.space_of:
                return pool.kv_events
        return True

    def ingest_status(
        self, only: Collection[ReplicaId] | None = None
    ) -> dict[ReplicaId, ReplicaIngestStatus]:
        """Every ingest's replicas' status (of those ``only`` names when given)."""
        out: dict[ReplicaId, ReplicaIngestStatus] = {}
        for ingest in self.ingests:
            out.update(ingest.status(only))
        return out

    def readiness(self, now: float) -> list[str]:
        """Why the service is not ready (empty: ready). A pool with no healthy replica counts only
        until the service was first ready or ``health_ready_wait_s`` after its sources started
        (:meth:`pools_gate`); later it is :meth:`degraded`."""
        problems = []
        if self.shutting_down:
            problems.append("shutting down")
        if not self.sources_started:
            problems.append("event sources not started")
        if not self.pools:
            problems.append("no pools configured")
        if self.pools_gate(now):
            problems.extend(self._no_healthy(model, now) for model in self._pools_down(now))
        for check in self.readiness_checks:
            problems.extend(check())
        if not problems:
            self.ready_once = True
        return problems

    def pools_gate(self, now: float) -> bool:
        """Whether a pool without a healthy replica still keeps the service unready: only while it
        starts (never ready yet, within ``health_ready_wait_s`` of its sources' start)."""
        if self.ready_once:
            return False
        return (
            self.sources_started_at is None
            or now < self.sources_started_at + self.settings.health_ready_wait_s
        )

    def _no_healthy(self, model: str, now: float) -> str:
        """``pool 'm' has no healthy replica (2 failing health probes)``: the pool and why."""
        return f"pool {model!r} has no healthy replica{self.pools[model].router.why_unroutable(now)}"

    def _pools_down(self, now: float) -> list[str]:
        """Pools with no routable replica that are not merely drained."""
        return [
            model
            for model, pool in self.pools.items()
            if not self.health.routable(now, pool.replicas)
            and not self.health.drained_only(now, pool.replicas)
        ]

    def degraded(self, now: float | None = None) -> list[str]:
        """Why the service runs degraded while still ready (empty: not degraded). With ``now``: also
        each pool whose healthy replicas are all drained (an operator's choice, the same on every
        balancer: its requests get 503 with Retry-After, and the balancer stays ready for the
        other pools)."""
        reasons = [reason for check in self.degraded_checks for reason in check()]
        if now is not None:
            if not self.pools_gate(now):
                reasons.extend(self._no_healthy(model, now) for model in self._pools_down(now))
            for model, pool in self.pools.items():
                if not self.health.routable(now, pool.replicas) and self.health.drained_only(
                    now, pool.replicas
                ):
                    reasons.append(f"pool {model!r} has every healthy replica drained")
        return reasons
