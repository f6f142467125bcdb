"""What the prefix table does after an event gap, and what receipts teach it (pure: no I/O, no clock).

:class:`GapRecovery` is the part of :class:`~balancer.index.table.PrefixTable` that recovers a cache
whose events were lost while its engine went on (``Resync(rank, "gap")`` with
``TableLimits.gap_hold_s`` > 0): its blocks stay held as *suspect* until the engine confirms them
(an event, a receipt) or the hold ends, and receipts can teach it blocks the engine found cached
under the engine's own hashes (``learn_blocks``). The semantics: ``docs/prefix-index.md``, "Event
gaps" and "Receipts". It works on the table's own state and helpers, declared here for the type
checker; the table defines them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from balancer.index.base import HeldKeys
from balancer.index.hashing import pack_tokens
from balancer.index.roots import RootCounts
from balancer.index.slots import CacheSlot, RoutedPrompt, SlotRegistry, TableCounters, TableLimits
from balancer.types import BlockKey, ReplicaId

_NEVER = float("inf")
GONE_MAX = 4096
"""Removed engine hashes a learning cache remembers (``CacheSlot.gone``)."""
GONE_S = 60.0
"""How long (seconds) a learning cache remembers a removed engine hash (``CacheSlot.gone``), and a
cache a block gap recovery dropped unconfirmed (``CacheSlot.dropped``)."""
ROUTED_MAX = 65_536
"""Engine hashes of routed prompt blocks one cache remembers after an event gap, once computed
(``CacheSlot.routed``, ~150 B each); the oldest beyond it are forgotten
(``TableCounters.routed_forgotten``)."""
ROUTED_PROMPTS = 256
"""Requests routed since an event gap one cache keeps for :meth:`GapRecovery._resolve_parent`
(``CacheSlot.route_ring``, references to their keys and token ids); the oldest beyond it, or beyond
``ROUTED_TOKENS``, are forgotten (``TableCounters.routed_forgotten``)."""
ROUTED_TOKENS = 1 << 18
"""Prompt tokens those requests may hold together (about 9 MiB as Python ints at most)."""
DROPPED_MAX = 65_536
"""Blocks dropped unconfirmed that one cache remembers (``CacheSlot.dropped``, ~100 B each); the
oldest beyond it are forgotten (``TableCounters.dropped_forgotten``)."""


class GapRecovery:
    """Suspect blocks after an event gap, and blocks taught by receipts (mixed into ``PrefixTable``)."""

    limits: TableLimits
    counters: TableCounters
    _slots: SlotRegistry
    _suspects: dict[CacheSlot, None]
    _suspect_due: float
    _restorable: dict[CacheSlot, None]
    _block_size: int
    _roots: RootCounts

    @property
    def _holders(self) -> dict[int, int]:
        """The block key → holder mask dict in LRU order (``PrefixTable._holders``, which settles the
        order first): a property, not an attribute, as the table defines it."""
        raise NotImplementedError

    def _drop_keys(self, cache: CacheSlot, keys: Iterable[int], dropped_at: float | None = None) -> int:
        raise NotImplementedError

    def _restore(self, cache: CacheSlot, engine_hash: int, key: int) -> None:
        raise NotImplementedError

    def _remap(self, cache: CacheSlot, engine_hash: int, key: int) -> None:
        raise NotImplementedError

    def _evict(self) -> int:
        raise NotImplementedError

    # ------------------------------------------------------------------ event gaps

    def _suspect_all(self, cache: CacheSlot, now: float) -> None:
        """An event gap: every block the cache holds becomes suspect until ``now + gap_hold_s``.

        The lost events may have removed some of them (and stored others, which the index lacks):
        what the engine confirms within the hold stays, the rest goes then (:meth:`_expire_suspects`),
        or earlier and later by the engine's LRU order (:meth:`_frontier`, ``gap_keep_s``). The
        suspects are ordered least recently used first as kvlb saw it: the table's order (stores and
        routed requests re-insert keys, ``PrefixTable.add_speculative``). With
        ``TableLimits.lru_frontier`` that walks the whole table once per gap (bounded by
        ``capacity_blocks``); without it, only the cache's own blocks.
        The engine-hash map stays whole, so later events still chain from and remove these blocks."""
        bit = cache.bit
        if self.limits.lru_frontier:
            held = [key for key, mask in self._holders.items() if mask & bit]
        else:  # no order needed: the cache's own keys, O(its blocks)
            get = self._holders.get
            held = list(dict.fromkeys(key for key in cache.keys.values() if get(key, 0) & bit))
        cache.suspect = dict.fromkeys(held)
        cache.gap_at = now
        self.counters.suspect_marked += len(held)
        cache.suspect_until = now + self.limits.gap_hold_s
        cache.suspect_keep_until = now + self.limits.gap_keep_s
        cache.suspect_frontier = False
        self._suspects[cache] = None
        self._suspect_due = min(self._suspect_due, cache.suspect_until)

    def _frontier(self, cache: CacheSlot, key: int) -> list[int]:
        """The engine removed suspect ``key``: it evicts least recently used first, so every suspect
        used less recently (before ``key`` in ``cache.suspect``) is gone too. Pops and returns them
        (the caller drops them, after its own walk of the engine-hash map); each suspect is popped
        once, so this is amortised O(1) per block. Only with ``TableLimits.lru_frontier``."""
        suspect = cache.suspect
        if not self.limits.lru_frontier or key not in suspect:
            return []
        cache.suspect_frontier = True
        older: list[int] = []
        for other in suspect:
            if other == key:
                break
            older.append(other)
        for other in older:
            del suspect[other]
        return older

    def _touch_suspects(self, replica: ReplicaId, keys: Sequence[int]) -> None:
        """A request routed to ``replica`` uses ``keys``: those still suspect become its most recently
        used (last key first, as in the table), so a later eviction frontier does not pass them."""
        ranks = self._slots.caches.get(replica)
        for cache in ranks.values() if ranks else ():
            suspect = cache.suspect
            if suspect:
                touched = [key for key in reversed(keys) if suspect.pop(key, 0) is None]
                suspect.update(dict.fromkeys(touched))

    def _expire_suspects(self, now: float) -> None:
        """Drop the unconfirmed suspect blocks of every cache whose hold ended by ``now`` (those past
        an eviction frontier stay up to ``suspect_keep_until``)."""
        due = _NEVER
        for cache in list(self._suspects):
            if cache.suspect and cache.suspect_until > now:
                due = min(due, cache.suspect_until)
                continue
            if cache.suspect and cache.suspect_frontier and cache.suspect_keep_until > now:
                cache.suspect_until = cache.suspect_keep_until
                due = min(due, cache.suspect_until)
                continue
            del self._suspects[cache]
            if cache.suspect and self._slots.cache(cache.replica, cache.dp_rank) is cache:
                self.counters.suspect_dropped += self._drop_keys(cache, cache.suspect, now)
            cache.suspect = {}
        self._suspect_due = due

    def settle_suspect(
        self, replica: ReplicaId, found: Sequence[BlockKey], missing: Sequence[BlockKey], now: float
    ) -> tuple[int, int]:
        """What a receipt says of ``replica``'s suspect blocks: ``found`` (the request's keys up to
        the reported point) were cached when the engine admitted it, so they are confirmed;
        ``missing`` (the keys from the reported point to the predicted one) were not, so those still
        suspect are dropped at once. ``found`` keys that were suspect and dropped unconfirmed
        (``CacheSlot.dropped``) are held again: the engine still caches them. Returns ``(confirmed,
        dropped)``, ``confirmed`` counting both; costs nothing without suspects or dropped ones.

        With several DP ranks the receipt does not say which rank served it: every rank's suspects
        are settled (a rank that holds the same prefix is confirmed with it), and nothing dropped is
        held again."""
        if self._suspect_due <= now:
            self._expire_suspects(now)
        if not self._suspects and not self._restorable:
            return 0, 0
        ranks = self._slots.caches.get(replica)
        confirmed = dropped = restored = 0
        if ranks and len(ranks) == 1 and found:  # blocks dropped unconfirmed that it found cached
            restored = self._restore_found(next(iter(ranks.values())), found, now)
        for cache in ranks.values() if ranks and self._suspects else ():
            suspect = cache.suspect
            if not suspect:
                continue
            for key in found:
                if suspect.pop(key, 0) is None:
                    confirmed += 1
            gone = [key for key in missing if key in suspect]
            for key in gone:
                del suspect[key]
            dropped += self._drop_keys(cache, gone)
        self.counters.suspect_confirmed += confirmed
        self.counters.suspect_dropped += dropped
        return confirmed + restored, dropped

    def _remember_dropped(self, cache: CacheSlot, keys: Iterable[int], now: float) -> None:
        """``keys`` were just dropped unconfirmed (their handles kept): remember them, oldest out
        past ``GONE_S`` or ``DROPPED_MAX``."""
        dropped = cache.dropped
        for key in keys:
            dropped.pop(key, None)
            dropped[key] = now
        while dropped:
            oldest = next(iter(dropped))
            if len(dropped) <= DROPPED_MAX and now - dropped[oldest] < GONE_S:
                break
            if len(dropped) > DROPPED_MAX:
                self.counters.dropped_forgotten += 1
            del dropped[oldest]
        if dropped:
            self._restorable[cache] = None

    def _restore_found(self, cache: CacheSlot, found: Sequence[int], now: float) -> int:
        """Hold again those of ``found`` (keys a receipt found cached) that ``cache`` dropped
        unconfirmed; returns how many."""
        dropped = cache.dropped
        while dropped and now - dropped[oldest := next(iter(dropped))] >= GONE_S:
            del dropped[oldest]
        if not dropped:
            self._restorable.pop(cache, None)
            return 0
        if self._slots.cache(cache.replica, cache.dp_rank) is not cache:
            self._restorable.pop(cache, None)
            return 0
        restored = 0
        for key in found:
            if key in dropped:
                restored += self._restore_dropped(cache, key, now)
        if len(self._holders) > self.limits.capacity_blocks:
            self._evict()
        return restored

    def _restore_dropped(self, cache: CacheSlot, key: int, now: float) -> int:
        """The engine showed it still holds ``key``, which ``cache`` dropped unconfirmed and whose
        handle it kept: hold it again. Returns 1 if it was not held."""
        dropped_at = cache.dropped.pop(key, None)
        if dropped_at is None or now - dropped_at >= GONE_S:
            return 0
        mask = self._take_for_hold(cache, key, now)
        self._holders[key] = mask | cache.bit  # most recently used: the engine just used it
        if mask & cache.bit:
            return 0
        if key in self._roots.listed:
            self._roots.moved(mask, mask | cache.bit, self._slots)
        cache.held += 1
        self.counters.suspect_restored += 1
        return 1

    # ------------------------------------------------------------------ stores under lost blocks

    def routes_wanted(self, replica: ReplicaId, now: float) -> bool:
        """Whether requests routed to ``replica`` should be noted (:meth:`note_routes`): one of its
        caches had an event gap within the last ``GONE_S`` seconds."""
        ranks = self._slots.caches.get(replica)
        return ranks is not None and any(now - cache.gap_at < GONE_S for cache in ranks.values())

    def note_routes(
        self,
        replica: ReplicaId,
        keys: Sequence[BlockKey],
        token_ids: Sequence[int],
        block_hashes: Callable[[Sequence[int], int], Sequence[int]],
        now: float,
    ) -> None:
        """A request routed to ``replica`` names the blocks ``keys`` of ``token_ids``, and
        ``block_hashes`` gives the engine's own hashes of them (chained from the root). Kept (by
        reference, O(1)) by every cache of the replica whose last gap is within ``GONE_S``
        (``CacheSlot.route_ring``), so that a later store under one of those blocks, which the lost
        events may have stored, is not skipped as under an unknown parent (:meth:`_resolve_parent`,
        which computes hashes only then). Nothing is held here: the request may find none cached."""
        ranks = self._slots.caches.get(replica)
        tokens = len(keys) * self._block_size
        if not keys or len(token_ids) < tokens or tokens > ROUTED_TOKENS:
            return
        for cache in ranks.values() if ranks else ():
            if now - cache.gap_at >= GONE_S:
                continue
            ring = cache.route_ring
            ring.append(RoutedPrompt(tuple(keys), token_ids, block_hashes))
            cache.route_tokens += tokens
            while len(ring) > ROUTED_PROMPTS or cache.route_tokens > ROUTED_TOKENS:
                cache.route_tokens -= len(ring.popleft().keys) * self._block_size
                self.counters.routed_forgotten += 1

    def _find_routed(self, cache: CacheSlot, parent: int, child_tokens: bytes) -> bool:
        """Find ``parent`` among the blocks of the requests routed since the gap: those whose prompt
        holds ``child_tokens`` (the packed tokens of the first block stored under it) right after a
        block; the newest request first, computing the engine hashes of one candidate prefix at a
        time. On a match, its path's hashes go to ``CacheSlot.routed``. Work: a bytes search per
        kept request, and one hash chain per candidate position."""
        step = len(child_tokens)
        for prompt in reversed(cache.route_ring):
            if prompt.packed is None:
                prompt.packed = pack_tokens(prompt.token_ids[: len(prompt.keys) * self._block_size])
            packed = prompt.packed
            at = packed.find(child_tokens, step)
            while at > 0:
                if at % step == 0:
                    depth = at // step  # the parent is block depth - 1
                    hashes = prompt.block_hashes(
                        prompt.token_ids[: depth * self._block_size], self._block_size
                    )
                    if len(hashes) == depth and hashes[-1] == parent:
                        self._memo_routed(cache, prompt.keys[:depth], hashes)
                        return True
                at = packed.find(child_tokens, at + 1)
        return False

    def _memo_routed(self, cache: CacheSlot, keys: Sequence[int], engine_hashes: Sequence[int]) -> None:
        routed = cache.routed
        parent: int | None = None
        for key, engine_hash in zip(keys, engine_hashes, strict=True):
            routed.pop(engine_hash, None)
            routed[engine_hash] = (key, parent)
            parent = engine_hash
        while len(routed) > ROUTED_MAX:
            del routed[next(iter(routed))]
            self.counters.routed_forgotten += 1

    def _resolve_parent(self, cache: CacheSlot, parent: int, child_tokens: bytes, now: float) -> int | None:
        """The engine stores under ``parent``, a block the cache does not map: if a request routed
        since the last gap named it (:meth:`_find_routed`), the engine holds that block (it chains
        under it now) and, as a radix tree does, every block on its path to the root. Hold them
        under those hashes (confirming suspect ones, holding again those dropped unconfirmed), from
        ``parent`` up to the first one held and not in doubt, and return the parent's key (the store
        is applied, counted in ``routed_resolved``); ``None`` if no routed request named it.
        Only for an unknown parent: triggered for one in doubt (suspect, dropped unconfirmed) too,
        it left more of the engine's blocks missing in ``tests/integration/test_trtllm_gap_identity.py``
        (171 against 168 over its eight sequences)."""
        routed = cache.routed
        found = routed.get(parent)
        if found is None and self._find_routed(cache, parent, child_tokens):
            found = routed.get(parent)
        if found is None:
            return None
        get = self._holders.get
        bit = cache.bit
        held = 0
        engine_hash, entry = parent, found
        for _ in range(len(routed)):  # the parent first: the root ends most recent, as in a store
            key, above = entry
            settled = get(key, 0) & bit and key not in cache.suspect and key not in cache.dropped
            if settled and cache.keys.get(engine_hash) == key:
                break  # held under this handle, not in doubt: so is the rest of the path
            cache.dropped.pop(key, None)
            held += self._hold(cache, key, engine_hash, now)
            next_entry = None if above is None else routed.get(above)
            if above is None or next_entry is None:
                break
            engine_hash, entry = above, next_entry
        self.counters.routed_resolved += 1
        self.counters.routed_held += held
        return found[0]

    # ------------------------------------------------------------------ receipts with engine hashes

    def learn_blocks(
        self,
        replica: ReplicaId,
        keys: Sequence[BlockKey],
        engine_hashes: Sequence[int],
        routed_at: float,
        *,
        hold: bool,
    ) -> tuple[int, int, int]:
        """Blocks a receipt found cached on ``replica``, with the engine hashes the router computed
        for them: ``keys[i]`` is the request's key ``i`` and ``engine_hashes[i]`` the engine's hash of
        the same block (chained from the root). Returns ``(matched, mismatched, learned)``.

        * Check: a hash the cache maps to the same key ``matched``, to another key ``mismatched``
          (the computed hashes are not the engine's: the caller must stop trusting them).
        * With ``hold`` and no mismatch: the blocks become real holdings under those hashes, as a
          ``Stored`` would make them (so the engine's later events remove them and chain from them),
          from the root up to the first one whose removal was applied after ``routed_at`` (the
          request's routing, before its admission): the receipt shows the cache at the admission, so
          such a removal may be newer, and it took every block after it with it. A removal applied
          before the routing is older than the receipt's view: the engine stored the block again.
          Suspect ones are confirmed; ``learned`` counts new holdings.

        Only for a replica with one cache (with several DP ranks a receipt does not say which)."""
        ranks = self._slots.caches.get(replica)
        if not ranks or len(ranks) != 1:
            return 0, 0, 0
        cache = next(iter(ranks.values()))
        if cache.gone is None:
            cache.gone = {}
        get = cache.keys.get
        matched = mismatched = 0
        for key, engine_hash in zip(keys, engine_hashes, strict=False):
            known = get(engine_hash)
            if known is not None:
                matched += known == key
                mismatched += known != key
        if not hold or mismatched or routed_at <= cache.gone_floor:
            return matched, mismatched, 0
        learned = 0
        gone = cache.gone
        for key, engine_hash in zip(keys, engine_hashes, strict=False):
            if gone.get(engine_hash, -_NEVER) >= routed_at:
                break
            learned += self._hold(cache, key, engine_hash, routed_at)
        if len(self._holders) > self.limits.capacity_blocks:
            self._evict()
        return matched, mismatched, learned

    def held_prefix(self, replica: ReplicaId, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` one of ``replica``'s caches really holds (speculative entries
        not counted): a receipt that found more cached has something to teach."""
        ranks = self._slots.caches.get(replica)
        if not ranks:
            return 0
        held = self._holders.get
        best = 0
        for cache in ranks.values():
            bit = cache.bit
            depth = 0
            for key in keys:
                if not held(key, 0) & bit:
                    break
                depth += 1
            best = max(best, depth)
        return best

    def _take_for_hold(self, cache: CacheSlot, key: int, now: float) -> int:
        """``key``'s holder mask, popped so that re-inserting it makes it most recently used: a real
        holding on ``cache``'s replica confirms its speculative entry (counted), which stays to its
        own expiry (``SpecSlot.stored``)."""
        mask = self._holders.pop(key, 0)
        spec = self._slots.specs.get(cache.replica)
        if spec is not None and mask & spec.bit:
            spec.confirm([key], now)
            self.counters.speculative_confirmed += 1
        return mask

    def _hold(self, cache: CacheSlot, key: int, engine_hash: int, now: float) -> int:
        """One block as a real store would hold it (LRU position refreshed); 1 if it was not held."""
        holders = self._holders
        mask = self._take_for_hold(cache, key, now)
        if cache.suspect and cache.suspect.pop(key, 0) is None:
            self.counters.suspect_confirmed += 1
        if mask & cache.bit:
            holders[key] = mask
            if cache.keys.get(engine_hash) != key:
                self._restore(cache, engine_hash, key)
            return 0
        holders[key] = mask | cache.bit
        if key in self._roots.listed:
            self._roots.moved(mask, mask | cache.bit, self._slots)
        if cache.keys.setdefault(engine_hash, key) != key:
            self._remap(cache, engine_hash, key)
        cache.held += 1
        return 1

    @staticmethod
    def _tombstone(cache: CacheSlot, gone: dict[int, float], engine_hash: int, now: float) -> None:
        """Remember a removal; entries older than ``GONE_S`` go first, then the oldest past ``GONE_MAX``
        (``gone_floor`` keeps the latest time forgotten)."""
        gone.pop(engine_hash, None)
        gone[engine_hash] = now
        while gone:
            oldest = next(iter(gone))
            if len(gone) <= GONE_MAX and now - gone[oldest] < GONE_S:
                break
            cache.gone_floor = max(cache.gone_floor, gone.pop(oldest))

    def suspect_blocks(self, replica: ReplicaId) -> int:
        """Suspect entries of ``replica``'s caches (a few may name blocks evicted since)."""
        ranks = self._slots.caches.get(replica)
        return 0 if ranks is None else sum(len(cache.suspect) for cache in ranks.values())

    def engine_hashes(self, replica: ReplicaId, dp_rank: int = 0) -> set[int]:
        """The engine hashes of the blocks one cache holds (what the engine should hold, if the
        index is exact): for checks and debugging, O(the cache's blocks)."""
        cache = self._slots.cache(replica, dp_rank)
        if cache is None:
            return set()
        get = self._holders.get
        return {engine_hash for engine_hash, key in cache.keys.items() if get(key, 0) & cache.bit}

    def held_keys(self, replica: ReplicaId, limit: int) -> list[HeldKeys]:
        """The keys each cache of ``replica`` holds (speculative entries not listed), at most
        ``limit`` per DP rank, ranks ascending (``PrefixIndex.held_keys``): O(the cache's map),
        which holds at most ``2 × held + 64`` entries beyond the dropped ones."""
        ranks = self._slots.caches.get(replica)
        if not ranks:
            return []
        get = self._holders.get
        out: list[HeldKeys] = []
        for dp_rank in sorted(ranks):
            cache = ranks[dp_rank]
            bit = cache.bit
            keys: dict[int, None] = {}
            if limit > 0:
                for key in cache.keys.values():
                    if get(key, 0) & bit:
                        keys[key] = None
                        if len(keys) >= limit:
                            break
            out.append(HeldKeys(dp_rank, cache.held, tuple(BlockKey(k) for k in keys)))
        return out
