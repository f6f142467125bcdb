"""The in-memory prefix table of one key space (pure: no I/O, no clock; callers pass ``now``).

:class:`PrefixTable` is the synchronous read interface of the request path: the router calls
``match`` (overlap per candidate), ``held_blocks`` (a replica's cache fill) and ``add_speculative``
(the blocks a routed request will store) without awaiting anything, and the simulator also calls
``prefix_holders``. It is written by ``apply``/``drop_replica``, through
:class:`~balancer.index.memory.MemoryIndex` (the ``PrefixIndex`` event ingestion writes to, in a
balancer without Redis) or by the fleet mirror (:mod:`balancer.index.redis.mirror`), which replays
the Redis index's stream into a table and installs it for the router.

Layout (router-owned keys and the index structure: ``docs/architecture.md``, decisions 1 and 2):

* ``holders``: block key → bitmask of the caches holding it. Each cache (replica, dp_rank) owns one
  bit ("slot"); each replica with speculative entries owns one more, which stands for its rank 0.
  Freed slots are reused, lowest first, so masks stay small.
* Per cache, ``engine hash → block key``. It resolves parents and removals, and is the cache's
  reverse set, so clearing or dropping a cache costs O(its own blocks), never O(index).
* The dict's insertion order is the LRU order: storing a block, or routing a request that uses it
  (``add_speculative``), re-inserts its key at the end. A routed request's re-insert is deferred:
  its chain is logged, and the log is applied in one pass (each key moved once, to the place of its
  last use) before anything reads the order or inserts a key (``_holders``, ``_settle_order``).
  Over the budget the oldest keys go, with all their holders. A cache's map entries for evicted keys
  stay (they still chain children correctly) and are dropped once they outnumber its live blocks.
* ``match`` walks the request keys ANDing masks; a bit that drops out at depth ``i`` gives its cache
  an overlap of ``i``. Neither ``match`` nor ``apply`` creates an object per block beyond the key.
* A speculative slot's expiries (``SpecSlot``): an add of a chain whose leading keys the slot holds
  (a request's first-token add holds all; a lease, as far as its match saw the slot's bit:
  ``match_confirmed`` notes it) changes no presence there, so those expiries are logged, not
  written; the log is applied before anything reads or removes an expiry, each key once, with its
  newest listing's expiry.
* A real store of a key by a replica holding it speculatively sets the cache's bit beside the
  speculative one and takes nothing away (``SpecSlot.stored`` notes it): the entry is the routed
  request's, which is still in flight, and goes at its own expiry. The slot's bit is on a key
  exactly while the key is in its ``pending``.
* Prompt roots (``held_roots``): :class:`~balancer.index.roots.RootCounts` lists them and keeps,
  per replica, how many it holds. Every site that changes a key's mask tests the key against the
  list and passes a listed root's old and new mask on; ``_settle_order`` moves keys without
  changing masks and needs no test.
"""

from __future__ import annotations

import heapq
import sys
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from itertools import accumulate, compress, filterfalse, islice, pairwise, repeat
from operator import and_, eq, is_not, itemgetter
from typing import cast

import xxhash

from balancer.events import Cleared, KvEvent, Removed, Resync, Stored, split_chained
from balancer.index.base import ApplyResult, IndexStats
from balancer.index.hashing import BlockHasher, full_blocks, pack_tokens
from balancer.index.recovery import _NEVER, GapRecovery
from balancer.index.roots import ROOTS_SLACK, RootCounts
from balancer.index.settle import first_uses, group_by_value
from balancer.index.slots import CacheSlot, SlotRegistry, SpecSlot, TableCounters, TableLimits
from balancer.types import BlockKey, Overlap, ReplicaId

_xxh3 = xxhash.xxh3_64_intdigest  # positional seed: the keyword form costs ~50 ns more per block
_INT_BYTES = 36  # a u64 Python int (three 30-bit digits), for the memory estimate
_NEVER_STORED = float("-inf")  # SpecSlot.stored's time of a key no store confirmed
_COMPACT_SLACK = 64  # stale engine-hash entries tolerated beyond a cache's live count
_EVICT_BATCH_DIVISOR = 128  # evict down to capacity - capacity // 128: one scan of the dict per batch
DEFERRED_EXPIRY_KEYS = 262_144
"""Keys of a speculative slot's re-adds whose expiry writes may wait in its log
(``SpecSlot.defer``); past it the log is applied at once. The log references the chains, which the
expiry heap holds anyway. Applying it writes each distinct key once: a shared prefix, or a request's
two adds (its lease and its first token), is written once per application instead of once per add."""
TOUCH_LOG_KEYS = 262_144
"""Keys of routed chains whose LRU re-insert may wait in the log (``PrefixTable._settle_order``; a
tuple listed again counts once); past it the log is applied at once. The log references the tuples,
which the expiry heap mostly holds anyway: at most about 10 MB when none of their keys is shared
(8 B a reference, 32 B an int). A settle costs about one move per distinct key logged, so a longer
log moves a shared prefix less often: measured 20% less CPU per routed 8k-token request than at
65,536 with repeated prompts, 7% with shared system prompts (``docs/benchmark-history.md``, round 8)."""


class PrefixTable(GapRecovery):
    """Who holds which blocks, for one key space (one :class:`BlockHasher`). Synchronous and pure:
    the request path reads it; ingestion writes it through ``MemoryIndex`` or the fleet mirror."""

    def __init__(self, hasher: BlockHasher, limits: TableLimits | None = None) -> None:
        self.hasher = hasher
        self.limits = limits or TableLimits()
        self.counters = TableCounters()
        self._masks: dict[int, int] = {}
        """Block key → holder mask. Read and written directly only where the LRU order does not
        matter (mask lookups, changing an existing key's mask, deleting a key); everything else goes
        through :attr:`_holders`, which applies the logged re-inserts first."""
        self._touched: dict[int, tuple[int, ...]] = {}
        """Chains routed since the order was last settled, by ``id``, in the order of their last
        listing (``add_speculative``; the log holds them, so their ids are not reused meanwhile)."""
        self._touched_keys = 0
        self._slots = SlotRegistry(self.limits.max_slots, self.counters)
        self._spec_heap: list[tuple[float, int, SpecSlot, Sequence[int]]] = []
        self._spec_seq = 0
        self._spec_count = 0
        self._spec_refs = 0
        """Keys listed by the heap's entries, stale ones included (a key re-added with a new expiry
        is listed again): bounded by ``2 × max_speculative_keys`` (:meth:`_compact_spec_heap`)."""
        self._block_size = hasher.block_size
        self._lookahead = hasher.lookahead_tokens
        cap = self.limits.capacity_blocks
        self._evict_target = cap - cap // _EVICT_BATCH_DIVISOR
        self._suspects: dict[CacheSlot, None] = {}
        """Caches holding suspect keys (after an event gap, ``TableLimits.gap_hold_s``)."""
        self._suspect_due = _NEVER
        """The earliest ``suspect_until`` of those caches."""
        self._restorable: dict[CacheSlot, None] = {}
        """Caches that may remember blocks dropped unconfirmed (``CacheSlot.dropped``; an entry may
        outlive them: it goes when a receipt finds it empty)."""
        self._roots = RootCounts()
        """Keys that began a prompt chain: the first block of a ``Stored`` with no parent, or of a
        routed prompt (``add_speculative``), and per replica how many of them it holds, for
        :meth:`held_roots`. Every change of a listed root's mask is passed on
        (``RootCounts.moved``): each site that changes a mask tests the key's membership in
        ``_roots.listed``."""

    @property
    def _holders(self) -> dict[int, int]:
        """The block key → holder mask dict, its order settled (the LRU order, oldest first)."""
        if self._touched:
            self._settle_order()
        return self._masks

    @_holders.setter
    def _holders(self, value: dict[int, int]) -> None:
        self._masks = value
        self._touched = {}
        self._touched_keys = 0

    def _settle_order(self) -> None:
        """Apply the logged re-inserts: each logged key still in the table goes to the end once, in
        the order of its last use. The same order as re-inserting each chain when it was routed (last
        key first), since a re-insert only moves keys to the end, a later one overrides an earlier one,
        and meanwhile keys were only deleted or had their masks changed (which keeps their place)."""
        masks = self._masks
        touched = self._touched
        self._touched = {}
        self._touched_keys = 0
        # newest use first: the newest chain first, each chain first key first (its last re-insert)
        newest_first = first_uses(reversed(touched.values()))
        # one pop per key: a key no longer in the table gives None (a mask is never None)
        popped: list[int | None] = list(map(masks.pop, newest_first, repeat(None)))
        if None in popped:
            kept = list(map(is_not, popped, repeat(None)))
            present = list(compress(newest_first, kept))
            values = cast("list[int]", list(compress(popped, kept)))
        else:
            present, values = list(newest_first), cast("list[int]", popped)
        masks.update(zip(reversed(present), reversed(values), strict=True))

    def _log_touch(self, keys: tuple[int, ...]) -> None:
        """Log a routed chain's re-insert (applied by :meth:`_settle_order`). A request's two adds
        (its lease and its first token) list the same tuple: the second only moves its listing to
        the end (the newer listing moves every key of the older one), and is not counted again."""
        touched = self._touched
        if touched.pop(id(keys), None) is None:
            self._touched_keys += len(keys)
        touched[id(keys)] = keys
        if self._touched_keys > TOUCH_LOG_KEYS:
            self._settle_order()

    # ------------------------------------------------------------------ events

    def apply(self, replica: ReplicaId, events: Iterable[KvEvent], now: float) -> ApplyResult:
        """Apply one replica's events in order (semantics in :mod:`balancer.index.base`)."""
        if self._spec_heap and self._spec_heap[0][0] <= now:
            self._expire(now)
        if self._suspect_due <= now:
            self._expire_suspects(now)
        result = ApplyResult()
        for event in events:
            if type(event) is Stored:
                self._store(replica, event, result, now)
            elif type(event) is Removed:
                self._remove(replica, event, result, now)
            elif isinstance(event, Cleared | Resync):  # speculative entries stay: requests are in flight
                if (cache := self._slots.cache(replica, event.dp_rank)) is None:
                    pass
                elif type(event) is Resync and event.reason == "gap" and self.limits.gap_hold_s > 0:
                    self._suspect_all(cache, now)
                else:
                    self._clear(cache)
                result.cleared_caches += type(event) is Cleared
                result.resyncs += type(event) is Resync
        return result

    def _store(self, replica: ReplicaId, event: Stored, result: ApplyResult, now: float) -> None:
        if event.chained and not self._chain_applies_whole(replica, event):
            for piece in split_chained(event):
                self._store(replica, piece, result, now)
            return
        count = len(event.engine_hashes)
        if (
            event.block_size != self._block_size
            or event.lookahead_tokens != self._lookahead
            or len(event.tokens) < 4 * (count * self._block_size + self._lookahead)
        ):
            result.skipped_block_size_mismatch += 1
            return
        if not count:
            return
        cache = self._slots.cache(replica, event.dp_rank)
        if event.parent is None:
            seed = self.hasher.root_seed(event.lora_name, event.cache_salt)
        else:
            known = None if cache is None else cache.keys.get(event.parent)
            if known is None and cache is not None and cache.route_ring:  # stored in lost events?
                known = self._resolve_parent(cache, event.parent, event.tokens[: 4 * self._block_size], now)
            if known is None:
                result.skipped_unknown_parent += 1
                return
            seed = known
        if cache is None:
            cache = self._slots.new_cache(replica, event.dp_rank)
            if cache is None:
                return
        if cache.suspect and event.parent is not None and cache.suspect.pop(seed, 0) is None:
            self.counters.suspect_confirmed += 1  # the engine chained under it: it holds it
        result.stored_blocks += self._store_chain(cache, seed, event, now)
        if event.parent is None:  # the chain's first key, as _store_chain mapped its engine hash
            self._note_root(cache.keys[event.engine_hashes[0]])
        if cache.dropped and event.parent is not None and seed in cache.dropped:
            # dropped unconfirmed, but the engine holds it; after its children, as add_speculative
            # orders them (a parent is used at least as recently as its child)
            self._restore_dropped(cache, seed, now)
        if len(self._holders) > self.limits.capacity_blocks:
            result.evicted_blocks += self._evict()

    def _chain_applies_whole(self, replica: ReplicaId, event: Stored) -> bool:
        """Whether storing a ``chained`` event as one chain gives what storing its one-block events
        in order gives: its blocks fit the pool, the cache exists and knows the first parent (or it
        is a root), nothing of the cache is suspect or dropped (whose handling looks at each event's
        parent), and the table has room for every block (no eviction between two of the events).
        Each event's parent is then the key the one before stored, which is where the chain goes on."""
        cache = self._slots.cache(replica, event.dp_rank)
        return (
            cache is not None
            and event.block_size == self._block_size
            and event.lookahead_tokens == self._lookahead
            and not cache.suspect
            and not cache.dropped
            and (event.parent is None or event.parent in cache.keys)
            and len(self._masks) + len(event.engine_hashes) <= self.limits.capacity_blocks
        )

    def _store_chain(self, cache: CacheSlot, seed: int, event: Stored, now: float) -> int:
        """The hot loop: hash each block, set this cache's bit, map its engine hash."""
        holders = self._holders
        pop = holders.pop
        setdefault = cache.keys.setdefault
        bit = cache.bit
        spec = self._slots.specs.get(cache.replica)
        spec_bit = spec.bit if spec is not None else 0  # 0: no key has it
        stored: list[int] = []
        roots = self._roots.listed
        tokens = event.tokens
        xxh3 = _xxh3
        step = 4 * self._block_size
        end = step * len(event.engine_hashes)
        span = step + 4 * self._lookahead
        key = seed
        already = 0
        suspect = cache.suspect
        for engine_hash, start, stop in zip(
            event.engine_hashes, range(0, end, step), range(span, end + span, step), strict=True
        ):
            key = xxh3(tokens[start:stop], key)
            if suspect and suspect.pop(key, 0) is None:  # stored again: the engine holds it
                self.counters.suspect_confirmed += 1
            mask = pop(key, 0)
            if spec_bit and mask & spec_bit:  # a real store confirms a speculative one (kept to its expiry)
                stored.append(key)
            if mask & bit:  # already held: a re-store, or a second handle for the same tokens
                holders[key] = mask
                already += 1
                self._restore(cache, engine_hash, key)
            else:
                holders[key] = mask | bit if mask else bit  # share the bit object: no int per block
                if key in roots:
                    self._roots.moved(mask, mask | bit, self._slots)
                if setdefault(engine_hash, key) is not key:  # a known handle: same or other tokens
                    self._remap(cache, engine_hash, key)
        cache.held += len(event.engine_hashes) - already
        if stored and spec is not None:
            spec.confirm(stored, now)
            self.counters.speculative_confirmed += len(stored)
        return len(event.engine_hashes)

    def _remap(self, cache: CacheSlot, engine_hash: int, key: int) -> None:
        prev = cache.keys[engine_hash]
        if prev != key:  # the handle pointed at other tokens: release those
            self._release(cache, prev)
            cache.keys[engine_hash] = key

    def _restore(self, cache: CacheSlot, engine_hash: int, key: int) -> None:
        prev = cache.keys.get(engine_hash)
        if prev == key:
            return
        if prev is not None:
            self._release(cache, prev)
        cache.keys[engine_hash] = key
        cache.dups[key] = cache.dups.get(key, 0) + 1

    def _remove(self, replica: ReplicaId, event: Removed, result: ApplyResult, now: float) -> None:
        cache = self._slots.cache(replica, event.dp_rank)
        if cache is None:
            result.unknown_removals += len(event.engine_hashes)
            return
        pop = cache.keys.pop
        suspect = cache.suspect
        gone = cache.gone
        older: list[int] = []
        for engine_hash in event.engine_hashes:
            if gone is not None:
                self._tombstone(cache, gone, engine_hash, now)
            key = pop(engine_hash, None)
            if key is None:
                result.unknown_removals += 1
                continue
            if suspect:
                older += self._frontier(cache, key)
                suspect.pop(key, None)
            if self._release(cache, key):
                result.removed_blocks += 1
        if older:  # after the walk: dropping may compact the engine-hash map
            dropped = self._drop_keys(cache, older, now)
            self.counters.suspect_dropped += dropped
            self.counters.suspect_frontier_dropped += dropped

    def _release(self, cache: CacheSlot, key: int) -> bool:
        """One handle of ``key`` went from ``cache``; clear its bit if it was the last live one."""
        if cache.dropped:
            cache.dropped.pop(key, None)  # its handle goes: a removal would no longer find it
        dups = cache.dups
        if dups and key in dups:
            if dups[key] > 1:
                dups[key] -= 1
            else:
                del dups[key]
            return True
        holders = self._masks  # no insert: the order may wait
        mask = holders.get(key, 0)
        if not mask & cache.bit:
            return False  # evicted earlier: the handle was stale
        if key in self._roots.listed:
            self._roots.moved(mask, mask ^ cache.bit, self._slots)
        if mask := mask ^ cache.bit:
            holders[key] = mask  # an existing key keeps its LRU position
        else:
            del holders[key]
        cache.held -= 1
        return True

    def _clear(self, cache: CacheSlot) -> int:
        self._unset(cache.keys.values(), cache.bit)
        held, cache.keys, cache.dups, cache.held = cache.held, {}, {}, 0
        cache.suspect = {}
        cache.dropped = {}
        self._restorable.pop(cache, None)
        cache.suspect_frontier = False
        cache.gap_at, cache.routed, cache.route_ring, cache.route_tokens = float("-inf"), {}, deque(), 0
        if cache.gone is not None:
            cache.gone = {}
            cache.gone_floor = float("-inf")
        return held

    # ------------------------------------------------------------------ budget

    def _evict(self) -> int:
        """Evict the least recently stored keys down to the low-water mark; returns how many."""
        holders = self._holders
        victims = list(islice(holders, len(holders) - self._evict_target))
        roots = self._roots.listed
        for key in victims:
            mask = holders.pop(key)
            if key in roots:
                self._roots.moved(mask, 0, self._slots)
            self._drop_holders(key, mask)
        self.counters.evicted_blocks += len(victims)
        return len(victims)

    def _unset(self, keys: Iterable[int], bit: int) -> None:
        holders = self._masks  # no insert: the order may wait
        roots = self._roots.listed
        for key in keys:
            mask = holders.get(key, 0)
            if mask & bit:
                if key in roots:
                    self._roots.moved(mask, mask ^ bit, self._slots)
                mask ^= bit
                if mask:
                    holders[key] = mask  # an existing key keeps its LRU position
                else:
                    del holders[key]

    def _drop_holders(self, key: int, mask: int) -> None:
        owners = self._slots.owners
        while mask:
            low = mask & -mask
            mask ^= low
            owner = owners[low.bit_length() - 1]
            if type(owner) is CacheSlot:
                owner.held -= 1
                if owner.dups:
                    owner.dups.pop(key, None)
                if self._crowded(owner):
                    self._compact(owner)
            elif isinstance(owner, SpecSlot) and owner.expiry.pop(key, None) is not None:
                self._spec_count -= 1
                if owner.stored:
                    owner.stored.pop(key, None)

    @staticmethod
    def _crowded(cache: CacheSlot) -> bool:
        """Whether stale map entries outnumber the live ones (held, or dropped unconfirmed)."""
        return len(cache.keys) > 2 * (cache.held + len(cache.dropped)) + _COMPACT_SLACK

    def _compact(self, cache: CacheSlot) -> None:
        """Drop map entries of evicted keys (amortised O(1): runs once they outnumber live ones);
        those of keys dropped unconfirmed after a gap stay (``CacheSlot.dropped``)."""
        get = self._holders.get
        bit = cache.bit
        dropped = cache.dropped
        cache.keys = {h: k for h, k in cache.keys.items() if get(k, 0) & bit or k in dropped}

    # ------------------------------------------------------------------ queries

    def match(
        self,
        keys: Sequence[BlockKey],
        among: Collection[ReplicaId] | None,
        now: float,
        confirmed_only: bool = False,
    ) -> Overlap:
        """Leading blocks of ``keys`` held by each replica in ``among`` (all known when ``None``).

        ``best_rank`` names the rank holding the longest prefix, for replicas with an overlap only
        (0 when that prefix is speculative).
        Pass ``among`` as a frozenset (or tuple) that is reused across calls: its mask is cached.
        ``confirmed_only`` ignores speculative holdings (only blocks the engines reported count).
        """
        if self._spec_heap and self._spec_heap[0][0] <= now:
            self._expire(now)
        if self._suspect_due <= now:
            self._expire_suspects(now)
        mask, template = self._slots.candidates(among)
        if confirmed_only:
            mask &= ~self._slots.spec_mask
        blocks = template.copy()
        ranks: dict[ReplicaId, int] = {}
        group = self._slots.group
        fromkeys = dict.fromkeys
        for depth, bits in self._walk(keys, mask):
            replicas, best = group(bits)
            blocks.update(fromkeys(replicas, depth))
            ranks.update(best)
        return Overlap(blocks, ranks, len(keys))

    def match_confirmed(
        self, keys: Sequence[BlockKey], among: Collection[ReplicaId] | None, now: float
    ) -> tuple[Overlap, dict[ReplicaId, int]]:
        """:meth:`match`, and per replica the part of that overlap the engines reported (speculative
        entries left out; absent: 0), from one walk of ``keys``: what ``match`` gives with and
        without ``confirmed_only``. Each slot's overlap does not depend on the others', so the
        reported overlap is the longest of a replica's cache slots, and the overlap the longest of
        those and its speculative slot. For a tuple of keys, each speculative slot notes how many
        leading keys it holds (``SpecSlot.held``): no result changes, the commitment's add of that
        very tuple only logs those keys' expiries (``add_speculative``)."""
        if self._spec_heap and self._spec_heap[0][0] <= now:
            self._expire(now)
        if self._suspect_due <= now:
            self._expire_suspects(now)
        mask, template = self._slots.candidates(among)
        spec_mask = self._slots.spec_mask
        blocks = template.copy()
        ranks: dict[ReplicaId, int] = {}
        confirmed: dict[ReplicaId, int] = {}
        group = self._slots.group
        fromkeys = dict.fromkeys
        walk = self._walk(keys, mask)
        for depth, bits in walk:  # depths increase: a later update is longer
            replicas, best = group(bits)
            blocks.update(fromkeys(replicas, depth))
            ranks.update(best)
            if sure := bits & ~spec_mask:
                confirmed.update(fromkeys(group(sure)[0], depth))
        if type(keys) is tuple and spec_mask:
            self._note_held(keys, walk, spec_mask)
        return Overlap(blocks, ranks, len(keys)), confirmed

    def _note_held(self, keys: tuple[int, ...], walk: list[tuple[int, int]], spec_mask: int) -> None:
        """Tell each speculative slot of the walk how many leading keys of ``keys`` it holds (a
        slot's bit is on a key exactly while the key is in its ``pending``): a routed request's add
        of ``keys`` to it then writes only the other keys' expiries and logs the rest
        (``SpecSlot.defer``)."""
        owners = self._slots.owners
        for depth, bits in walk:
            bits &= spec_mask
            while bits:
                low = bits & -bits
                bits ^= low
                owner = owners[low.bit_length() - 1]
                if type(owner) is SpecSlot:
                    owner.note_held(keys, depth)

    def _walk(self, keys: Sequence[BlockKey], mask: int) -> list[tuple[int, int]]:
        """``(depth, bits)``, depth increasing: the slots of ``mask`` holding exactly the first
        ``depth`` keys of ``keys`` (depth > 0), at C speed apart from one step per distinct depth.

        ``held[d]`` (the slots holding all of the first ``d`` keys) never grows with ``d``, and
        clearing bits makes a smaller int, so ``held`` is non-increasing and each of its values is one
        run: the slots leaving after the run of ``held[d]`` hold exactly ``d`` keys, where ``d`` is
        the run's last depth."""
        if not mask or not keys:
            return []
        masks = self._key_masks(keys)
        first = masks[0]
        if not first:  # the first key is missing: no slot holds any key
            return []
        same = masks.count(first)  # small ints: compared by identity
        if same == len(masks):  # one holder set for all
            common = mask & first
            return [(same, common)] if common else []
        if not masks[same] and masks[:same].count(first) == same:
            # a shared prefix, then a missing key (a new user message): one run, found without
            # comparing every key's mask with 0 (an int comparison each, twice)
            common = mask & first
            return [(same, common)] if common else []
        if 0 in masks:  # the runs end at the first missing key: a new prompt's tail, typically
            masks = masks[: masks.index(0)]
            if not masks:
                return []
            first = masks[0]
            if masks.count(first) == len(masks):  # e.g. a shared prefix, then a new user message
                common = mask & first
                return [(len(masks), common)] if common else []
        held = list(accumulate(masks, and_, initial=mask))
        walk: list[tuple[int, int]] = []
        values = sorted(set(held), reverse=True)
        for value, after in pairwise(values):
            depth = held.index(after) - 1  # the last depth of ``value``'s run
            if depth:
                walk.append((depth, value ^ after))
        last = values[-1]
        if last and masks:
            walk.append((len(masks), last))
        return walk

    def _key_masks(self, keys: Sequence[BlockKey]) -> Sequence[int]:
        """Each key's mask up to the first key the table does not hold, or further (then 0 for a key
        it does not hold): a missing key gives 0, and so does every AND after it, so the runs are
        those of the keys up to it (``_walk`` cuts there). The masks are read by one ``itemgetter``
        of the keys up to where a prompt seen before ends: about 40% fewer instructions than
        ``dict.get`` through ``map`` into a list (no call's arguments parsed, no default, no list
        grown: 116,000 against 194,000 instructions for 512 keys). That is every key when the last is
        held; none when the first is not (a new prompt); else the keys before a held key followed by
        a missing one, found by halving (a shared system prompt, then a new user message). A key
        missing before there (``KeyError``: an evicted block in the middle) falls back to the
        ``get`` pass over every key."""
        holders = self._masks
        if len(keys) > 1:
            if keys[-1] in holders:
                end = len(keys)
            elif keys[0] not in holders:
                return (0,)
            else:  # keys[held] is held, keys[end] is not: halve until they meet
                held, end = 0, len(keys) - 1
                while end - held > 1:
                    middle = (held + end) // 2
                    if keys[middle] in holders:
                        held = middle
                    else:
                        end = middle
            try:
                read = keys if end == len(keys) else keys[:end]
                found: tuple[int, ...] = itemgetter(*read)(holders) if end > 1 else (holders[keys[0]],)
            except KeyError:
                pass
            else:
                return found
        return list(map(holders.get, keys, repeat(0)))

    def prefix_holders(
        self,
        token_ids: Sequence[int],
        now: float,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> tuple[ReplicaId, ...]:
        """The replicas holding a request's first block (overlap > 0 in :meth:`match`, speculative
        included). Hashes one block and costs nothing per replica without it: candidate pruning
        needs no more, since every other replica has overlap 0."""
        if self._spec_heap and self._spec_heap[0][0] <= now:
            self._expire(now)
        if not full_blocks(len(token_ids), self._block_size, self.hasher.mode):
            return ()
        first_block = pack_tokens(token_ids[: self._block_size + self._lookahead])
        key = _xxh3(first_block, self.hasher.root_seed(lora_name, cache_salt))
        mask = self._masks.get(key, 0)
        return self._slots.group(mask)[0] if mask else ()

    @property
    def has_speculative(self) -> bool:
        """Whether any speculative holding may still be alive."""
        return bool(self._spec_heap)

    # ------------------------------------------------------------------ speculation

    def add_speculative(self, replica: ReplicaId, keys: Sequence[BlockKey], ttl_s: float, now: float) -> None:
        """Count ``replica`` (as its rank 0) as a holder of ``keys`` until ``now + ttl_s``.

        The keys form the speculative slot's own chain, so pass the whole prompt (keys the replica
        already holds included). Re-adding a key extends its expiry; a real store of a key by the
        replica confirms it (``SpecSlot.stored``), and the entry stays until its own expiry, so that
        a ``Cleared``, ``Resync`` or ``Removed`` of an older copy (a replayed history, an eviction the
        request's own prefill undoes) does not take it; expiry is checked by every call given ``now``.
        """
        if self._spec_heap and self._spec_heap[0][0] <= now:
            self._expire(now)
        if ttl_s <= 0 or not keys:
            return
        limit = self.limits.max_speculative_keys
        spec = self._slots.specs.get(replica)
        if spec is None and limit:
            spec = self._slots.new_spec(replica)
        if spec is None:
            self.counters.speculative_overflow += len(keys)
            return
        if self._spec_refs + min(len(keys), limit) > 2 * limit:
            self._compact_spec_heap()  # then at most ``limit`` are listed: room for ``limit`` more
        expiry_s = now + ttl_s
        taken: tuple[int, ...] = keys if type(keys) is tuple else tuple(keys)
        # The first ``held`` keys are pending (the same request's first add, or the match saw the
        # slot's bit on them): their presence cannot change, only their expiries, which the slot
        # logs and writes once per key later. The rest get theirs at once.
        noted = spec.held.get(id(taken))
        held = 0 if noted is None else noted[1]
        new = 0
        if held < len(taken):
            pending = spec.pending
            # Most keys of a routed prompt are pending already (its shared prefix, or the same
            # request's first add): they only get the new expiry, at C speed, in one pass that also
            # finds the new ones. A dict keeps its insertion order and an update keeps an existing
            # key's place, so the keys new to ``pending`` are its last ``len(pending) - known``, in
            # the order they were listed.
            known = len(pending)
            pending.update(zip(taken[held:] if held else taken, repeat(expiry_s)))
            new = len(pending) - known
        if new:
            fresh = list(islice(reversed(pending), new))
            fresh.reverse()
            room = max(0, limit - self._spec_count)
            if new > room:
                self.counters.speculative_overflow += new - room
                refused = fresh[room:]
                for key in refused:  # as if never listed: the keys before them keep their order
                    del pending[key]
                fresh = fresh[:room]
                taken = tuple(filterfalse(set(refused).__contains__, taken))
            self._spec_count += len(fresh)
            bit = spec.bit
            # No need to settle the order first: a new key lands at the end, and this chain, logged
            # below, is newer than every logged one, so the settling pass moves it anyway.
            holders = self._masks
            pop = holders.get if self.limits.lru_frontier else holders.pop  # get: all moved below
            roots = self._roots.listed
            if roots.keys().isdisjoint(fresh):  # the usual case: at C speed, one lookup a key
                for key in fresh:
                    holders[key] = pop(key, 0) | bit  # re-insert: a speculative block counts as recently used
            else:
                for key in fresh:
                    mask = pop(key, 0)
                    holders[key] = mask | bit
                    if key in roots and not mask & bit:
                        self._roots.moved(mask, mask | bit, self._slots)
        if held or spec.deferred:  # the newest listing: applying the log gives its keys this expiry
            spec.defer(taken, expiry_s, DEFERRED_EXPIRY_KEYS)
        spec.note_held(taken, len(taken))  # every key of it is pending now
        if self.limits.lru_frontier:
            # Every key is re-inserted, so the table's order is the order of use (stores and
            # routes), which an event gap's recovery reads as the engine's LRU order
            # (``GapRecovery._suspect_all``). Last key first: a parent block is used at least as
            # recently as its children. The re-insert is logged and applied later in one pass
            # (``_settle_order``): a request's first-token add and the other requests sharing its
            # prefix re-insert the same keys, which the pass moves once.
            if taken:
                self._log_touch(taken)
            if self._suspects:
                self._touch_suspects(replica, taken)
        if taken:
            self._spec_seq += 1
            self._spec_refs += len(taken)
            heapq.heappush(self._spec_heap, (expiry_s, self._spec_seq, spec, taken))
            if keys[0] not in self._roots.listed:  # every caller passes a prompt from its root
                self._note_root(keys[0])
        if len(self._masks) > self.limits.capacity_blocks:
            self._evict()

    def _expire(self, now: float) -> None:
        """Pop due heap entries; a key whose expiry was not extended meanwhile loses its bit."""
        heap = self._spec_heap
        while heap and heap[0][0] <= now:
            expiry_s, _, spec, keys = heapq.heappop(heap)
            self._spec_refs -= len(keys)
            if not spec.alive:
                continue
            if spec.deferred:
                spec.settle()
            pending = spec.pending  # read only, unless some are due (then through ``expiry``)
            # the keys neither confirmed nor extended since (C-speed filter: most were extended).
            # Counting them first is cheaper than the filter (``list.count`` compares in C, and finds
            # the keys of this very add by identity: they share its expiry's float object), and
            # usually finds none: every key re-listed since, by the same request or another.
            expiries = list(map(pending.get, keys))
            if not expiries.count(expiry_s):
                continue
            due = list(compress(keys, map(eq, repeat(expiry_s), expiries)))
            # the pops at C speed (a deque of no length drops what they give back), counted by the
            # dict's size: a key listed twice is popped once (a generator under ``sum`` took 7% of
            # a token-id request's instructions)
            expiry = spec.expiry
            listed = len(expiry)
            deque(map(expiry.pop, due, repeat(None)), maxlen=0)
            expired = listed - len(expiry)
            spec.forget(due)
            self._spec_count -= expired
            self.counters.speculative_expired += expired
            self._unset(due, spec.bit)

    def _compact_spec_heap(self) -> None:
        """Rebuild the heap from the live entries only (one per replica and expiry).

        Each add lists its keys in a new heap entry, and the entry of a key whose expiry changed
        stays until its own expiry (a routed request's keys are listed for ``pending_ttl_s``, the
        upstream first-byte timeout, and again for ``speculative_ttl_s`` after its first token). Under
        a burst those stale lists kept every request's keys alive for a minute: about 22 kB per
        2k-token request (defect 8). Runs when the listed keys would pass ``2 × max_speculative_keys``,
        so it is amortised O(1) per key and the heap lists at most that many."""
        heap: list[tuple[float, int, SpecSlot, Sequence[int]]] = []
        for spec in self._slots.specs.values():
            for expiry_s, keys in group_by_value(spec.expiry).items():
                self._spec_seq += 1
                heap.append((expiry_s, self._spec_seq, spec, keys))
        heapq.heapify(heap)
        self._spec_heap = heap
        self._spec_refs = sum(len(keys) for *_, keys in heap)
        self.counters.speculative_compactions += 1

    @property
    def speculative_listed(self) -> int:
        """Keys the expiry heap lists (stale entries included); at most ``2 × max_speculative_keys``."""
        return self._spec_refs

    # ------------------------------------------------------------------ replicas and stats

    def drop_replica(self, replica: ReplicaId) -> int:
        """Forget every rank and speculative entry of ``replica``; returns the real holdings dropped."""
        caches, spec = self._slots.release(replica)
        dropped = sum(self._clear(cache) for cache in caches)
        if spec is not None:
            self._unset(spec.expiry, spec.bit)
            self._spec_count -= len(spec.expiry)
            spec.expiry = {}
            spec.alive = False
        self._roots.forget(replica)
        return dropped

    def drop_blocks(self, replica: ReplicaId, keys: Iterable[BlockKey]) -> int:
        """Forget ``replica``'s real holdings of ``keys``, on every DP rank; returns the holdings
        dropped (one per rank and key held).

        The operation behind receipts (a replica's blocks past the point its engine reported) and,
        for any caller that knows a replica lost some blocks without saying so, the narrow form of
        :meth:`drop_replica`. Speculative entries stay (they are the router's own bets on requests
        in flight and expire on their own). Other holders of the same keys are untouched, and a key
        that keeps a holder keeps its LRU position. The engine-hash map keeps its entries, as after
        an eviction: a later ``Removed`` of one is ignored, a later ``Stored`` holds the key again,
        and a child still chains from it (the engine still knows its parent)."""
        ranks = self._slots.caches.get(replica)
        if not ranks:
            return 0
        wanted = keys if isinstance(keys, Sequence) else list(keys)
        return sum(self._drop_keys(cache, wanted) for cache in list(ranks.values()))

    def _drop_keys(self, cache: CacheSlot, keys: Iterable[int], dropped_at: float | None = None) -> int:
        """Clear ``cache``'s bit on those of ``keys`` it holds (handles kept); returns how many.
        ``dropped_at``: gap recovery drops them unconfirmed at that time; they are remembered
        (``CacheSlot.dropped``) in case the engine shows it still holds them."""
        holders = self._masks  # no insert: the order may wait
        bit = cache.bit
        dropped = 0
        remembered: list[int] | None = None if dropped_at is None else []
        roots = self._roots.listed
        for key in keys:
            mask = holders.get(key, 0)
            if not mask & bit:
                continue
            if key in roots:
                self._roots.moved(mask, mask ^ bit, self._slots)
            mask ^= bit
            if mask:
                holders[key] = mask
            else:
                del holders[key]
            if cache.dups:
                cache.dups.pop(key, None)
            cache.held -= 1
            dropped += 1
            if remembered is not None:
                remembered.append(key)
        if remembered and dropped_at is not None:
            self._remember_dropped(cache, remembered, dropped_at)
        if self._crowded(cache):
            self._compact(cache)
        return dropped

    def speculated(
        self, replica: ReplicaId, keys: Iterable[BlockKey], now: float, since: float | None = None
    ) -> list[BlockKey]:
        """Those of ``keys`` that ``replica`` holds speculatively at ``now`` and that no real store by
        the replica has confirmed since ``since`` (a request's routing time; ``None``: since they
        were routed there, by any request). A confirmed key stays speculative to its expiry
        (``SpecSlot.stored`` says when a store last confirmed it)."""
        if self._spec_heap and self._spec_heap[0][0] <= now:
            self._expire(now)
        spec = self._slots.specs.get(replica)
        if spec is None or not spec.pending:
            return []
        pending, stored = spec.pending, spec.stored  # presence only: the deferred log may wait
        if not stored:
            return [key for key in keys if key in pending]
        if since is None:
            return [key for key in keys if key in pending and key not in stored]
        return [key for key in keys if key in pending and stored.get(key, _NEVER_STORED) < since]

    def drop_speculated(
        self, replica: ReplicaId, keys: Iterable[BlockKey], now: float, since: float | None = None
    ) -> int:
        """:meth:`drop_blocks` of those of ``keys`` that ``replica`` holds speculatively at ``now``
        and did not store since ``since`` (:meth:`speculated`): a receipt's stale keys, less those
        the engine stored again since the request's routing. One call, so that a table shared
        between threads (:class:`~balancer.index.locked.LockedPrefixTable`) has no store land
        between the two."""
        return self.drop_blocks(replica, self.speculated(replica, keys, now, since))

    def held_blocks(self, replica: ReplicaId) -> int:
        """Blocks ``replica``'s caches hold (over its DP ranks; speculative entries not counted)."""
        ranks = self._slots.caches.get(replica)
        return 0 if ranks is None else sum(cache.held for cache in ranks.values())

    def held_roots(self, among: Collection[ReplicaId] | None, now: float) -> dict[ReplicaId, int]:
        """Per replica of ``among`` (all known when ``None``; the same convention as :meth:`match`),
        how many distinct prompt chains its caches hold the root of: roots stored with no parent,
        and the roots of requests routed there and still prefilling (speculative entries). A root
        held by two DP ranks, or both for real and speculatively, counts once. The counts are kept
        as masks change (:class:`~balancer.index.roots.RootCounts`), so a call costs O(replicas in
        ``among``) beyond the expiries due (``docs/prefix-index.md``, "Held prompt roots")."""
        if self._spec_heap and self._spec_heap[0][0] <= now:
            self._expire(now)
        if self._suspect_due <= now:
            self._expire_suspects(now)
        mask, template = self._slots.candidates(among)
        roots = self._roots
        listed = len(roots.listed)
        if not mask or not listed:
            return template.copy()
        get = roots.by_replica.get
        counts = {replica: get(replica, 0) for replica in template}
        if 2 * (listed - roots.in_table) > listed + ROOTS_SLACK:  # amortised over the roots gone
            roots.prune(self._masks)
        return counts

    @property
    def roots_listed(self) -> int:
        """Root keys listed for :meth:`held_roots` (gone ones included until pruned): at most
        ``2 ×`` the live roots at the last pruning plus a slack of 64."""
        return len(self._roots.listed)

    def _note_root(self, key: int) -> None:
        self._roots.note(key, self._masks.get(key, 0), self._slots, self._masks)

    def _relist_roots(self, keys: Iterable[int]) -> None:
        """List exactly ``keys`` as roots and count them against the table as it is (a snapshot's
        load, after the masks): O(keys)."""
        self._roots.relist(keys, self._masks, self._slots)

    def stats(self) -> IndexStats:
        """Sizes; ``bytes_per_block`` is an estimate (container sizes + 36 B per stored u64 int)."""
        by_replica = {r: sum(c.held for c in ranks.values()) for r, ranks in self._slots.caches.items()}
        held = sum(by_replica.values())
        size = sys.getsizeof(self._masks) + _INT_BYTES * len(self._masks) + self._roots.size_bytes()
        for ranks in self._slots.caches.values():
            for cache in ranks.values():
                size += sys.getsizeof(cache.keys) + _INT_BYTES * len(cache.keys)
                size += sys.getsizeof(cache.dups) if cache.dups else 0
        return IndexStats(
            unique_blocks=len(self._masks),
            held_blocks=held,
            blocks_by_replica=by_replica,
            speculative_entries=self._spec_count,
            capacity_blocks=self.limits.capacity_blocks,
            bytes_per_block=size / held if held else None,
        )
