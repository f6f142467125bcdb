"""Routing for one pool: candidates → hash → match → load snapshot → policy → commitment (pure).

:meth:`PoolRouter.route` is the whole decision for one request: the candidates (the pool's routable
replicas, from the shared :class:`~balancer.health.book.HealthBook`, below
``limits.max_inflight_per_replica``), the plan, and the commitment, returned as a :class:`Lease` that
the caller releases when the request ends. :meth:`PoolRouter.select` is the same decision without the
commitment (explain, gRPC ``Route`` without ``reserve``). In-flight requests are counted once, as the
load tracker's reservations: the per-replica cap reads them (with ``kvlb serve --workers N``, plus the
other workers' from the shared load table), and the lease releases them.

A pool is every replica serving one model. Replicas whose engines cache differently (block size,
TRT-LLM's ``prompt[:-1]`` alignment, EAGLE bigram pages) cannot share block keys, so the pool keeps
one :class:`KeySpace` (hasher + prefix table) per caching scheme; a replica's scheme is its block size
and the alignment its engine's spec gives (:mod:`balancer.engines`). A request is hashed once per key
space that has candidates, and the overlaps are merged into one :class:`~balancer.types.Overlap`
counted in the pool's *reference* block size (the smallest block size in the pool), so the cost
policy compares like with like.

:meth:`PoolRouter.plan` is side-effect free (it may only expire stale speculative entries inside the
table). :meth:`PoolRouter.commit` reserves load, keeps the decision's averaged busy share (the credit
ramp's memory, :attr:`PoolRouter.ramp_average`) and adds speculative index entries afterwards, and
:meth:`PoolRouter.release` undoes the reservation when the request ends or is cancelled.

Speculative entries live in two phases. Until the request's first token the engine has not finished
its prefill, so it cannot have reported the blocks yet: the entries are held for ``pending_ttl_s``
(bounded by the first-byte timeout). At the first token, or when the request ends without one, they
drop to the short ``speculative_ttl_s``, within which the engine's own events confirm them.

Decode load counts a request's *private* blocks only (uncached prompt plus output): its cached prefix
is shared with every other request on that replica that uses it, and counting it per request made a
few same-prefix requests outweigh the affinity that brought them there.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from balancer.errors import NoReplicasAvailable, Overloaded
from balancer.frozen import quick_init
from balancer.health.book import HealthBook
from balancer.index.hashing import AlignMode, BlockHasher, KeyMemo, full_blocks
from balancer.index.locked import LockedPrefixTable
from balancer.index.marks import prefix_marks
from balancer.index.slots import TableLimits
from balancer.index.table import PrefixTable
from balancer.load.tracker import LoadConfig, LoadCounts, LoadSnapshot, LoadTracker
from balancer.policy.base import Policy, PolicyInputs, PolicyWeights, RouteRequest
from balancer.policy.cost import ShareAverage
from balancer.routing.left_out import ALREADY_TRIED, FULL, LeftOut, reason_code
from balancer.routing.receipts import ReceiptBook, Settled, read_receipt
from balancer.types import BlockKey, Decision, EngineHash, Overlap, ReplicaId

FULL_RETRY_AFTER_S = 1.0
"""``Retry-After`` of the refusal when every routable replica is at its in-flight cap (seconds)."""


@dataclass(slots=True)
class KeySpace:
    """Replicas that cache blocks the same way, and the prefix table of their blocks."""

    hasher: BlockHasher
    table: PrefixTable
    replicas: set[ReplicaId] = field(default_factory=set)
    memo: KeyMemo = field(default_factory=KeyMemo)
    """Keys of recently hashed runs of blocks (shared prefixes are hashed once)."""


@quick_init
@dataclass(frozen=True, slots=True)
class RoutePlan:
    """A decision plus what committing it needs: the chosen replica's keys and exact cached tokens."""

    decision: Decision
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens predicted to be cached on the chosen replica (its own block size), at most the
    blocks an engine can reuse: never the block holding the prompt's last token, which engines
    always compute (:func:`reusable_blocks`). Receipts compare it with the engine's report."""
    keys: tuple[BlockKey, ...]
    """The request's block keys in the chosen replica's key space (for speculative entries)."""
    decode_blocks: int
    """KV blocks (the pool's reference size) the request holds while decoding: its uncached prompt
    plus ``sequences × max_tokens`` (at most :data:`MAX_DECODE_TOKENS` of them), committed as the
    chosen replica's ``active_decode_blocks``."""
    block_size: int = 16
    """Tokens per block of the chosen replica (the unit of ``keys`` and of receipts)."""
    inputs: PolicyInputs | None = None
    """What the policy decided on (references, no copy): the console's decision ring keeps it."""
    token_ids: Sequence[int] = ()
    """The prompt's token ids (a reference, no copy) when it has no LoRA and no cache salt: a
    receipt may then compute the engine's own hashes of its cached blocks; else empty."""
    sequences: int = 1
    """OpenAI's ``n`` of the request (its ``decode_blocks`` count them)."""
    left_out: LeftOut = ()
    """The pool's replicas that were not candidates, each with its reason's code
    (:mod:`balancer.routing.left_out`), as :meth:`PoolRouter.candidates` found them; empty when every
    replica was a candidate (or the plan was made from candidates given)."""


def every_replica_full(model: str, cap: int) -> str:
    """Why a pool takes no request now: each routable replica is at ``max_inflight_per_replica``."""
    return (
        f"every replica of model {model!r} has {cap} sequences in flight"
        " (limits.max_inflight_per_replica; a request counts its n)"
    )


BlockHashFn = Callable[[Sequence[int], int], "list[EngineHash]"]
"""An engine's own block hashes of a plain token sequence (:attr:`EngineSpec.block_hashes
<balancer.engines.spec.EngineSpec.block_hashes>`)."""

MAX_DECODE_TOKENS = 1 << 32
"""Most generated tokens (``n × max_tokens``) one request counts in the decode load: beyond any
engine's context, and small enough that the load counts (64-bit in the shared load table of
``--workers N``) cannot overflow."""
HASH_TRUST_BLOCKS = 16
"""Blocks whose computed engine hash must have matched the replica's own events (and none
mismatched) before receipts teach the index blocks under computed hashes."""
HASH_CHECK_RECEIPTS = 256
"""Receipts a replica's hashes are checked on before kvlb gives up trusting them (none matched).
Only a receipt that found at least one block the index holds by its key counts: one whose blocks it
holds none of can show neither a match nor a mismatch."""


@dataclass(frozen=True, slots=True)
class RouteLimits:
    """What bounds one pool's routing (from ``limits.*`` and ``timeouts.*``)."""

    max_inflight_per_replica: int = 256
    """Requests committed to one replica and not yet released, by every worker sharing the load
    table (:meth:`PoolRouter.in_flight_total`; at most ``workers - 1`` over when workers race,
    :mod:`balancer.load.share`); a replica at the cap is not a candidate, and a pool whose routable
    replicas are all at it refuses with :class:`Overloaded`."""
    speculative_ttl_s: float = 2.0
    """Life of a committed request's speculative index entries after its first token (seconds;
    0 disables speculation)."""
    pending_ttl_s: float | None = None
    """Life of those entries until the first token (seconds; ``None``: ``speculative_ttl_s``)."""
    key_memo_runs: int = 4096
    """Runs of 32 block keys each key space memoises (:class:`~balancer.index.hashing.KeyMemo`,
    about 1.5 kB each: 6 MB at the default, 2M tokens of distinct prefixes at block size 16); least
    recently used out first (``kvlb_route_key_memo_evictions_total{space}``); 0 turns the memo off."""
    receipt_drops: bool = False
    """Whether :meth:`PoolRouter.settle_receipt` drops stale holdings (off: it measures and learns)."""
    receipts_teach: bool | None = None
    """Whether a receipt teaches the index the blocks the engine found cached, under the engine's own
    hashes (:meth:`PoolRouter._teach`). ``None`` follows the table: on when its ``gap_hold_s`` > 0 (the
    embedded default). The fleet's mirrors clear a cache at every gap (their ``gap_hold_s`` is 0) and
    still learn: without it, blocks that a TRT-LLM engine reuses and so never announces again stayed
    unknown after a gap for good (``docs/redis-fleet.md``, "Receipts after a gap")."""


@quick_init
@dataclass(frozen=True, slots=True)
class PoolRequest:
    """One request as the router sees it: its tokens, and the policy and weights that decide it."""

    token_ids: Sequence[int]
    policy: Policy
    weights: PolicyWeights
    request_id: str
    """The client's request id (session affinity, logs); leases get a process-unique tracking id."""
    session_key: str | None = None
    max_tokens: int = 0
    """Completion tokens asked for (decode load); 0 when unknown."""
    sequences: int = 1
    """OpenAI's ``n``: sequences generated, each up to ``max_tokens`` (decode load)."""
    exclude: frozenset[ReplicaId] = frozenset()
    """Replicas not to choose (they already failed this request)."""


def reusable_blocks(prompt_tokens: int, block_size: int, mode: AlignMode) -> int:
    """Blocks of a prompt an engine can take from its cache: the full blocks of ``prompt[:-1]``.

    An engine always computes at least the last prompt token (its logits start the answer): SGLang
    and vLLM match ``prompt[:-1]``, so a block-aligned prompt held whole is reported one block short
    of its keys; TRT-LLM's key space already leaves the last token out. EAGLE bigram pages keep
    their key count (not measured against an engine)."""
    if mode == "bigram":
        return full_blocks(prompt_tokens, block_size, mode)
    return max(0, prompt_tokens - 1) // block_size


def computed_blocks(plan: RoutePlan, reported_blocks: int) -> int:
    """Full blocks of ``plan``'s prompt the engine computed and could cache anew, given the cached
    blocks it reported: those it could have reused (never the block of the last prompt token, which
    it always computes and may have held already) minus the reported ones; 0 at least. An engine
    with prefix caching stores them, so it publishes a KV event for each."""
    reusable = min(len(plan.keys), max(0, plan.prompt_tokens - 1) // plan.block_size)
    return max(0, reusable - reported_blocks)


class Lease:
    """One committed decision: the request's load is reserved on :attr:`replica` (and counted
    against its in-flight cap) until :meth:`release`, which is idempotent."""

    __slots__ = (
        "_decoding",
        "_released",
        "_router",
        "on_phase",
        "plan",
        "replica",
        "routed_at",
        "tracking_id",
    )

    def __init__(self, router: PoolRouter, plan: RoutePlan, tracking_id: str, routed_at: float) -> None:
        self._router = router
        self.plan = plan
        self.replica = plan.decision.replica
        self.tracking_id = tracking_id
        self.routed_at = routed_at
        """When the request was committed (monotonic seconds): receipts date their view by it."""
        self._released = False
        self._decoding = False
        self.on_phase: Callable[[float, bool], None] | None = None
        """Told ``(now, released)`` at the first token (``False``) and at the release (``True``),
        once each: the service keeps the spans in the decision's record (the what-if's load)."""

    @property
    def released(self) -> bool:
        return self._released

    @property
    def router_receipts(self) -> ReceiptBook:
        """The pool's receipt book (each replica's last prediction errors)."""
        return self._router.receipts

    def first_token(self, now: float) -> None:
        """The replica produced its first token: the request moves from prefill to decode."""
        if not self._released:
            self._router.first_token(self.tracking_id, now)
            if not self._decoding:
                self._decoding = True
                if self.on_phase is not None:
                    self.on_phase(now, False)

    def settle_receipt(self, reported_tokens: int, now: float) -> Settled:
        """The engine reported ``reported_tokens`` cached: check the prediction, correct the index
        (:meth:`PoolRouter.settle_receipt`)."""
        return self._router.settle_receipt(self, reported_tokens, now)

    def mark_computed(self, blocks: int, routed_wall_s: float, spacing_s: float) -> None:
        """The engine computed ``blocks`` new prompt blocks for this request, decided at
        ``routed_wall_s`` (wall clock): kept in the pool's
        :class:`~balancer.routing.receipts.ComputedMarks`."""
        self._router.receipts.computed.add(self.replica, routed_wall_s, blocks, spacing_s)

    def release(self, now: float) -> bool:
        """The request ended (or was abandoned); ``False`` when it was already released."""
        if self._released:
            return False
        self._released = True
        self._router.release(self.tracking_id, now)
        if self.on_phase is not None:
            self.on_phase(now, True)
        return True


class PoolRouter:
    """Routing state of one pool: key spaces, the load tracker, and the replicas' schemes."""

    def __init__(
        self,
        model: str,
        limits: TableLimits | None = None,
        load_config: LoadConfig | None = None,
        *,
        health: HealthBook | None = None,
        route_limits: RouteLimits | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``health`` is the service's shared book (``None``: every registered replica is routable);
        ``rng`` breaks the policy's ties in :meth:`select`."""
        self.model = model
        self._limits = limits or TableLimits()
        self._load_config = load_config
        self.health = health
        self.route_limits = route_limits or RouteLimits()
        self.rng = rng or random.Random(0)
        self._next_lease = 0
        self.spaces: dict[tuple[int, AlignMode], KeySpace] = {}
        self._reference_block_size = 16
        """:attr:`reference_block_size`, kept by :meth:`add_replica` (key spaces are only added)."""
        self.space_of: dict[ReplicaId, KeySpace] = {}
        self.load: LoadTracker | None = None
        self.peer_load: Callable[[Collection[ReplicaId]], Mapping[ReplicaId, LoadCounts]] | None = None
        """The load the other workers of ``kvlb serve --workers N`` committed on the given replicas
        (set by the shell, :mod:`balancer.load.share`; ``None``: this router's own load is all)."""
        self._speculating: OrderedDict[str, tuple[ReplicaId, tuple[BlockKey, ...], float]] = OrderedDict()
        self.max_speculating = self._limits.max_speculative_keys // 16 + 1
        """Requests whose speculative entries wait for a first token; past it the oldest keep their
        long TTL (they still expire, only later)."""
        self.receipts = ReceiptBook()
        """Each replica's last prediction errors (``/admin/replicas``)."""
        self._block_hashes: dict[ReplicaId, BlockHashFn] = {}
        self._hash_trust: dict[ReplicaId, tuple[int, int]] = {}
        """Per replica with ``block_hashes``: (blocks matched, receipts checked); matched -1 once
        a computed hash contradicted the engine's events (never trusted again)."""
        self.rotation = 0
        """Decisions committed so far (``RouteRequest.rotation``, ``round_robin``'s turn): advanced
        by :meth:`commit` only, so :meth:`select` without a commitment moves nothing."""
        self.ramp_average = ShareAverage()
        """The credit ramp's memory (``PolicyWeights.ramp_memory_s``): the busy share averaged in
        time over this router's committed decisions, and when it was last advanced. :meth:`plan`
        gives both to the policy and stores nothing; :meth:`commit` keeps the committed decision's
        advanced average, stamped with the decision's time. Per process: each worker and each kvlb
        of a fleet averages its own decisions."""

    @property
    def reference_block_size(self) -> int:
        """The smallest block size in the pool (16 while it has none): the unit of merged overlaps."""
        return self._reference_block_size

    def add_replica(
        self,
        replica: ReplicaId,
        block_size: int,
        mode: AlignMode,
        block_hashes: BlockHashFn | None = None,
    ) -> KeySpace:
        """Register a replica's caching scheme; returns the key space whose table its events feed.
        ``block_hashes``: the engine's own block hashes, when kvlb can reproduce them (receipts use
        them once verified: :meth:`settle_receipt`).

        A replica added while the pool routes (discovery) keeps the load tracker: other replicas'
        reservations and scraped stats stay, and so does the tracker object that scrapers feed. A
        smaller block size only changes the tracker's reference size (reservations made before it
        keep their decode blocks in the old unit until they end)."""
        space = self.spaces.get((block_size, mode))
        if space is None:
            hasher = BlockHasher(self.model, block_size, mode)
            memo = KeyMemo(self.route_limits.key_memo_runs)
            space = KeySpace(hasher, LockedPrefixTable(hasher, self._limits), memo=memo)
            self.spaces[(block_size, mode)] = space
            self._reference_block_size = min(bs for bs, _ in self.spaces)
            load = self.load
            if load is not None and load.config.block_size_tokens != self.reference_block_size:
                load.config = dataclasses.replace(load.config, block_size_tokens=self.reference_block_size)
        space.replicas.add(replica)
        self.space_of[replica] = space
        if block_hashes is not None and space.hasher.lookahead_tokens == 0:
            self._block_hashes[replica] = block_hashes
        else:
            self._block_hashes.pop(replica, None)
        self._hash_trust.pop(replica, None)
        return space

    def remove_replica(self, replica: ReplicaId) -> None:
        space = self.space_of.pop(replica, None)
        if space is not None:
            space.replicas.discard(replica)
            space.table.drop_replica(replica)
        if self.load is not None:
            self.load.forget(replica)
        self.receipts.forget(replica)
        self._block_hashes.pop(replica, None)
        self._hash_trust.pop(replica, None)

    def hash_trust(self, replica: ReplicaId) -> bool | None:
        """Whether receipts teach ``replica``'s blocks under computed engine hashes: ``True`` (they
        matched its events), ``False`` (one contradicted them, or none matched in time), ``None``
        (not checked enough yet, or the engine offers no reproducible hash)."""
        if replica not in self._block_hashes:
            return None
        matched, checked = self._hash_trust.get(replica, (0, 0))
        if matched < 0 or (matched < HASH_TRUST_BLOCKS and checked >= HASH_CHECK_RECEIPTS):
            return False
        return True if matched >= HASH_TRUST_BLOCKS else None

    def tracker(self) -> LoadTracker:
        """The pool's load tracker, in reference blocks (built on first use)."""
        if self.load is None:
            base = self._load_config or LoadConfig()
            self.load = LoadTracker(
                LoadConfig(
                    block_size_tokens=self.reference_block_size,
                    stale_after_s=base.stale_after_s,
                    max_age_s=base.max_age_s,
                    max_tracked_requests=base.max_tracked_requests,
                    max_replicas=base.max_replicas,
                )
            )
        return self.load

    def in_flight(self, replica: ReplicaId) -> int:
        """Requests this router committed to ``replica`` and not yet released (the load tracker's
        reservations): this worker's own part, summable over workers (``/metrics``). The in-flight
        cap reads :meth:`in_flight_total`."""
        return self.tracker().in_flight(replica)

    def in_flight_total(self, replica: ReplicaId) -> int:
        """Requests in flight on ``replica`` from every worker: this router's own reservations plus
        the other workers' (:attr:`peer_load`). What ``limits.max_inflight_per_replica`` caps."""
        return self._in_flight_with(replica, self._peer_counts())

    def _peer_counts(self) -> Mapping[ReplicaId, LoadCounts]:
        """The other workers' committed load on this pool's replicas (one read of the shared table,
        with the same argument as :meth:`load_snapshot`, so the reader's memo serves both)."""
        return self.peer_load(self.space_of) if self.peer_load is not None else {}

    def _in_flight_with(self, replica: ReplicaId, peers: Mapping[ReplicaId, LoadCounts]) -> int:
        own = self.tracker().in_flight(replica)
        peer = peers.get(replica)
        return own if peer is None else own + max(0, peer.prefill_seqs) + max(0, peer.decode_seqs)

    def load_snapshot(self, now: float, only: Collection[ReplicaId] | None = None) -> LoadSnapshot:
        """The load the policy reads: this router's reservations plus the other workers' (when
        :attr:`peer_load` is set), and the scraped engine stats; ``only``: these replicas' alone."""
        peers = self.peer_load(self.space_of) if self.peer_load is not None else None
        return self.tracker().snapshot(now, peers, only)

    def routable(self, now: float) -> list[ReplicaId]:
        """The pool's replicas that may take a request now (health), in registration order."""
        if self.health is None:
            return list(self.space_of)
        return self.health.routable(now, self.space_of)

    def has_free_slot(self, now: float) -> bool:
        """Some routable replica is below its in-flight cap (every worker's requests counted), or
        none is routable at all (then :meth:`candidates` refuses at once, so waiting for a slot
        would not help)."""
        routable = self.routable(now)
        if not routable:
            return True
        cap = self.route_limits.max_inflight_per_replica
        peers = self._peer_counts()
        return any(self._in_flight_with(r, peers) < cap for r in routable)

    def candidates(self, now: float, exclude: Collection[ReplicaId] = ()) -> list[ReplicaId]:
        """Routable replicas not in ``exclude`` and below their in-flight cap (every worker's
        requests counted, :meth:`in_flight_total`). Raises :class:`NoReplicasAvailable` when none is
        routable, :class:`Overloaded` when all are full."""
        return self.candidates_left_out(now, exclude)[0]

    def candidates_left_out(
        self, now: float, exclude: Collection[ReplicaId] = ()
    ) -> tuple[list[ReplicaId], LeftOut]:
        """:meth:`candidates`, and the pool's other replicas with the code of why each was left out
        (:mod:`balancer.routing.left_out`): the health book's reason, ``already tried`` or ``full``.
        Reasons are looked up only for the replicas left out (none in the usual case)."""
        routable_all = self.routable(now)
        routable = [r for r in routable_all if r not in exclude] if exclude else routable_all
        if not routable:
            why = self._why_none(now, exclude)
            raise NoReplicasAvailable(f"no healthy replica serves model {self.model!r}{why}")
        cap = self.route_limits.max_inflight_per_replica
        peers = self._peer_counts()
        eligible = [r for r in routable if self._in_flight_with(r, peers) < cap]
        if not eligible:
            message = every_replica_full(self.model, cap)
            raise Overloaded(message, FULL_RETRY_AFTER_S)
        if len(eligible) == len(self.space_of):
            return eligible, ()
        return eligible, self._left_out(now, set(routable_all), set(eligible), exclude)

    def _left_out(
        self, now: float, routable: set[ReplicaId], eligible: set[ReplicaId], exclude: Collection[ReplicaId]
    ) -> LeftOut:
        out: list[tuple[ReplicaId, int]] = []
        for replica in self.space_of:
            if replica in eligible:
                continue
            if replica not in routable:
                reason = self.health.unroutable_reason(replica, now) if self.health is not None else None
                out.append((replica, reason_code(reason)))
            elif replica in exclude:
                out.append((replica, ALREADY_TRIED))
            else:
                out.append((replica, FULL))
        return tuple(out)

    def why_unroutable(self, now: float) -> str:
        """Why the pool's replicas are not routable, as counts: `` (2 failing health probes, 1
        serves another model)`` (``""`` without a health book); for ``/readyz``'s ``degraded``."""
        return self._why_none(now, ())

    def _why_none(self, now: float, exclude: Collection[ReplicaId]) -> str:
        """Why no replica is routable, as counts (bounded at any pool size, and no replica id reaches
        the client): `` (2 draining, 1 failing health probes)``; ``""`` without a health book."""
        if self.health is None:
            return ""
        reasons: Counter[str] = Counter()
        for replica in self.space_of:
            reason = self.health.unroutable_reason(replica, now)
            reasons[reason or ("already tried" if replica in exclude else "routable")] += 1
        if not reasons:
            return " (the pool has no replicas)"
        counted = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))
        return " (" + ", ".join(f"{count} {reason}" for reason, count in counted) + ")"

    def select(self, request: PoolRequest, now: float) -> RoutePlan:
        """The decision for ``request`` among :meth:`candidates`, committing nothing; the plan
        keeps the replicas left out and why (:attr:`RoutePlan.left_out`)."""
        candidates, left_out = self.candidates_left_out(now, request.exclude)
        return self.plan(
            request.token_ids,
            candidates,
            request.policy,
            request.weights,
            self.rng,
            now,
            session_key=request.session_key,
            request_id=request.request_id,
            max_tokens=request.max_tokens,
            sequences=request.sequences,
            left_out=left_out,
        )

    def route(self, request: PoolRequest, now: float) -> Lease:
        """Select and commit: the returned lease holds the request's load until released.

        With other workers (:attr:`peer_load`), the chosen replica's in-flight count is read again
        just before the commitment: a replica that another worker filled while this one planned is
        not taken (the decision is made again without it; :class:`Overloaded` once every candidate
        is full), so two workers racing for a replica's last slot overlap only in the microseconds
        between that read and the publication of the commitment (:mod:`balancer.load.share`)."""
        cap = self.route_limits.max_inflight_per_replica
        full: set[ReplicaId] = set()
        while True:
            try:
                plan = self.select(request, now)
            except NoReplicasAvailable:
                if not full:
                    raise
                message = every_replica_full(self.model, cap)
                raise Overloaded(message, FULL_RETRY_AFTER_S) from None
            replica = plan.decision.replica
            if self.peer_load is None or self.in_flight_total(replica) < cap:
                return self.lease(plan, request.request_id, now)
            full.add(replica)
            request = dataclasses.replace(request, exclude=request.exclude | {replica})

    def lease(self, plan: RoutePlan, request_id: str, now: float) -> Lease:
        """Commit ``plan`` (load reserved, speculative entries added, the replica told it was
        routed to) under a tracking id unique in this router (clients may reuse request ids)."""
        self._next_lease += 1
        tracking_id = f"{request_id}#{self._next_lease}"
        limits = self.route_limits
        self.commit(plan, tracking_id, now, limits.speculative_ttl_s, pending_ttl_s=limits.pending_ttl_s)
        if self.health is not None:
            self.health.on_routed(plan.decision.replica, now)
        return Lease(self, plan, tracking_id, now)

    def plan(
        self,
        token_ids: Sequence[int],
        candidates: Sequence[ReplicaId],
        policy: Policy,
        weights: PolicyWeights,
        rng: random.Random,
        now: float,
        *,
        session_key: str | None = None,
        request_id: str | None = None,
        max_tokens: int = 0,
        sequences: int = 1,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        left_out: LeftOut = (),
    ) -> RoutePlan:
        """Choose a replica among ``candidates`` (side-effect free apart from TTL expiry);
        ``left_out``: the pool's other replicas and why (kept in the plan as it is)."""
        ref_bs = self.reference_block_size
        merged: dict[ReplicaId, int] = {}
        ranks: dict[ReplicaId, int] = {}
        exact_tokens: dict[ReplicaId, int] = {}
        speculative: dict[ReplicaId, int] = {}
        held: dict[ReplicaId, int] = {}
        roots: dict[ReplicaId, int] = {}
        count_roots = weights.root_weight > 0  # O(candidates) per space (kept counts): only for the charge
        keys_by_space: dict[int, tuple[BlockKey, ...]] = {}
        for space in self._spaces_for(candidates):
            # a tuple: the plan commits this very object, so the table can tell the match saw it
            keys = tuple(space.hasher.request_keys(token_ids, lora_name, cache_salt, space.memo))
            keys_by_space[id(space)] = keys
            among = tuple([r for r in candidates if r in space.replicas])  # a tuple: its mask is cached
            overlap, confirmed = space.table.match_confirmed(keys, among, now)
            if count_roots:
                roots.update(space.table.held_roots(among, now))
            bs = space.hasher.block_size
            for replica, blocks in overlap.blocks.items():
                exact_tokens[replica] = blocks * bs
                merged[replica] = blocks * bs // ref_bs
                ranks[replica] = overlap.best_rank.get(replica, 0)
                held[replica] = space.table.held_blocks(replica) * bs // ref_bs
                pending = blocks - confirmed.get(replica, 0)
                if pending > 0:
                    speculative[replica] = pending * bs // ref_bs
        request_blocks = len(token_ids) // ref_bs
        marks: tuple[tuple[int, int], ...] = ()
        for space in self.spaces.values():  # one key space for all records: the pool's first asked
            space_keys = keys_by_space.get(id(space))
            if space_keys is not None:
                marks = prefix_marks(space_keys, space.hasher.block_size, ref_bs)
                break
        route = RouteRequest(
            candidates=tuple(candidates),
            request_blocks=request_blocks,
            prompt_tokens=len(token_ids),
            session_key=session_key,
            request_id=request_id,
            ramp_share=self.ramp_average.share,
            ramp_at_s=self.ramp_average.at_s,
            ramp_last_share=self.ramp_average.last_share,
            rotation=self.rotation,
            prefix_marks=marks,
        )
        overlap_all = Overlap(merged, ranks, request_blocks, speculative, held, roots)
        snapshot = self.load_snapshot(now)
        decision = policy(route, overlap_all, snapshot, weights, rng)
        chosen_space = self.space_of.get(decision.replica)
        keys = keys_by_space.get(id(chosen_space), ()) if chosen_space is not None else ()
        cached = exact_tokens.get(decision.replica, 0)
        chosen_bs = ref_bs
        if chosen_space is not None:
            chosen_bs = chosen_space.hasher.block_size
            reusable = reusable_blocks(len(token_ids), chosen_bs, chosen_space.hasher.mode)
            cached = min(cached, reusable * chosen_bs)
        generated = min(max(1, sequences) * max(0, max_tokens), MAX_DECODE_TOKENS)
        decode_tokens = len(token_ids) - cached + generated
        return RoutePlan(
            decision=decision,
            prompt_tokens=len(token_ids),
            cached_tokens=cached,
            keys=tuple(keys),
            decode_blocks=-(-decode_tokens // ref_bs),
            block_size=chosen_bs,
            inputs=PolicyInputs(route, overlap_all, snapshot),
            token_ids=token_ids if lora_name is None and cache_salt is None else (),
            sequences=max(1, sequences),
            left_out=left_out,
        )

    def _spaces_for(self, candidates: Collection[ReplicaId]) -> list[KeySpace]:
        if len(self.spaces) == 1:  # one caching scheme (the usual pool): no dict to build
            (only,) = self.spaces.values()
            return [only] if any(r in only.replicas for r in candidates) else []
        seen: dict[int, KeySpace] = {}
        for replica in candidates:
            space = self.space_of.get(replica)
            if space is not None:
                seen.setdefault(id(space), space)
        return list(seen.values())

    def commit(
        self,
        plan: RoutePlan,
        request_id: str,
        now: float,
        speculative_ttl_s: float,
        pending_ttl_s: float | None = None,
    ) -> bool:
        """Reserve the request's load, keep the decision's averaged busy share as the ramp's memory
        (:attr:`ramp_average`) and add speculative entries; ``False`` if the id is taken.

        The entries are held for ``pending_ttl_s`` (default: ``speculative_ttl_s``) until the first
        token, then for ``speculative_ttl_s``."""
        replica = plan.decision.replica
        reserved = self.tracker().reserve(
            request_id,
            replica,
            plan.prompt_tokens - plan.cached_tokens,
            plan.decode_blocks,
            now,
            sequences=plan.sequences,
        )
        if reserved:
            self.rotation += 1
        if reserved and plan.decision.ramp_share is not None:
            decided_s = plan.inputs.load.now if plan.inputs is not None else now
            decision = plan.decision
            self.ramp_average = ShareAverage(decision.ramp_share, decided_s, decision.busy_share)
        space = self.space_of.get(replica)
        if reserved and space is not None and plan.keys:
            self._note_routes(space, plan, now)
        if reserved and space is not None and plan.keys and speculative_ttl_s > 0:
            long_ttl_s = max(speculative_ttl_s, pending_ttl_s or 0.0)
            space.table.add_speculative(replica, plan.keys, long_ttl_s, now)
            if long_ttl_s > speculative_ttl_s:
                self._speculating[request_id] = (replica, plan.keys, speculative_ttl_s)
                while len(self._speculating) > self.max_speculating:
                    self._speculating.popitem(last=False)
        return reserved

    def _note_routes(self, space: KeySpace, plan: RoutePlan, now: float) -> None:
        """After an event gap of the chosen replica (within ``recovery.GONE_S``): give its table the
        request's keys, token ids and the engine's block hash function (:meth:`PrefixTable.note_routes
        <balancer.index.table.PrefixTable.note_routes>`, references, O(1)), so that a store the engine
        makes under one of its blocks, which the lost events may have stored, is applied rather than
        skipped. Nothing without reproducible hashes (a LoRA, a cache salt, vLLM) or once they were
        seen wrong."""
        replica = plan.decision.replica
        block_hashes = self._block_hashes.get(replica)
        if block_hashes is None or not plan.token_ids or space.table.limits.gap_hold_s <= 0:
            return
        if self.hash_trust(replica) is False or not space.table.routes_wanted(replica, now):
            return
        space.table.note_routes(replica, plan.keys, plan.token_ids, block_hashes, now)

    def first_token(self, request_id: str, now: float) -> None:
        self.tracker().first_token(request_id, now)
        self._settle(request_id, now)

    def release(self, request_id: str, now: float) -> None:
        self.tracker().release(request_id, now)
        self._settle(request_id, now)

    def _settle(self, request_id: str, now: float) -> None:
        """The prefill is over (or abandoned): shorten the request's speculative entries."""
        found = self._speculating.pop(request_id, None)
        if found is not None:
            replica, keys, ttl_s = found
            space = self.space_of.get(replica)
            if space is not None:
                space.table.add_speculative(replica, keys, ttl_s, now)

    def settle_receipt(self, lease: Lease, reported_tokens: int, now: float) -> Settled:
        """Check ``lease``'s prediction against the engine's ``cached_tokens`` and correct the index.

        * **Fewer** reported, by at least one block: the request's keys from the reported point to
          the predicted one were stale when it was routed. The replica's real holdings of those of
          them that it still holds only speculatively since (no store by the engine has confirmed
          them since they were routed) are dropped at once (:meth:`PrefixTable.drop_blocks
          <balancer.index.table.PrefixTable.drop_blocks>`). A key the engine stored again since is
          kept: the request itself computed those blocks, and an engine caches what it computes, so
          a store reported after the routing is newer than the receipt's view of the cache, which
          is the one at the request's admission. The speculative entries stay: they stand for that
          recomputation, and the engine's events confirm them or they expire.
        * **Suspect** blocks (a rank's holdings after an event gap, ``TableLimits.gap_hold_s``): the
          keys up to the reported point are confirmed, those from it to the predicted point dropped,
          whatever ``receipt_drops`` says; keys up to the reported point that were suspect and
          dropped unconfirmed are held again (:meth:`PrefixTable.settle_suspect
          <balancer.index.table.PrefixTable.settle_suspect>`).
        * **More** reported: the engine held blocks the index did not know of: the request's keys up
          to the reported point are added as speculative entries for ``speculative_ttl_s`` (in
          no-events pools, the life of every holding), which the engine's events confirm if any.

        A request of ``n > 1`` sequences (:attr:`RoutePlan.sequences`) is read only up to the
        prediction: the engine runs each sequence as its own request, and the ``cached_tokens`` it
        answers may be a later sequence's, which found the prompt blocks the first one had just
        computed (real vLLM 0.32: ``n: 2`` on a prompt it had never seen reported 224 cached tokens
        of 241). More reported than predicted is then no sign of blocks the index lacked, and is
        counted as exact; fewer is still stale (a later sequence finds at least what the first did).

        A replica removed from the pool while the request ran is read but neither recorded in
        :attr:`receipts` (that would keep a window per removed replica id) nor taught to any table.
        """
        plan = lease.plan
        replica = lease.replica
        if plan.sequences > 1:
            reported_tokens = min(reported_tokens, plan.cached_tokens)
        receipt = read_receipt(replica, plan.keys, plan.block_size, plan.cached_tokens, reported_tokens)
        space = self.space_of.get(replica)
        if space is not None:  # a replica removed while the request ran keeps no receipt window
            self.receipts.record(receipt)
        dropped = learned = confirmed = suspect_dropped = 0
        if space is not None:  # after an event gap: confirms or drops the suspect blocks named
            found = plan.keys[: receipt.reported_blocks]
            confirmed, suspect_dropped = space.table.settle_suspect(replica, found, receipt.stale, now)
        taught = 0
        if space is not None and receipt.reported_blocks and plan.token_ids:
            taught = self._teach(space, lease, receipt.reported_blocks, now)
        if space is not None and receipt.stale and self.route_limits.receipt_drops:
            dropped = space.table.drop_speculated(replica, receipt.stale, now, since=lease.routed_at)
        elif space is not None and receipt.unseen and self.route_limits.speculative_ttl_s > 0:
            prefix = plan.keys[: receipt.reported_blocks]
            space.table.add_speculative(replica, prefix, self.route_limits.speculative_ttl_s, now)
            learned = len(receipt.unseen)
        return Settled(receipt, dropped + suspect_dropped, learned, confirmed, taught)

    def _teach(self, space: KeySpace, lease: Lease, reported: int, now: float) -> int:
        """Blocks ``[0, reported)`` of the lease's request, which the engine found cached, with the
        engine's own hashes of them (:attr:`EngineSpec.block_hashes
        <balancer.engines.spec.EngineSpec.block_hashes>`): checked against the replica's events
        until ``HASH_TRUST_BLOCKS`` matched, then, when the index does not really hold them all
        (speculative entries do not count), held as real blocks (:meth:`PrefixTable.learn_blocks
        <balancer.index.table.PrefixTable.learn_blocks>`). Costs one hash per token of those blocks,
        and only while checking or when the index lacked some. Returns the blocks learned."""
        replica, plan = lease.replica, lease.plan
        block_hashes = self._block_hashes.get(replica)
        teach = self.route_limits.receipts_teach
        if teach is None:
            teach = space.table.limits.gap_hold_s > 0  # 0: gap recovery is off
        if block_hashes is None or self.hash_trust(replica) is False or not teach:
            return 0
        matched, checked = self._hash_trust.get(replica, (0, 0))
        trusted = matched >= HASH_TRUST_BLOCKS
        found_keys = plan.keys[:reported]
        if trusted and space.table.held_prefix(replica, found_keys) >= len(found_keys):
            return 0
        hashes = block_hashes(plan.token_ids[: reported * plan.block_size], plan.block_size)
        found, wrong, learned = space.table.learn_blocks(
            replica, found_keys, hashes, lease.routed_at, hold=trusted
        )
        if wrong:
            self._hash_trust[replica] = (-1, checked + 1)
        elif found or trusted or space.table.held_prefix(replica, found_keys):
            self._hash_trust[replica] = (matched + found, checked + 1)
        # else the index held none of the found blocks by its key (the receipt came before their
        # events, or after a clear): it shows neither a match nor a mismatch, so it does not count
        # towards HASH_CHECK_RECEIPTS (a held block that no computed hash names still does)
        return learned
