"""A simulated fleet behind the real routing code, on virtual time (pure: no clock, no I/O).

:class:`Simulation` wires the pieces together on one :class:`~loadtests.simulate.des.EventLoop`:

* **arrivals** are pulled from the request stream one at a time (the heap holds one future
  arrival), routed by :class:`~loadtests.simulate.routing.SimRouter` (the service's ``PoolRouter``:
  hash, match, policy, commit with speculative entries) and submitted to the chosen replica;
* **replicas** (:class:`~loadtests.simulate.replica_model.FastReplica`, or the emulator's own
  scheduler in :class:`~loadtests.simulate.step_model.StepReplica`) report first tokens and ends,
  which move the request from prefill to decode and release it in the router's load tracker, as
  the proxy does;
* **KV events**: every change of a replica's cache becomes ``Stored``/``Removed`` events (page ids as
  engine hashes, the pages' tokens) applied to the router's prefix table, after ``event_delay_s``;
* **scrapes**: every ``scrape_interval_s`` each replica's running/waiting/KV-usage gauges are given to
  the load tracker, as the metrics scraper does.

* **the hop** from the router to the replica: with ``forward_delay_s`` > 0 a request reaches its
  replica that long after it was routed (the fleet's HTTP forwarding, body parsing and the
  engine's tokenizing; 0 by default), and its TTFT counts from its arrival at the router. With
  ``forward_jitter_s`` > 0 each request's hop is its own uniform draw within that much of
  ``forward_delay_s`` (the fleet's hop is not the same for every request), from the generator the
  simulation is given (``hop_rng``) or one seeded from ``seed``.

What it leaves out: network and proxy latency beyond ``forward_delay_s`` (by default TTFT is
replica arrival → first token), the way back (a first token reaches the router when the replica
produces it), retries,
health checks, the balancer's global in-flight cap, data parallelism (one rank per replica) and
TRT-LLM caching rules (replicas cache as SGLang does).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from balancer.config import LimitConfig, TimeoutConfig
from balancer.errors import NoReplicasAvailable, Overloaded
from balancer.events import KvEvent
from balancer.index.slots import TableLimits
from balancer.policy.base import PolicyWeights
from balancer.routing.router import RoutePlan
from balancer.types import Decision, ReplicaId
from loadtests.simulate.block_cache import BlockCache
from loadtests.simulate.des import EventLoop
from loadtests.simulate.replica_model import FastReplica, Job, PagedCache, ReplicaModel
from loadtests.simulate.report import GapHistogram, RecordColumns, run_summary
from loadtests.simulate.routing import SimRouter
from loadtests.simulate.sources import SimRequest
from loadtests.simulate.step_model import StepReplica
from loadtests.stats import Summary
from replicas.sim.profiles import Profile, get_profile

ReplicaKind = Literal["fast", "step"]
_LIMITS = LimitConfig()
_TIMEOUTS = TimeoutConfig()
_GRID_STEPS_MAX = 10_000_000
"""Idle scrape intervals skipped by adding the interval one at a time (as the scrapes would); past
this many (a rate of 1e-9 req/s) the skip multiplies instead."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated fleet and balancer."""

    replicas: int = 8
    """Replicas in the pool (≥ 1). Memory grows with replicas × KV capacity (tokens are cached)."""
    profile: str = "h100-llama3-8b"
    """Emulator profile (timing and capacity) of every replica: ``replicas/sim/profiles.py``."""
    page_size: int | None = None
    """KV page size in tokens, also the router's block size; ``None``: the profile's. Larger pages
    make long prompts cheaper to simulate (fewer blocks) and match only whole pages."""
    kv_capacity_tokens: int | None = None
    """Overrides the profile's KV pool size, tokens per replica; ``None``: the profile's."""
    policy: str = "cost"
    """Routing policy name (``balancer.policy.registry.POLICY_NAMES``)."""
    weights: PolicyWeights = field(default_factory=PolicyWeights)
    """Policy weights, as ``kvlb admin policy set`` takes them."""
    replica_model: ReplicaKind = "fast"
    """``fast``: event-level model; ``step``: the emulator's scheduler step by step (slow, exact)."""
    seed: int = 0
    """Seed of the routing tie-breaks (the workload has its own)."""
    prune: bool = True
    """Give the policy a pruned candidate set where that is exact (``routing`` module docs)."""
    prune_k: int = 4
    """Least-loaded replicas added to the holders of the first block when pruning (≥ 1)."""
    speculative_ttl_s: float = _LIMITS.speculative_ttl_s
    """Speculative index entries' lifetime after the request's first token, seconds (the service's
    ``limits.speculative_ttl_s``)."""
    pending_ttl_s: float | None = _TIMEOUTS.first_byte_s
    """Their lifetime until the first token, seconds: the service holds them for its first-byte
    timeout (``timeouts.first_byte_s``), then for ``speculative_ttl_s``; ``None``: ``speculative_ttl_s``
    from the routing on (what the simulator did before 2026-11-28)."""
    index_capacity_blocks: int = _LIMITS.index_capacity_blocks
    """Prefix-index block budget (the service's ``limits.index_capacity_blocks``); LRU beyond it."""
    max_inflight_per_replica: int = _LIMITS.max_inflight_per_replica
    """A replica with this many requests in flight is not a candidate; all full → 429."""
    max_waiting: int = 4096
    """Replica waiting-queue cap (the emulator's ``max_waiting``); a full queue answers 503."""
    scrape_interval_s: float = 1.0
    """Engine-gauge scrape period, virtual seconds; 0 disables scraping (router-side load only)."""
    event_delay_s: float = 0.0
    """Delay between a cache change on a replica and its events reaching the index, seconds."""
    forward_delay_s: float = 0.0
    """Delay between routing a request and its arrival at the chosen replica, virtual seconds, the
    same for every request; must be finite and >= 0. The router counts the request as pending
    prefill from its decision, the replica starts it this much later, and its TTFT includes it. The
    emulated fleet at ``--time-scale`` 0.25 adds about 0.02 s of model time per 7,000-token chat
    prompt (docs/loadtest-history.md, "Where the fleet and the simulator part")."""
    forward_jitter_s: float = 0.0
    """Half-width of the hop's spread, virtual seconds: each request's hop is drawn uniformly from
    ``[forward_delay_s - forward_jitter_s, forward_delay_s + forward_jitter_s]``, one draw per routed
    request in routing order; must be finite, >= 0 and at most ``forward_delay_s``. 0 (the default):
    every request's hop is ``forward_delay_s``. The emulated fleet's hop at ``--time-scale`` 0.25 is
    about 0.005-0.012 s of model time on idle replicas and up to about 0.035 s under load
    (docs/policy-studies.md, Part 19)."""

    def resolved_profile(self) -> Profile:
        profile = get_profile(self.profile)
        if self.kv_capacity_tokens is not None:
            profile = profile.with_overrides(kv_capacity_tokens=self.kv_capacity_tokens)
        return profile

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__slots__}
        data["weights"] = self.weights.to_dict()
        return data


@dataclass(frozen=True, slots=True)
class SimResult:
    """A finished simulation."""

    summary: Summary
    records: RecordColumns
    virtual_s: float
    events: int
    stats: dict[str, Any]
    decisions: list[tuple[int, float, Decision]] = field(default_factory=list)
    """With ``keep_decisions``: each routed request's ``(record index, virtual time, decision)`` in
    routing order, the per-replica cost terms included (empty otherwise)."""


class Simulation:
    """One simulation run; build, then :meth:`run` once."""

    def __init__(
        self,
        config: SimConfig,
        requests: Iterable[SimRequest],
        hop_rng: random.Random | None = None,
        keep_decisions: bool = False,
    ) -> None:
        """``hop_rng`` draws each request's hop when ``config.forward_jitter_s`` > 0 (``None``: a
        generator seeded from ``config.seed``); it is not read otherwise. ``keep_decisions``: keep
        every routed request's decision in :attr:`SimResult.decisions` (one per request: for
        confirmation-sized runs, beside the fleet's saved decisions)."""
        if not math.isfinite(config.forward_delay_s) or config.forward_delay_s < 0:
            raise ValueError(f"forward_delay_s must be >= 0, got {config.forward_delay_s}")
        jitter = config.forward_jitter_s
        if not math.isfinite(jitter) or jitter < 0 or jitter > config.forward_delay_s:
            raise ValueError(f"forward_jitter_s must be in [0, forward_delay_s], got {jitter}")
        self.config = config
        self._hop_rng = hop_rng if hop_rng is not None else random.Random(f"kvlb-hop:{config.seed}")
        self.profile = config.resolved_profile()
        self.page_size = config.page_size or self.profile.page_size
        self.names = tuple(ReplicaId(f"r{i:04d}") for i in range(config.replicas))
        self._index_of = {name: i for i, name in enumerate(self.names)}
        self.loop = EventLoop()
        self.router = SimRouter(
            self.names,
            model=self.profile.model,
            block_size=self.page_size,
            policy=config.policy,
            weights=config.weights,
            rng=random.Random(config.seed),
            limits=TableLimits(capacity_blocks=config.index_capacity_blocks),
            max_inflight_per_replica=config.max_inflight_per_replica,
            speculative_ttl_s=config.speculative_ttl_s,
            pending_ttl_s=config.pending_ttl_s,
            prune=config.prune,
            prune_k=config.prune_k,
        )
        capacity = max(1, self.profile.kv_capacity_tokens // self.page_size)
        self.models: dict[ReplicaId, ReplicaModel] = {
            name: self._model(name, capacity) for name in self.names
        }
        self.records = RecordColumns(self.names)
        self.gaps = GapHistogram()
        self._requests: Iterator[SimRequest] = iter(requests)
        self._wakes: dict[ReplicaId, tuple[float, int]] = {}
        self._inflight = 0
        self._arrivals_left = True
        self._next_arrival_s: float | None = None
        self._events_applied = 0
        self._reported = 0
        self._decisions: list[tuple[int, float, Decision]] | None = [] if keep_decisions else None

    def _model(self, name: ReplicaId, capacity_blocks: int) -> ReplicaModel:
        size, waiting = self.page_size, self.config.max_waiting
        if self.config.replica_model == "fast":
            cache = BlockCache(page_size=size, capacity_blocks=capacity_blocks)
            return FastReplica(name, self.profile, cache, self, waiting)
        paged = PagedCache(page_size=size, capacity_blocks=capacity_blocks)
        return StepReplica(name, self.profile, paged, self, waiting)

    # ------------------------------------------------------------------------------------- run

    def run(self, progress: Callable[[int, float], None] | None = None, every: int = 100_000) -> SimResult:
        """Run until every request has ended; ``progress(requests, virtual_s)`` every ``every``."""
        self._next_arrival()
        if self.config.scrape_interval_s > 0:
            self.loop.schedule(self.loop.now_s, self._scrape)
        while self.loop.run(max_events=10_000):
            if progress is not None and len(self.records) // every != self._reported:
                self._reported = len(self.records) // every
                progress(len(self.records), self.loop.now_s)
        end_s = self.loop.now_s
        # throughputs over first arrival → last end, as the load test's first send → last byte (not
        # to the last scrape, up to one scrape interval later)
        summary = run_summary(self.records, self.gaps, self.records.span_s())
        decisions = self._decisions if self._decisions is not None else []
        return SimResult(summary, self.records, end_s, self.loop.processed, self._stats(), decisions)

    def _stats(self) -> dict[str, Any]:
        counters = self.router.counters
        table = self.router.space.table
        index = table.stats()
        routed = counters.pruned + counters.full
        return {
            "replica_model": self.config.replica_model,
            "page_size": self.page_size,
            "routed_pruned": counters.pruned,
            "routed_full": counters.full,
            "mean_candidates": counters.candidates / routed if routed else None,
            "refused_no_capacity": counters.refused,
            "kv_event_batches": self._events_applied,
            "index_unique_blocks": index.unique_blocks,
            "index_held_blocks": index.held_blocks,
            "index_evicted_blocks": table.counters.evicted_blocks,
            "speculative_confirmed": table.counters.speculative_confirmed,
            "speculative_expired": table.counters.speculative_expired,
            "replica_evicted_blocks": sum(m.cache.stats.evicted_blocks for m in self.models.values()),
        }

    def _next_arrival(self) -> None:
        request = next(self._requests, None)
        if request is None:
            self._arrivals_left = False
            self._next_arrival_s = None
            return
        self._next_arrival_s = max(self.loop.now_s, request.arrival_s)
        self.loop.schedule(self._next_arrival_s, self._arrive, request)

    def _arrive(self, request: SimRequest, now: float) -> None:
        index = self.records.add(now, len(request.token_ids))
        self._next_arrival()
        request_id = f"sim-{index}"
        try:
            plan = self.router.route(
                request_id, request.token_ids, request.max_tokens, request.session_id, now
            )
        except (Overloaded, NoReplicasAvailable):
            self.records.refuse(index, now, 429)
            return
        self.records.route(index, self._index_of[plan.decision.replica])
        if self._decisions is not None:
            self._decisions.append((index, now, plan.decision))
        self._inflight += 1
        routed = (index, request, plan)
        hop = self._hop()
        if hop > 0:
            self.loop.schedule(now + hop, self._submit, routed)
        else:
            self._submit(routed, now)

    def _hop(self) -> float:
        """This request's hop to its replica, virtual seconds (one draw when the hop is spread)."""
        delay, jitter = self.config.forward_delay_s, self.config.forward_jitter_s
        if jitter <= 0:
            return delay
        return self._hop_rng.uniform(delay - jitter, delay + jitter)

    def _submit(self, routed: tuple[int, SimRequest, RoutePlan], now: float) -> None:
        """A routed request reaches its replica (at once, or ``forward_delay_s`` after routing)."""
        index, request, plan = routed
        replica = plan.decision.replica
        model = self.models[replica]
        job = Job(index, request.token_ids, request.max_tokens)
        if len(plan.keys) == len(request.token_ids) // self.page_size:
            job.keys = list(plan.keys)  # the router hashed the prompt's pages already (same model, size)
        status = model.submit(job, now)
        if status is not None:
            self._inflight -= 1
            self.router.release(f"sim-{index}", replica, now)
            self.records.refuse(index, now, status)
            return
        self._reschedule(model)

    def _reschedule(self, model: ReplicaModel) -> None:
        wake = model.wake_s
        current = self._wakes.get(model.replica)
        if current is not None:
            if current[0] == wake:
                return
            self.loop.cancel(current[1])
            del self._wakes[model.replica]
        if wake is not None:
            self._wakes[model.replica] = (wake, self.loop.schedule(wake, self._wake, model))

    def _wake(self, model: ReplicaModel, now: float) -> None:
        self._wakes.pop(model.replica, None)
        model.advance(now)
        self._reschedule(model)

    def _scrape(self, _: Any, now: float) -> None:
        for name, model in self.models.items():
            self.router.observe(name, model.engine_stats(), now)
        if self._arrivals_left or self._inflight:
            self.loop.schedule(self._next_scrape_s(now), self._scrape)

    def _next_scrape_s(self, now: float) -> float:
        """The next scrape that can see anything new: ``now`` + one interval, or, while the fleet is
        idle (nothing in flight, no replica due to wake) until the next arrival, the last scrape of the
        same grid at or before that arrival. An idle replica's gauges do not change and a scrape only
        overwrites the last one, so the scrapes skipped would have written what that one writes: the
        run is the same, without one event per interval over idle time (a trace's quiet hours, or a
        low ``--rate``)."""
        interval = self.config.scrape_interval_s
        next_s = now + interval
        arrival_s = self._next_arrival_s
        if self._inflight or self._wakes or arrival_s is None or next_s + interval > arrival_s:
            return next_s
        steps = (arrival_s - next_s) // interval
        if steps > _GRID_STEPS_MAX:  # far beyond any trace: the grid's float sums are not worth it
            return next_s + (steps - 1) * interval
        while next_s + interval <= arrival_s:  # the same float sums as one scrape after another
            next_s += interval
        return next_s

    # ------------------------------------------------------------------------ replica sink

    def first_token(self, replica: ReplicaId, job: Job, now: float) -> None:
        self.records.first_token(job.index, now)
        self.router.first_token(f"sim-{job.index}", replica, now)

    def finished(self, replica: ReplicaId, job: Job, now: float) -> None:
        self.records.finish(job.index, now, job.cached_tokens, job.max_tokens)
        self.router.release(f"sim-{job.index}", replica, now)
        self._inflight -= 1

    def cache_changed(self, replica: ReplicaId, events: list[KvEvent], now: float) -> None:
        if self.config.event_delay_s > 0:
            self.loop.schedule(now + self.config.event_delay_s, self._apply, (replica, events))
        else:
            self._apply((replica, events), now)

    def _apply(self, item: tuple[ReplicaId, list[KvEvent]], now: float) -> None:
        self.router.apply(item[0], item[1], now)
        self._events_applied += 1

    def decode_gaps(self, gap_s: float, count: int) -> None:
        self.gaps.add(gap_s, count)


def simulate(
    config: SimConfig, requests: Iterable[SimRequest], hop_rng: random.Random | None = None
) -> SimResult:
    """Run one simulation to the end (``hop_rng``: as :class:`Simulation`'s)."""
    if config.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {config.replicas}")
    if not math.isfinite(config.scrape_interval_s) or config.scrape_interval_s < 0:
        raise ValueError(f"scrape_interval_s must be >= 0, got {config.scrape_interval_s}")
    return Simulation(config, requests, hop_rng).run()
