"""Core vocabulary shared by every layer (pure).

Two kinds of hash never mix:

* ``BlockKey``: the router-owned key of one full block of tokens, chained over its parent
  (see :mod:`balancer.index.hashing`). Requests and stored events both map to it; routing uses only it.
* ``EngineHash``: the engine's own handle for a block (SGLang, vLLM, TRT-LLM), normalised to u64.
  It is only ever used to find the ``BlockKey`` of a parent or of a removed block.

A replica is one engine endpoint; an engine with data parallelism keeps one independent KV cache per
DP rank, so the index tracks holders per cache = (replica, dp_rank) and reports overlap per replica
as the best of its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

from balancer.frozen import quick_init

ReplicaId = NewType("ReplicaId", str)
BlockKey = NewType("BlockKey", int)
EngineHash = NewType("EngineHash", int)

U64_MASK = (1 << 64) - 1


def to_u64(value: int) -> int:
    """Normalise a signed i64 or an unsigned u64 hash to u64 (two's complement)."""
    return value & U64_MASK


@quick_init
@dataclass(frozen=True, slots=True)
class Overlap:
    """Result of a prefix match: leading full blocks each replica already holds.

    ``blocks`` has an entry for every replica asked about (0 when it holds nothing);
    ``best_rank`` names the DP rank that holds the longest prefix on that replica.
    """

    blocks: dict[ReplicaId, int]
    best_rank: dict[ReplicaId, int] = field(default_factory=dict)
    request_blocks: int = 0
    speculative_blocks: dict[ReplicaId, int] = field(default_factory=dict)
    """Part of ``blocks`` backed only by speculative entries: blocks a request routed there earlier is
    still prefilling. Work the new request shares rather than waits behind (see the cost policy)."""
    held_blocks: dict[ReplicaId, int] = field(default_factory=dict)
    """Blocks each replica's caches hold in all (any prompt), from its KV events: with the pool size
    this gives how full its cache is (absent when the index did not say)."""
    held_roots: dict[ReplicaId, int] = field(default_factory=dict)
    """Distinct prompt chains each replica's caches hold the root (first block) of, speculative
    entries included (``PrefixTable.held_roots``): how many contexts it homes. Filled only when a
    policy weight reads it; absent: unknown."""

    def of(self, replica: ReplicaId) -> int:
        """Overlap of one replica in blocks (0 when unknown)."""
        return self.blocks.get(replica, 0)


@quick_init
@dataclass(frozen=True, slots=True)
class CostTerms:
    """The per-replica terms of one routing decision, in blocks unless named otherwise.

    ``cost`` is what the policy minimised (``None`` for policies that do not score, e.g. round
    robin). ``excluded`` gives the reason a replica was not eligible (guard, unhealthy, ...).
    """

    replica: ReplicaId
    overlap_blocks: int
    request_blocks: int
    pending_prefill_blocks: float
    active_decode_blocks: float
    waiting_requests: float
    kv_usage: float | None
    prefill_term: float
    decode_term: float
    queue_term: float
    cost: float | None
    probability: float | None = None
    excluded: str | None = None
    shared_pending_blocks: float = 0.0
    """Pending prefill blocks not counted as load because this request shares them (speculative)."""
    duplication_term: float = 0.0
    """The cost policy's charge for the blocks this request would insert into the replica's cache,
    scaled by how full it is (each one then evicts a block that other requests may reuse)."""
    interference_term: float = 0.0
    """The cost policy's charge for the blocks this request would insert into the replica's cache,
    times the requests decoding there (each prefilled block delays every one of them)."""
    cache_pressure: float | None = None
    """0..1: how full the replica's cache is, as the duplication charge scales it (``None``: unknown)."""
    overlap_survival: float = 1.0
    """0..1: the share of ``overlap_blocks`` the cost policy credited, after its eviction-risk
    discount (1 when the discount is off or the replica cannot evict before admission)."""
    overlap_credit: float | None = None
    """The cost policy's overlap credit for this replica in this decision: ``overlap_credit``, or
    between it and ``overlap_credit_loaded`` by the fleet's load, or 0 when the imbalance guard
    withdrew it (``None`` for policies without a credit)."""
    admission_term: float = 0.0
    """The cost policy's charge for the KV blocks the replica would have to free before admitting
    this request, when it holds none of its prompt (0 when the charge is off or unknown)."""
    root_term: float = 0.0
    """The cost policy's held-roots charge: on a replica holding none of this request's prompt,
    ``w_prefill · min(root_cap_prompts, root_weight · (held_roots − fewest)) · request_blocks``, the
    fewest being the least held roots among the eligible candidates (0 when off or unknown)."""
    held_roots: int | None = None
    """Distinct prompt roots the replica's caches hold (speculative ones included) as the held-roots
    charge read them; ``None`` when the charge is off or the index did not say."""


@quick_init
@dataclass(frozen=True, slots=True)
class Decision:
    """A routing choice and why it was made.

    ``terms`` holds one :class:`CostTerms` per candidate replica, so any decision can be explained
    (``/admin/explain``, debug logs, ``x-kvlb-*`` headers). ``cached_tokens`` is the predicted prefix
    reuse on the chosen replica.
    """

    replica: ReplicaId
    policy: str
    overlap_blocks: int
    request_blocks: int
    cached_tokens: int
    terms: tuple[CostTerms, ...]
    dp_rank: int = 0
    reason: str = ""
    ramp_share: float | None = None
    """The cost policy's averaged share of replicas prefilling that this decision's credit read
    (``PolicyWeights.ramp_memory_s``), advanced to this decision's time (its load snapshot's
    ``now``): the router keeps it, with that time, as its new average when it commits the decision.
    ``None`` when the ramp has no memory (or the policy no ramp)."""
    busy_share: float | None = None
    """The share of eligible replicas with prefill in flight that this decision saw, when the
    credit's ramp has a memory in seconds (``None`` otherwise): the router keeps it with the average
    as the sample held until the next decision (``RouteRequest.ramp_last_share``)."""
