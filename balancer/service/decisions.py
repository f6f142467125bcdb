"""The console's decision ring (pure): recent committed decisions per pool, with their inputs.

Each :class:`DecisionRecord` keeps what the policy read (:class:`~balancer.policy.base.PolicyInputs`:
the request's candidates and size, the per-replica prefix matches, the load snapshot), the weights
and policy that decided, and the decision with its per-replica cost terms. The ring keeps
each one packed (:class:`PackedRecord`): its fields' values in one ``marshal`` blob, plus the few a
query filters on. Kept as the router built them (about 16 objects the garbage collector tracks per
record), 10,000 records made every full collection of a serving process walk about 160,000 more
objects: about 80 ms with every request in flight stalled, against about 5 ms packed, and half the
collector's CPU (docs/benchmark-history.md, "round 11"); a blob is no container, so the collector does not
see it. A record is rebuilt on read, equal field for field (the blob holds plain
numbers, strings, tuples and dicts); a record whose values ``marshal`` cannot hold exactly is kept
as it is. ``/admin/decisions`` lists them and ``/admin/whatif`` (:mod:`balancer.service.whatif`)
re-runs policies on them.

Bounded twice per pool: ``console.decision_ring_size`` entries and ``console.decision_ring_bytes``
estimated bytes; the oldest entries go first, counted by the bound that evicted them. Ids are
monotonic across pools (one :class:`DecisionLog`), so a client can poll with ``since_id``. With
``kvlb serve --workers N`` each worker's ids grow at its own pace, so a poll's cursor is one id per
worker (:func:`own_since`, :func:`next_since`).
"""

from __future__ import annotations

import marshal
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from operator import attrgetter
from typing import Any, NamedTuple, overload

from balancer.frozen import quick_init
from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.policy.base import PolicyInputs, PolicyWeights, RouteRequest
from balancer.routing.left_out import LeftOut
from balancer.types import CostTerms, Decision, Overlap, ReplicaId

ENTRY_BASE_BYTES = 1_200
"""Estimated bytes of one record before its replicas: the record, request, overlap, snapshot and
decision objects and their empty dicts (measured with tracemalloc, tests/unit/test_decisions.py)."""
REPLICA_BYTES = 700
"""Estimated bytes per replica in one record: its cost terms, its load and its dict entries."""
LEFT_OUT_BYTES = 80
"""Estimated bytes per replica a record left out (:attr:`DecisionRecord.left_out`: a pair of its id
and a small int code, about 64 B and its slot as the router builds it; 19 B traced packed, with
ids of 9 characters: tests/unit/test_decisions.py)."""
MARK_BYTES = 100
"""Estimated bytes per prefix mark of a record (``RouteRequest.prefix_marks``: a tuple of two ints
and its slot, about 90 B as the router builds it; 10 to 18 B packed)."""
MAX_TENANT_CHARS = 128
"""A tenant header value is cut to this many characters."""
MARSHAL_VERSION = 2
"""The ``marshal`` format a record is packed in. From version 3 ``marshal`` notes every object it
writes that has another reference (small ints, shared strings, a prompt's block keys) in a table, so
that a second sight is written as a back-reference: for a record's few hundred values the table
cost more than it saved. A 8k-token prompt's record (56 prefix marks of 64-bit keys) took 110,000
instructions to pack at version 4, 84,000 at version 2, about 17% more bytes (unread by the byte
bound, which is an estimate). ``marshal.loads`` reads every version."""


@quick_init
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
    decode_blocks: int = 0
    """KV blocks the request committed to the replica's decode load (uncached prompt plus
    ``sequences × max_tokens``, the pool's reference blocks)."""
    sequences: int = 1
    """OpenAI's ``n`` of the request."""
    prefill_s: float | None = None
    """Seconds from the decision (its load snapshot's ``now``) to the request's first token, when its
    prefill load became decode load on the replica (:meth:`DecisionLog.on_phase`); ``None`` before it
    (or when the request ended without one). The what-if moves that load for this span."""
    held_s: float | None = None
    """Seconds from the decision to the release of its load (the request's end, or its failure);
    ``None`` while it is in flight."""
    left_out: LeftOut = ()
    """The pool's replicas that were not candidates, each with its reason's code
    (:mod:`balancer.routing.left_out`: draining, failing health probes, breaker open, full, …)."""

    @property
    def replica(self) -> ReplicaId:
        return self.decision.replica


def estimate_bytes(
    inputs: PolicyInputs, decision: Decision, tenant: str | None, left_out: LeftOut = ()
) -> int:
    """A record's estimated size: :data:`ENTRY_BASE_BYTES` + :data:`REPLICA_BYTES` per replica named
    by its terms or its load snapshot + :data:`MARK_BYTES` per prefix mark + :data:`LEFT_OUT_BYTES`
    per replica left out, plus its strings."""
    replicas = len(decision.terms) + len(inputs.load.replicas)
    extra = len(tenant or "") + len(inputs.request.session_key or "") + len(inputs.request.request_id or "")
    extra += MARK_BYTES * len(inputs.request.prefix_marks)
    if left_out:
        extra += LEFT_OUT_BYTES * len(left_out)
    return ENTRY_BASE_BYTES + REPLICA_BYTES * replicas + extra


def _values(cls: type) -> Callable[[Any], tuple[Any, ...]]:
    """Every field's value of an instance of the dataclass ``cls``, in field order (one C call)."""
    getter: Callable[[Any], tuple[Any, ...]] = attrgetter(*[f.name for f in fields(cls)])
    return getter  # (each class has several fields: attrgetter gives a tuple)


_REQUEST_VALUES = _values(RouteRequest)
_OVERLAP_VALUES = _values(Overlap)
_LOAD_VALUES = _values(ReplicaLoad)
_TERMS_VALUES = _values(CostTerms)
_SNAPSHOT_FIELDS = [f.name for f in fields(LoadSnapshot)]
_DECISION_FIELDS = [f.name for f in fields(Decision)]
_SNAPSHOT_REPLICAS = _SNAPSHOT_FIELDS.index("replicas")
_DECISION_TERMS = _DECISION_FIELDS.index("terms")
_SNAPSHOT_OTHERS = attrgetter(*[n for n in _SNAPSHOT_FIELDS if n != "replicas"])
_DECISION_OTHERS = attrgetter(*[n for n in _DECISION_FIELDS if n != "terms"])


class PackedRecord(NamedTuple):
    """One :class:`DecisionRecord` as the ring keeps it: what queries filter on, the weights (a
    reference: one object shared by every decision made under them), and the rest packed in a
    ``marshal`` blob (:func:`pack`), or the record itself when it could not be packed exactly."""

    id: int
    nbytes: int
    replica: ReplicaId
    tenant: str | None
    weights: PolicyWeights
    packed: bytes | DecisionRecord
    prefill_s: float | None = None
    """:attr:`DecisionRecord.prefill_s`, set after the record was packed (:meth:`DecisionRing.amend`)."""
    held_s: float | None = None
    """:attr:`DecisionRecord.held_s`, likewise."""

    def record(self) -> DecisionRecord:
        """The record, rebuilt (equal to the one recorded, field for field)."""
        packed = self.packed
        if not isinstance(packed, DecisionRecord):
            return unpack(self)
        if packed.prefill_s == self.prefill_s and packed.held_s == self.held_s:
            return packed
        return replace(packed, prefill_s=self.prefill_s, held_s=self.held_s)


def pack(record: DecisionRecord) -> PackedRecord:
    """``record`` as the ring keeps it. ``marshal`` takes exactly the plain ``int``, ``float``,
    ``bool``, ``str``, ``None``, ``tuple`` and ``dict`` values the router and the policies build and
    gives them back as they were (floats bit for bit); it refuses a subclass of those (an enum, a
    named tuple) and any other object, and the record is then kept as it is. (It would turn a
    ``bytearray``, ``memoryview`` or ``array`` into ``bytes``: no field of a record holds one.)"""
    inputs, decision = record.inputs, record.decision
    load = inputs.load
    values = (
        record.wall_ts,
        record.pool,
        record.policy,
        record.prompt_tokens,
        record.cached_tokens,
        record.decode_blocks,
        record.sequences,
        _REQUEST_VALUES(inputs.request),
        _OVERLAP_VALUES(inputs.overlap),
        _SNAPSHOT_OTHERS(load),
        tuple(load.replicas),
        tuple(map(_LOAD_VALUES, load.replicas.values())),
        _DECISION_OTHERS(decision),
        tuple(map(_TERMS_VALUES, decision.terms)),
        record.left_out,
    )
    packed: bytes | DecisionRecord
    try:
        packed = marshal.dumps(values, MARSHAL_VERSION)
    except ValueError:  # a value marshal cannot hold: keep the record itself
        packed = record
    return PackedRecord(
        record.id,
        record.nbytes,
        decision.replica,
        record.tenant,
        record.weights,
        packed,
        record.prefill_s,
        record.held_s,
    )


def unpack(entry: PackedRecord) -> DecisionRecord:
    """The :class:`DecisionRecord` ``entry`` packs (:func:`pack`)."""
    assert isinstance(entry.packed, bytes)
    (
        wall_ts,
        pool,
        policy,
        prompt_tokens,
        cached_tokens,
        decode_blocks,
        sequences,
        request,
        overlap,
        snapshot_others,
        replicas,
        loads,
        decision_others,
        terms,
        left_out,
    ) = marshal.loads(entry.packed)
    snapshot = list(snapshot_others)
    snapshot.insert(
        _SNAPSHOT_REPLICAS, dict(zip(replicas, [ReplicaLoad(*values) for values in loads], strict=True))
    )
    decision = list(decision_others)
    decision.insert(_DECISION_TERMS, tuple([CostTerms(*values) for values in terms]))
    inputs = PolicyInputs(RouteRequest(*request), Overlap(*overlap), LoadSnapshot(*snapshot))
    return DecisionRecord(
        id=entry.id,
        wall_ts=wall_ts,
        pool=pool,
        tenant=entry.tenant,
        policy=policy,
        weights=entry.weights,
        inputs=inputs,
        decision=Decision(*decision),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        nbytes=entry.nbytes,
        decode_blocks=decode_blocks,
        sequences=sequences,
        prefill_s=entry.prefill_s,
        held_s=entry.held_s,
        left_out=left_out,
    )


class RecordList(Sequence[DecisionRecord]):
    """Packed records read as :class:`DecisionRecord` s, each rebuilt when it is read (so a what-if
    replay rebuilds them in its own thread, not on the event loop). Immutable."""

    __slots__ = ("_entries",)

    def __init__(self, entries: Sequence[PackedRecord]) -> None:
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    @overload
    def __getitem__(self, index: int) -> DecisionRecord: ...

    @overload
    def __getitem__(self, index: slice) -> RecordList: ...

    def __getitem__(self, index: int | slice) -> DecisionRecord | RecordList:
        if isinstance(index, slice):
            return RecordList(self._entries[index])
        return self._entries[index].record()

    def __iter__(self) -> Iterator[DecisionRecord]:
        for entry in self._entries:
            yield entry.record()

    def __eq__(self, other: object) -> bool:
        """Equal to a list (or another :class:`RecordList`) of equal records in the same order."""
        if not isinstance(other, list | RecordList):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]


@dataclass(slots=True)
class RingStats:
    entries: int = 0
    bytes: int = 0
    evicted_count: int = 0
    evicted_bytes: int = 0


@dataclass(slots=True)
class DecisionRing:
    """One pool's recent decisions, oldest first, bounded in count and estimated bytes (packed:
    :class:`PackedRecord`)."""

    max_entries: int
    max_bytes: int
    entries: deque[PackedRecord] = field(default_factory=deque)
    stats: RingStats = field(default_factory=RingStats)

    def append(self, record: PackedRecord) -> tuple[int, int]:
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

    def amend(self, record_id: int, prefill_s: float | None, held_s: float | None, id_step: int = 1) -> bool:
        """Set the spans of the entry with ``record_id`` (a ``None`` keeps the one it has); ``False``
        when it is no longer in the ring. Where the ids of this ring follow each other by
        ``id_step`` (one pool per log) the entry is found at once, counted from the newest end,
        where the requests that end are; else by a binary search on the ids, which grow along it."""
        entries = self.entries
        if not entries:
            return False
        index = len(entries) - 1 - (entries[-1].id - record_id) // max(1, id_step)
        if not (0 <= index < len(entries) and entries[index].id == record_id):
            index = self._index(record_id)
            if index < 0:
                return False
        found = entries[index]
        entries[index] = PackedRecord(
            found.id,
            found.nbytes,
            found.replica,
            found.tenant,
            found.weights,
            found.packed,
            found.prefill_s if prefill_s is None else prefill_s,
            found.held_s if held_s is None else held_s,
        )
        return True

    def _index(self, record_id: int) -> int:
        """The position of the entry with ``record_id`` (-1: none)."""
        entries = self.entries
        low, high = 0, len(entries) - 1
        while low <= high:
            mid = (low + high) // 2
            found = entries[mid].id
            if found == record_id:
                return mid
            if found < record_id:
                low = mid + 1
            else:
                high = mid - 1
        return -1

    def _pop(self) -> None:
        old = self.entries.popleft()
        self.stats.entries -= 1
        self.stats.bytes -= old.nbytes

    def snapshot(self, last: int | None = None) -> RecordList:
        """A copy of the newest ``last`` entries (all when ``None``), oldest first, safe to read from
        another thread (each record is rebuilt when read there)."""
        if last is None or last >= len(self.entries):
            return RecordList(list(self.entries))
        if last <= 0:
            return RecordList([])
        entries = self.entries
        return RecordList([entries[i] for i in range(len(entries) - last, len(entries))])

    def newest_first(self) -> Iterator[PackedRecord]:
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
        self.worker_index = id_offset
        """This log's worker of ``kvlb serve --workers N`` (0 with one process)."""
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
        decode_blocks: int = 0,
        sequences: int = 1,
        left_out: LeftOut = (),
    ) -> DecisionRecord:
        """Append one committed decision to ``pool``'s ring; returns the record (with its id).
        ``left_out``: the pool's replicas that were not candidates, and why (codes)."""
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
            nbytes=estimate_bytes(inputs, decision, tenant, left_out),
            decode_blocks=decode_blocks,
            sequences=sequences,
            left_out=left_out,
        )
        by_count, by_bytes = self.ring(pool).append(pack(record))
        if self._on_evict is not None and (by_count or by_bytes):
            if by_count:
                self._on_evict(pool, "count", by_count)
            if by_bytes:
                self._on_evict(pool, "bytes", by_bytes)
        return record

    def on_phase(self, pool: str, record_id: int, decided_s: float, now: float, released: bool) -> None:
        """The request of record ``record_id`` of ``pool``, decided at ``decided_s`` (its load
        snapshot's ``now``), reached its first token (``released`` false) or its end at ``now`` (the
        same clock): keep the span in the record (:attr:`DecisionRecord.prefill_s`, ``held_s``), if
        it is still in the ring."""
        ring = self.rings.get(pool)
        if ring is None:
            return
        span_s = max(0.0, now - decided_s)
        if released:
            ring.amend(record_id, None, span_s, self._id_step)
        else:
            ring.amend(record_id, span_s, None, self._id_step)

    def find(self, record_id: int) -> DecisionRecord | None:
        """The record with ``record_id`` (a binary search per ring: ids grow along each ring)."""
        for ring in self.rings.values():
            entries = ring.entries
            low, high = 0, len(entries) - 1
            while low <= high:
                mid = (low + high) // 2
                found = entries[mid]
                if found.id == record_id:
                    return found.record()
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
        found: list[PackedRecord] = []
        for ring in rings:
            taken = 0
            for entry in ring.newest_first():
                if entry.id <= since_id or taken >= limit:
                    break
                if replica is not None and entry.replica != replica:
                    continue
                if tenant is not None and entry.tenant != tenant:
                    continue
                found.append(entry)
                taken += 1
        found.sort(key=lambda r: r.id, reverse=True)
        return [entry.record() for entry in found[:limit]]


def own_since(since: Sequence[int], worker: int) -> int:
    """Worker ``worker``'s threshold in a ``since_id`` cursor: the one id given (every worker's, as
    with one process), or the worker's entry of one per worker (0, all, when the list has none)."""
    if len(since) == 1:
        return since[0]
    return since[worker] if worker < len(since) else 0


def next_since(since: Sequence[int], workers: int, listed: Iterable[tuple[int, int]]) -> str:
    """The ``since_id`` to poll with next, after an answer listing ``(worker, id)`` pairs to a query
    with the cursor ``since``: per worker, the highest of its threshold and its ids listed, joined by
    commas (one worker: one id, the form a single process has always taken)."""
    cursor = [own_since(since, worker) for worker in range(workers)]
    for worker, record_id in listed:
        if 0 <= worker < workers:
            cursor[worker] = max(cursor[worker], record_id)
    return ",".join(str(c) for c in cursor)


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
            "root_term": t.root_term,
            "held_roots": t.held_roots,
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
