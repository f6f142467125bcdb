"""Limits, counters, per-slot records and slot bookkeeping of the in-memory prefix table (pure).

A *slot* is one bit of the holder masks in :mod:`balancer.index.table`: a :class:`CacheSlot` per
(replica, dp_rank) KV cache, and a :class:`SpecSlot` per replica with speculative entries.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter

from balancer.index.settle import first_uses
from balancer.types import ReplicaId

_MAX_DERIVED = 4096
"""Cached candidate masks and holder groups; both caches are cleared when full or when slots change."""


@dataclass(frozen=True, slots=True)
class TableLimits:
    """Bounds of a :class:`~balancer.index.table.PrefixTable`."""

    capacity_blocks: int = 1_000_000
    """Unique block keys kept, all caches together. Beyond it the least recently stored keys are
    evicted with all their holders, down to ``capacity - capacity // 128`` (exact LRU below 128
    blocks), and counted in ``ApplyResult.evicted_blocks`` and ``TableCounters.evicted_blocks``."""
    max_speculative_keys: int = 250_000
    """Speculative (replica, key) holdings alive at once, about ``requests/s × ttl_s × prompt blocks``
    (also bounds the expiry queue; ~100 B each). Keys beyond it are not added and are counted in
    ``TableCounters.speculative_overflow``; 0 disables speculation."""
    max_slots: int = 4096
    """Caches ((replica, dp_rank) pairs) plus one speculative slot per replica. A ``Stored`` for a new
    cache beyond it is skipped, and so are speculative keys of a new replica; both are counted in
    ``TableCounters.slot_overflow``."""
    gap_hold_s: float = 0.0
    """Seconds a cache's blocks stay *suspect* after an event gap (``Resync(rank, "gap")``) instead
    of being cleared at once: held and routed to, each one kept if the engine confirms it within this
    long (a store or a store under it, a receipt that found it cached), dropped otherwise (and at once
    if a receipt shows it missing). 0 clears at once (the Redis index's and fleet mirror's way).
    Costs no memory beyond one dict entry per block of the cache (bounded by its blocks)."""
    gap_keep_s: float = 0.0
    """Seconds after an event gap up to which unconfirmed suspect blocks may outlive the hold, by
    the engine's LRU order: a post-gap ``Removed`` of a suspect block drops every suspect block kvlb
    saw used less recently (the engine evicts least recently used first), and once such an eviction
    frontier was seen the suspects more recent than it stay past ``gap_hold_s``, until the frontier
    passes them, a receipt shows them missing, or this long after the gap. Without a frontier (no
    post-gap eviction) the hold's rule applies. At most ``gap_hold_s``: off (``lru_frontier``).
    Costs, when on, a re-insert of every key a routed request names (``add_speculative``): measured
    about 17 µs more per call with a 128-key prompt (23–33 µs without, 40–45 with, load 1.6–2.1)."""

    @property
    def lru_frontier(self) -> bool:
        """Whether gap recovery follows the engine's LRU order (``gap_keep_s`` > ``gap_hold_s`` > 0);
        only then does a routed request re-insert all its keys in the table's order."""
        return 0.0 < self.gap_hold_s < self.gap_keep_s

    def __post_init__(self) -> None:
        if self.capacity_blocks <= 0 or self.max_speculative_keys < 0 or self.max_slots <= 0:
            raise ValueError(f"invalid table limits: {self}")
        if not 0.0 <= self.gap_hold_s < float("inf"):
            raise ValueError(f"invalid table limits: gap_hold_s must be finite and >= 0: {self}")
        if not 0.0 <= self.gap_keep_s < float("inf"):
            raise ValueError(f"invalid table limits: gap_keep_s must be finite and >= 0: {self}")


@dataclass(slots=True)
class TableCounters:
    """Cumulative counts that the ``ApplyResult`` of one call does not carry."""

    evicted_blocks: int = 0
    """Unique keys evicted over the budget (by ``apply`` and by ``add_speculative``)."""
    speculative_overflow: int = 0
    """Speculative keys not added: over ``max_speculative_keys`` or no free slot."""
    speculative_expired: int = 0
    """Speculative keys dropped at their expiry."""
    speculative_confirmed: int = 0
    """Stores by a replica of keys it held speculatively (a key stored twice while pending counts
    twice); the speculative entries stay until their own expiry, which ``speculative_expired``
    counts."""
    speculative_compactions: int = 0
    """Rebuilds of the expiry heap without its stale entries (``PrefixTable._compact_spec_heap``)."""
    slot_overflow: int = 0
    """Caches or speculative slots refused over ``max_slots``."""
    suspect_marked: int = 0
    """Blocks an event gap made suspect (``TableLimits.gap_hold_s``), once per gap."""
    suspect_confirmed: int = 0
    """Suspect blocks the engine confirmed (a store, a store under it, a receipt)."""
    suspect_dropped: int = 0
    """Suspect blocks dropped: unconfirmed at the end of the hold, or shown missing by a receipt."""
    suspect_frontier_dropped: int = 0
    """Of those, suspect blocks dropped because the engine evicted a suspect block kvlb saw used more
    recently (``TableLimits.gap_keep_s``)."""
    suspect_restored: int = 0
    """Suspect blocks dropped unconfirmed (end of the hold, an eviction frontier) and held again once
    the engine showed it still held them: a receipt found one cached, or it stored a block under one
    (``CacheSlot.dropped``)."""
    dropped_forgotten: int = 0
    """Entries of ``CacheSlot.dropped`` forgotten over ``recovery.DROPPED_MAX`` (oldest first)."""
    routed_resolved: int = 0
    """Stores under a parent the cache did not know, applied after all because a request routed to
    the replica since its last event gap named the parent (``CacheSlot.routed``)."""
    routed_held: int = 0
    """Blocks those stores' parents and their ancestors added to the cache's holdings."""
    routed_forgotten: int = 0
    """Entries of ``CacheSlot.routed`` forgotten over ``recovery.ROUTED_MAX`` (oldest first)."""


class CacheSlot:
    """One KV cache: its bit and its engine-hash map, which is also its reverse set."""

    __slots__ = (
        "bit",
        "dp_rank",
        "dropped",
        "dups",
        "gap_at",
        "gone",
        "gone_floor",
        "held",
        "keys",
        "replica",
        "route_ring",
        "route_tokens",
        "routed",
        "slot",
        "suspect",
        "suspect_frontier",
        "suspect_keep_until",
        "suspect_until",
    )

    def __init__(self, replica: ReplicaId, dp_rank: int, slot: int) -> None:
        self.replica = replica
        self.dp_rank = dp_rank
        self.slot = slot
        self.bit = 1 << slot
        self.keys: dict[int, int] = {}
        """engine hash → block key; an entry whose key lost this bit (evicted) is stale."""
        self.dups: dict[int, int] = {}
        """block key → extra engine hashes mapping to it (rare: the same tokens under two handles)."""
        self.held = 0
        """Keys whose mask has this bit."""
        self.suspect: dict[int, None] = {}
        """Held keys not confirmed since the cache's last event gap (at most ``held`` live ones;
        an entry whose key lost this bit meanwhile is ignored)."""
        self.suspect_until = 0.0
        """When the unconfirmed ``suspect`` keys are dropped (monotonic seconds)."""
        self.suspect_keep_until = 0.0
        """How long the suspects more recent than a post-gap eviction frontier may stay
        (``TableLimits.gap_keep_s``), once ``suspect_frontier``."""
        self.suspect_frontier = False
        """Whether the engine evicted a suspect block since the last gap (``suspect`` is ordered least
        recently used first: the ones before it were dropped then)."""
        self.dropped: dict[int, float] = {}
        """Keys gap recovery dropped unconfirmed (at the end of the hold, or past an eviction
        frontier) whose handle the engine-hash map still keeps → when (monotonic seconds): the guess
        may be wrong, and the engine, which never stores a block it still caches again, may go on
        using them. A receipt that finds one cached, or a store under one, holds it again
        (``GapRecovery._restore_dropped``). An entry goes with its handle (a removal, a remap, a
        clear), after ``recovery.GONE_S``, or over ``recovery.DROPPED_MAX`` (oldest first); while it
        lives, compaction keeps its handle."""
        self.gone: dict[int, float] | None = None
        """Once receipts teach this cache blocks (``PrefixTable.learn_blocks``): engine hashes the
        engine removed lately → when (at most ``GONE_MAX`` and ``GONE_S`` back, oldest out first),
        which a receipt of a request routed before the removal must not bring back."""
        self.gone_floor = float("-inf")
        """The latest removal time forgotten from ``gone``: a request routed before it is not learned
        from (its removals may no longer be remembered)."""
        self.gap_at = float("-inf")
        """When the cache's last event gap was applied (monotonic seconds; ``-inf``: none since it
        was created or cleared). For ``recovery.GONE_S`` after it, requests routed to the replica
        fill ``routed``."""
        self.route_ring: deque[RoutedPrompt] = deque()
        """Since the last event gap: the requests routed to the replica (``PrefixTable.note_routes``),
        oldest first, at most ``recovery.ROUTED_PROMPTS`` and ``recovery.ROUTED_TOKENS`` tokens. The
        lost events may have stored blocks the index never learned; when the engine later stores
        under one of them (a request routed since reuses it), the parent is looked up here and the
        store is applied, not skipped (``GapRecovery._resolve_parent``)."""
        self.route_tokens = 0
        """Prompt tokens of ``route_ring``'s requests (their full blocks)."""
        self.routed: dict[int, tuple[int, int | None]] = {}
        """Engine hash → (block key, parent engine hash or ``None`` at the root) of the blocks found
        in ``route_ring`` (computed when a store needed them), at most ``recovery.ROUTED_MAX``,
        oldest out first."""


class RoutedPrompt:
    """A request routed to a replica after its event gap: references to its block keys and token
    ids, the engine's block hash function, and its packed tokens once searched."""

    __slots__ = ("block_hashes", "keys", "packed", "token_ids")

    def __init__(
        self,
        keys: tuple[int, ...],
        token_ids: Sequence[int],
        block_hashes: Callable[[Sequence[int], int], Sequence[int]],
    ) -> None:
        self.keys = keys
        self.token_ids = token_ids
        self.block_hashes = block_hashes
        self.packed: bytes | None = None


SETTLE_IN_TURN = 4
"""Logs of at most this many chains are applied chain by chain, oldest first (each key written once
per chain, as the adds would have): cheaper than finding each key's newest listing first when few
chains share keys (an expiry due every few requests applies a log of a few chains each time)."""
HELD_MAX = 512
"""Chains whose held prefix a speculative slot remembers (:attr:`SpecSlot.held`), the oldest forgotten
first (the next add of a forgotten chain writes all its expiries: slower, not different). Each is a
reference to a routed request's tuple of keys (most are kept by the expiry heap anyway)."""


class SpecSlot:
    """The speculative bit of one replica (it stands for rank 0): key → expiry, monotonic seconds.

    An add of a chain whose leading keys are pending changes no presence but the rest's, so
    ``PrefixTable.add_speculative`` writes only the rest's expiries and logs the chain's
    (:meth:`defer`); the log is applied by :attr:`expiry`, before anything else reads or changes the
    dict, each key written once with its newest listing's expiry
    (:func:`~balancer.index.settle.first_uses`). The pending prefix is known from :attr:`held`, which
    every access through :attr:`expiry` forgets (it may remove keys): only ``add_speculative`` and
    the prefix match (which saw how far the slot's bit runs along a chain) use :attr:`pending` and
    :attr:`held` directly."""

    __slots__ = ("alive", "bit", "deferred", "deferred_keys", "held", "pending", "replica", "slot", "stored")
    dp_rank = 0

    def __init__(self, replica: ReplicaId, slot: int) -> None:
        self.replica = replica
        self.slot = slot
        self.bit = 1 << slot
        self.pending: dict[int, float] = {}
        """key → expiry, without the logged re-adds (:attr:`deferred`): read it through :attr:`expiry`."""
        self.deferred: dict[int, tuple[tuple[int, ...], float]] = {}
        """Re-adds of chains held whole, by the chain's ``id``, in the order of their last listing:
        (the chain, its newest expiry; a re-add of the same chain only moves it to the end)."""
        self.deferred_keys = 0
        """Keys listed by :attr:`deferred`."""
        self.stored: dict[int, float] = {}
        """Pending keys a real store by the replica confirmed → when it last did (monotonic seconds;
        ``PrefixTable.speculated`` leaves out those stored since a request's routing). A confirmed
        key stays pending, and its bit set, until its own expiry: the request routed there is still
        in flight, so a ``Cleared``/``Removed`` of the replica's older copy (a replay of its
        history, an eviction its prefill undoes) must not take it. Its keys are a subset of
        :attr:`pending`'s: a key leaves it when it leaves :attr:`pending`."""
        self.held: dict[int, tuple[tuple[int, ...], int]] = {}
        """Chains by ``id`` (the dict keeps them alive) → (the chain, ``depth``): its first ``depth``
        keys are in :attr:`pending`, no key having been removed from it since they were noted (at
        most :data:`HELD_MAX`)."""
        self.alive = True

    @property
    def expiry(self) -> dict[int, float]:
        """key → expiry, the logged adds applied. The caller may remove keys: the prefixes
        :attr:`held` are forgotten."""
        if self.deferred:
            self.settle()
        if self.held:
            self.held = {}
        return self.pending

    @expiry.setter
    def expiry(self, value: dict[int, float]) -> None:
        self.pending = value
        self.deferred = {}
        self.deferred_keys = 0
        self.held = {}
        self.stored = {}

    def confirm(self, keys: list[int], now: float) -> None:
        """A real store by the replica of ``keys`` (all pending) at ``now``: noted in :attr:`stored`;
        their presence and expiries do not change."""
        self.stored.update(zip(keys, repeat(now)))

    def forget(self, keys: Iterable[int]) -> None:
        """``keys`` left :attr:`pending`: out of :attr:`stored` too."""
        if self.stored:
            pop = self.stored.pop
            for key in keys:
                pop(key, None)

    def note_held(self, keys: tuple[int, ...], depth: int) -> None:
        """The first ``depth`` keys of ``keys`` are in :attr:`pending` now."""
        held = self.held
        if len(held) >= HELD_MAX and id(keys) not in held:
            del held[next(iter(held))]
        held[id(keys)] = (keys, depth)

    def defer(self, keys: tuple[int, ...], expiry_s: float, max_keys: int) -> None:
        """Log an add of ``keys`` (all in :attr:`pending`) with ``expiry_s``; applied at once past
        ``max_keys`` logged keys."""
        deferred = self.deferred
        if deferred.pop(id(keys), None) is None:
            self.deferred_keys += len(keys)
        deferred[id(keys)] = (keys, expiry_s)  # its older listing's keys all get this expiry
        if self.deferred_keys > max_keys:
            self.settle()

    def settle(self, in_turn: int = SETTLE_IN_TURN) -> None:
        """Apply the logged re-adds: each key they list gets its newest listing's expiry. Keys keep
        their place (they are all present), so the dict ends as after writing each add in turn."""
        deferred = self.deferred
        self.deferred = {}
        self.deferred_keys = 0
        if len(deferred) <= in_turn:  # a short log: written in turn, as the adds would have
            update = self.pending.update
            for keys, expiry_s in deferred.values():
                update(zip(keys, repeat(expiry_s)))
            return
        # newest listing first: each key is claimed by the newest chain listing it
        claimed = first_uses(keys for keys, _ in reversed(deferred.values()))
        expiries = map(deferred.__getitem__, map(id, claimed.values()))
        self.pending.update(zip(claimed, map(itemgetter(1), expiries), strict=True))


class SlotRegistry:
    """Slot numbers, their owners and each replica's caches; the lowest free slot is reused first."""

    def __init__(self, max_slots: int, counters: TableCounters) -> None:
        self._max_slots = max_slots
        self._counters = counters
        self._free: list[int] = []
        self.owners: list[CacheSlot | SpecSlot | None] = []
        """slot → owner (``None`` while free)."""
        self.caches: dict[ReplicaId, dict[int, CacheSlot]] = {}
        self.specs: dict[ReplicaId, SpecSlot] = {}
        self.replica_masks: dict[ReplicaId, int] = {}
        """replica → OR of the bits of all its slots (ranks and speculative)."""
        self.spec_mask = 0
        """OR of the bits of every speculative slot."""
        self._amongs: dict[Collection[ReplicaId] | None, tuple[int, dict[ReplicaId, int]]] = {}
        self._groups: dict[int, tuple[tuple[ReplicaId, ...], dict[ReplicaId, int]]] = {}

    def cache(self, replica: ReplicaId, dp_rank: int) -> CacheSlot | None:
        ranks = self.caches.get(replica)
        return None if ranks is None else ranks.get(dp_rank)

    def new_cache(self, replica: ReplicaId, dp_rank: int) -> CacheSlot | None:
        slot = self._alloc()
        if slot is None:
            return None
        cache = CacheSlot(replica, dp_rank, slot)
        self._install(cache)
        self.caches.setdefault(replica, {})[dp_rank] = cache
        return cache

    def new_spec(self, replica: ReplicaId) -> SpecSlot | None:
        slot = self._alloc()
        if slot is None:
            return None
        spec = self.specs[replica] = SpecSlot(replica, slot)
        self._install(spec)
        self.spec_mask |= spec.bit
        return spec

    def release(self, replica: ReplicaId) -> tuple[list[CacheSlot], SpecSlot | None]:
        """Free every slot of ``replica``; the caller unsets their bits (before reusing any)."""
        caches = list(self.caches.pop(replica, {}).values())
        spec = self.specs.pop(replica, None)
        if spec is not None:
            self.spec_mask &= ~spec.bit
        for owner in [*caches, spec]:
            if owner is not None:
                self.owners[owner.slot] = None
                heapq.heappush(self._free, owner.slot)
        self.replica_masks.pop(replica, None)
        self._changed()
        return caches, spec

    def _alloc(self) -> int | None:
        if self._free:
            return heapq.heappop(self._free)
        if len(self.owners) >= self._max_slots:
            self._counters.slot_overflow += 1
            return None
        self.owners.append(None)
        return len(self.owners) - 1

    def _install(self, owner: CacheSlot | SpecSlot) -> None:
        self.owners[owner.slot] = owner
        self.replica_masks[owner.replica] = self.replica_masks.get(owner.replica, 0) | owner.bit
        self._changed()

    def _changed(self) -> None:
        """Slot owners changed: drop what was derived from them."""
        self._amongs.clear()
        self._groups.clear()

    def candidates(self, among: Collection[ReplicaId] | None) -> tuple[int, dict[ReplicaId, int]]:
        """The mask of the candidates' slots and a zeroed result dict (cached for reusable keys)."""
        cacheable = among is None or type(among) is frozenset or type(among) is tuple
        if cacheable and (found := self._amongs.get(among)) is not None:
            return found
        masks = self.replica_masks
        replicas = masks if among is None else among
        mask = 0
        for replica in replicas:
            mask |= masks.get(replica, 0)
        found = (mask, dict.fromkeys(replicas, 0))
        if cacheable:
            if len(self._amongs) >= _MAX_DERIVED:
                self._amongs.clear()
            self._amongs[among] = found
        return found

    def group(self, bits: int) -> tuple[tuple[ReplicaId, ...], dict[ReplicaId, int]]:
        """The replicas owning ``bits``, and a rank of each (cached: the same groups recur): one of
        its caches' ranks, or 0 (its speculative slot's) when ``bits`` has none of them."""
        found = self._groups.get(bits)
        if found is None:
            best: dict[ReplicaId, int] = {}
            rest = bits
            while rest:
                low = rest & -rest
                rest ^= low
                owner = self.owners[low.bit_length() - 1]
                if owner is not None and (type(owner) is CacheSlot or owner.replica not in best):
                    best[owner.replica] = owner.dp_rank  # a real holding's rank over a speculative 0
            if len(self._groups) >= _MAX_DERIVED:
                self._groups.clear()
            found = self._groups[bits] = (tuple(best), best)
        return found
