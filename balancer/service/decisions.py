"""The console's decision ring (pure): recent committed decisions per pool, with their inputs.

Each :class:`DecisionRecord` keeps what the policy read (:class:`~balancer.policy.base.PolicyInputs`:
the request's candidates and size, the per-replica prefix matches, the load snapshot), the weights
and policy that decided, and the decision with its per-replica cost terms. They are references to
objects the router built anyway (frozen; nothing is copied), so recording at commitment costs one
small object and a deque append. ``/admin/decisions`` lists them and ``/admin/whatif``
(:mod:`balancer.service.whatif`) re-runs policies on them.

Bounded twice per pool: ``console.decision_ring_size`` entries and ``console.decision_ring_bytes``
estimated bytes; the oldest entries go first, counted by the bound that evicted them. Ids are
monotonic across pools (one :class:`DecisionLog`), so a client can poll with ``since_id``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from balancer.policy.base import PolicyInputs, PolicyWeights
from balancer.types import CostTerms, Decision, ReplicaId

ENTRY_BASE_BYTES = 1_200
"""Estimated bytes of one record before its replicas: the record, request, overlap, snapshot and
decision objects and their empty dicts (measured with tracemalloc, tests/unit/test_decisions.py)."""
REPLICA_BYTES = 700
"""Estimated bytes per replica in one record: its cost terms, its load and its dict entries."""
MAX_TENANT_CHARS = 128
"""A tenant header value is cut to this many characters."""


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One committed decision and what it was decided on."""

    id: int
    wall_ts: float
    """Wall-clock seconds since the epoch at commitment."""
    pool: str
    tenant: str | None
    policy: str
    """Policy name in force (the decision's own ``policy``)."""
    weights: PolicyWeights
    inputs: PolicyInputs
    decision: Decision
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens predicted cached on the chosen replica (its own block size)."""
    nbytes: int

    @property
    def replica(self) -> ReplicaId:
        return self.decision.replica


def estimate_bytes(inputs: PolicyInputs, decision: Decision, tenant: str | None) -> int:
    """A record's estimated size: :data:`ENTRY_BASE_BYTES` + :data:`REPLICA_BYTES` per replica named
    by its terms or its load snapshot, plus its strings."""
    replicas = len(decision.terms) + len(inputs.load.replicas)
    extra = len(tenant or "") + len(inputs.request.session_key or "") + len(inputs.request.request_id or "")
    return ENTRY_BASE_BYTES + REPLICA_BYTES * replicas + extra


@dataclass(slots=True)
class RingStats:
    entries: int = 0
    bytes: int = 0
    evicted_count: int = 0
    evicted_bytes: int = 0


@dataclass(slots=True)
class DecisionRing:
    """One pool's recent decisions, oldest first, bounded in count and estimated bytes."""

    max_entries: int
    max_bytes: int
    entries: deque[DecisionRecord] = field(default_factory=deque)
    stats: RingStats = field(default_factory=RingStats)

    def append(self, record: DecisionRecord) -> tuple[int, int]:
        """Add ``record`` and evict what the bounds require; returns (evicted by count, by bytes)."""
        stats = self.stats
        if self.max_entries <= 0:
            stats.evicted_count += 1
            return 1, 0
        self.entries.append(record)
        stats.entries += 1
        stats.bytes += record.nbytes
        by_count = by_bytes = 0
        while stats.entries > self.max_entries:
            self._pop()
            by_count += 1
        while stats.bytes > self.max_bytes and stats.entries > 0:
            self._pop()
            by_bytes += 1
        stats.evicted_count += by_count
        stats.evicted_bytes += by_bytes
        return by_count, by_bytes

    def _pop(self) -> None:
        old = self.entries.popleft()
        self.stats.entries -= 1
        self.stats.bytes -= old.nbytes

    def snapshot(self, last: int | None = None) -> list[DecisionRecord]:
        """A copy of the newest ``last`` entries (all when ``None``), oldest first: a list of
        references to frozen records, safe to read from another thread."""
        if last is None or last >= len(self.entries):
            return list(self.entries)
        if last <= 0:
            return []
        entries = self.entries
        return [entries[i] for i in range(len(entries) - last, len(entries))]

    def newest_first(self) -> Iterator[DecisionRecord]:
        return reversed(self.entries)


class DecisionLog:
    """Every pool's ring and the one id counter; ``on_evict(pool, reason, n)`` reports evictions
    and ``on_ring(pool, ring)`` each new ring (metrics: gauges that read its stats when scraped)."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        *,
        on_evict: Callable[[str, str, int], None] | None = None,
        on_ring: Callable[[str, DecisionRing], None] | None = None,
        id_offset: int = 0,
        id_step: int = 1,
    ) -> None:
        """``id_offset``/``id_step``: the ids of worker ``i`` of ``kvlb serve --workers N`` are
        ``i + 1``, ``i + 1 + N``, … so that no two workers give one id to different decisions (each
        worker keeps its own ring: another worker's id is a 404 there, never another decision)."""
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.rings: dict[str, DecisionRing] = {}
        self._id_step = max(1, id_step)
        self._next_id = id_offset + 1 - self._id_step
        self._on_evict = on_evict
        self._on_ring = on_ring

    def ring(self, pool: str) -> DecisionRing:
        ring = self.rings.get(pool)
        if ring is None:
            ring = self.rings[pool] = DecisionRing(self.max_entries, self.max_bytes)
            if self._on_ring is not None:
                self._on_ring(pool, ring)
        return ring

    def record(
        self,
        pool: str,
        inputs: PolicyInputs,
        decision: Decision,
        weights: PolicyWeights,
        prompt_tokens: int,
        cached_tokens: int,
        tenant: str | None,
        wall_ts: float,
    ) -> DecisionRecord:
        """Append one committed decision to ``pool``'s ring; returns the record (with its id)."""
        self._next_id += self._id_step
        if tenant is not None and len(tenant) > MAX_TENANT_CHARS:
            tenant = tenant[:MAX_TENANT_CHARS]
        record = DecisionRecord(
            id=self._next_id,
            wall_ts=wall_ts,
            pool=pool,
            tenant=tenant,
            policy=decision.policy,
            weights=weights,
            inputs=inputs,
            decision=decision,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            nbytes=estimate_bytes(inputs, decision, tenant),
        )
        by_count, by_bytes = self.ring(pool).append(record)
        if self._on_evict is not None and (by_count or by_bytes):
            if by_count:
                self._on_evict(pool, "count", by_count)
            if by_bytes:
                self._on_evict(pool, "bytes", by_bytes)
        return record

    def find(self, record_id: int) -> DecisionRecord | None:
        """The record with ``record_id`` (a binary search per ring: ids grow along each ring)."""
        for ring in self.rings.values():
            entries = ring.entries
            low, high = 0, len(entries) - 1
            while low <= high:
                mid = (low + high) // 2
                found = entries[mid]
                if found.id == record_id:
                    return found
                if found.id < record_id:
                    low = mid + 1
                else:
                    high = mid - 1
        return None

    def query(
        self,
        *,
        pool: str | None = None,
        replica: str | None = None,
        tenant: str | None = None,
        since_id: int = 0,
        limit: int = 100,
    ) -> list[DecisionRecord]:
        """Newest first: records with ``id > since_id`` matching every filter given, at most ``limit``."""
        rings = [self.rings[pool]] if pool is not None and pool in self.rings else []
        if pool is None:
            rings = list(self.rings.values())
        found: list[DecisionRecord] = []
        for ring in rings:
            taken = 0
            for record in ring.newest_first():
                if record.id <= since_id or taken >= limit:
                    break
                if replica is not None and record.decision.replica != replica:
                    continue
                if tenant is not None and record.tenant != tenant:
                    continue
                found.append(record)
                taken += 1
        found.sort(key=lambda r: r.id, reverse=True)
        return found[:limit]


def terms_by_replica(terms: tuple[CostTerms, ...]) -> dict[str, dict[str, object]]:
    """``{replica: {term: value}}`` of a decision's cost terms (JSON-able)."""
    out: dict[str, dict[str, object]] = {}
    for t in terms:
        out[t.replica] = {
            "cost": t.cost,
            "overlap_blocks": t.overlap_blocks,
            "request_blocks": t.request_blocks,
            "prefill_term": t.prefill_term,
            "duplication_term": t.duplication_term,
            "interference_term": t.interference_term,
            "admission_term": t.admission_term,
            "decode_term": t.decode_term,
            "queue_term": t.queue_term,
            "pending_prefill_blocks": t.pending_prefill_blocks,
            "shared_pending_blocks": t.shared_pending_blocks,
            "active_decode_blocks": t.active_decode_blocks,
            "waiting_requests": t.waiting_requests,
            "kv_usage": t.kv_usage,
            "cache_pressure": t.cache_pressure,
            "overlap_survival": t.overlap_survival,
            "overlap_credit": t.overlap_credit,
            "probability": t.probability,
            "excluded": t.excluded,
        }
    return out
