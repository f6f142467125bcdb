"""What the HTTP handlers share: pools, health, policy control, counters (no I/O of its own).

The composition root (:mod:`balancer.service.app`) builds one :class:`ServiceState` and hands it to the web
app; nothing here is module-level. Every mutation happens between awaits on the one event loop, so
there are no locks.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from balancer.config import ReplicaConfig, Settings
from balancer.health.book import HealthBook
from balancer.load.scraper import MetricsScraper
from balancer.metrics import Metrics
from balancer.policy import Policy, PolicyWeights, make_policy
from balancer.routing.router import PoolRouter
from balancer.service.admission import Admission
from balancer.sources.pipeline import EventIngest, ReplicaIngestStatus
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


REQUEST_ID = web.RequestKey("kvlb_request_id", str)
OUTCOME = web.RequestKey("kvlb_outcome", Outcome)


@dataclass(slots=True)
class Pool:
    """Every replica serving one model, its router and its tokenizer."""

    model: str
    router: PoolRouter
    tokenizer: Tokenizer
    replicas: dict[ReplicaId, ReplicaConfig]


@dataclass(frozen=True, slots=True)
class PolicyView:
    """The policy in force, as ``GET /admin/policy`` shows it."""

    name: str
    weights: PolicyWeights
    version: int
    """Starts at 1 and increments on every change."""
    updated_by: str
    updated_at_wall: float

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "weights": self.weights.to_dict(),
            "version": self.version,
            "updated_by": self.updated_by,
            "updated_at": self.updated_at_wall,
        }


class PolicyControl:
    """The runtime-tunable policy: its name, weights and version, and one instance per pool
    (``round_robin`` keeps its rotation per instance, so pools never share one)."""

    def __init__(self, name: str, weights: PolicyWeights, wall_now: float) -> None:
        make_policy(name)  # validates the name
        self.view = PolicyView(name, weights, 1, "config", wall_now)
        self._instances: dict[str, Policy] = {}
        self.listeners: list[Callable[[PolicyView], None]] = []
        """Called with the new view after each local change (the fleet writes it to Redis)."""

    def policy_for(self, model: str) -> Policy:
        policy = self._instances.get(model)
        if policy is None:
            policy = self._instances[model] = make_policy(self.view.name)
        return policy

    def update(
        self, name: str | None, weights: PolicyWeights, who: str, wall_now: float
    ) -> dict[str, tuple[object, object]]:
        """Apply a validated change; returns ``{field: (old, new)}`` (empty: nothing changed,
        and the version stays). Raises :class:`ConfigError` for an unknown policy name."""
        old = self.view
        new_name = old.name if name is None else name
        if new_name != old.name:
            make_policy(new_name)
        changes: dict[str, tuple[object, object]] = {}
        if new_name != old.name:
            changes["name"] = (old.name, new_name)
        before, after = old.weights.to_dict(), weights.to_dict()
        changes.update({k: (before[k], after[k]) for k in after if before[k] != after[k]})
        if not changes:
            return changes
        if new_name != old.name:
            self._instances.clear()
        self.view = PolicyView(new_name, weights, old.version + 1, who, wall_now)
        for listener in self.listeners:
            listener(self.view)
        return changes

    def adopt(self, view: PolicyView) -> bool:
        """Install a view decided elsewhere (another balancer, through Redis) without telling the
        listeners; ``False`` when it is the one in force. Raises :class:`ConfigError` for an
        unknown policy name."""
        if view == self.view:
            return False
        if view.name != self.view.name:
            make_policy(view.name)
            self._instances.clear()
        self.view = view
        return True


@dataclass(slots=True)
class ServiceState:
    """Everything a request handler reaches; built by :class:`balancer.service.app.Balancer`."""

    settings: Settings
    pools: dict[str, Pool]
    health: HealthBook
    upstream: UpstreamClient
    metrics: Metrics
    policy: PolicyControl
    rng: random.Random
    monotonic: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    ingests: list[EventIngest] = field(default_factory=list)
    scrapers: dict[ReplicaId, MetricsScraper] = field(default_factory=dict)
    sources_started: bool = False
    shutting_down: bool = False
    readiness_checks: list[Callable[[], list[str]]] = field(default_factory=list)
    """More reasons not to be ready (the fleet: mirrors not warm yet)."""
    degraded_checks: list[Callable[[], list[str]]] = field(default_factory=list)
    """Reasons the service runs degraded but still serves (the fleet: Redis unreachable)."""
    fleet_status: Callable[[], dict[str, Any]] | None = None
    """The fleet's view for ``GET /admin/fleet`` (``None``: embedded, no Redis)."""
    inflight: int = 0
    """Requests being handled now (admission control against ``limits.max_inflight``)."""
    inflight_by_replica: dict[ReplicaId, int] = field(default_factory=dict)
    """Requests committed to each replica and not yet released."""
    admission: Admission | None = None
    """The bounded admission queue (built on first use by :func:`balancer.api.openai.admission_of`)."""
    _next_seq: int = 0

    def replicas(self) -> Iterable[tuple[Pool, ReplicaConfig]]:
        for pool in self.pools.values():
            for config in pool.replicas.values():
                yield pool, config

    def tracking_id(self, request_id: str) -> str:
        """A key unique in this process for load tracking (clients may reuse ``x-request-id``)."""
        self._next_seq += 1
        return f"{request_id}#{self._next_seq}"

    def ingest_status(self) -> dict[ReplicaId, ReplicaIngestStatus]:
        out: dict[ReplicaId, ReplicaIngestStatus] = {}
        for ingest in self.ingests:
            out.update(ingest.status())
        return out

    def readiness(self, now: float) -> list[str]:
        """Why the service is not ready (empty: ready)."""
        problems = []
        if self.shutting_down:
            problems.append("shutting down")
        if not self.sources_started:
            problems.append("event sources not started")
        if not self.pools:
            problems.append("no pools configured")
        for model, pool in self.pools.items():
            if not self.health.routable(now, pool.replicas):
                problems.append(f"pool {model!r} has no healthy replica")
        for check in self.readiness_checks:
            problems.extend(check())
        return problems

    def degraded(self) -> list[str]:
        """Why the service runs degraded while still ready (empty: not degraded)."""
        return [reason for check in self.degraded_checks for reason in check()]


STATE = web.AppKey("kvlb_state", ServiceState)
