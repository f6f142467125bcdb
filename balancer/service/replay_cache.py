"""The what-if's model of the cache the replayed decisions would have built (pure).

A what-if (:mod:`balancer.service.whatif`) re-runs a policy on recorded decisions. Each record's
prefix matches are those of the cache the *actual* decisions built: a prefix the replay moves to
another replica would, in a real run, find that replica warm from then on, and the first one colder.
Read as recorded, the matches counted every moved request of a shared prefix as a miss (on a small
``tenants`` stream, ``overlap_credit=0`` was predicted at a hit rate of 0.513 for 0.909 measured).

:class:`ReplayCache` follows both placements along the records, in their order. Each record
carries its prefix marks (``RouteRequest.prefix_marks``, :func:`balancer.index.marks.prefix_marks`:
the index's chained block keys at a bounded set of prefix lengths). Per replica it keeps

* ``routed``: the marks the recorded decisions put there (the request's whole prefix, at commitment);
* ``replayed``: the marks the replayed decisions put there;
* ``found``: marks the index held there that no recorded decision of the window put there (warm
  before the window, another worker's or balancer's traffic): they would be there either way.

A record's recorded match on a replica is evidence: marks within it are held (those not ``routed``
are ``found``); ``routed`` or ``found`` marks past it were evicted (or expired) in the real run, and
are taken as evicted in the replayed one too. The replayed match is the longest run of leading marks
``replayed`` or ``found``; when it covers every mark within the recorded match it is the recorded
match (exact) or more. So a replay whose decisions are the recorded ones sees the recorded matches
exactly.

Evictions a different placement would cause: a replica given more prefixes fills sooner. Where the
replayed replica's KV pool size is known (the record's load snapshot), each mark counts the blocks
since the mark before it, and the replay's placements there hold more than the real run's by more
than the room the real run left (pool less the index's held blocks), :meth:`ReplayCache.place`
evicts the marks the replay placed least recently (a prompt's longest part first, as a radix cache
evicts leaves first). A replay whose placements are the recorded ones holds what the real run held
and evicts nothing of its own. What it does not model: evictions where the pool size is unknown,
and which speculative entries would still be prefilling (the replayed part is counted confirmed).
The load is :mod:`balancer.service.replay_load`'s.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from balancer.types import Overlap, ReplicaId

MAX_MARKS_HELD = 1_000_000
"""Marks the model holds at most, over every replica's sets (a set slot, and an int shared by the
sets of one record: 52 MB traced at the bound, for distinct 63-bit keys of 72-block prompts; a mark
the replay placed is kept in LRU order, and with half the marks placed by the replay the traced
size per mark grew 1.85 times, 33.6 to 62.1 B, so about 96 MB at the bound).
Reached (a replay of 100,000 decisions of long, distinct prompts), the records after it are scored
on their recorded matches, counted in :attr:`ReplayCache.unmodelled`. The default of the setting
``console.whatif_max_cache_marks``, which the console passes (:func:`balancer.service.whatif.replay`)."""


@dataclass(slots=True)
class _Replica:
    routed: set[int] = field(default_factory=set)
    replayed: OrderedDict[int, int] = field(default_factory=OrderedDict)
    """The marks the replayed decisions put here, each with the blocks it adds to the mark before it
    in its prompt, least recently placed first (the replay's LRU order)."""
    found: set[int] = field(default_factory=set)
    real_blocks: int = 0
    """Blocks of the marks ``routed`` or ``found`` here (what the real run held of the window)."""
    replay_blocks: int = 0
    """Blocks of the marks ``replayed`` or ``found`` here (what the replay holds of it)."""


@dataclass(slots=True)
class ReplayCache:
    """Both placements along a replay (module docstring). Call :meth:`overlap` for a record, decide
    on what it returns, then :meth:`place` the recorded and the replayed choice."""

    replicas: dict[ReplicaId, _Replica] = field(default_factory=dict)
    marks_held: int = 0
    """Marks held in all the sets (the model's size)."""
    max_marks: int = MAX_MARKS_HELD
    """The bound on :attr:`marks_held`."""
    unmodelled: int = 0
    """Records with marks scored on their recorded matches, the model being full."""
    evicted: int = 0
    """Marks the replay evicted, a replica's cache being fuller than in the real run (:meth:`place`)."""

    def _of(self, replica: ReplicaId) -> _Replica:
        state = self.replicas.get(replica)
        if state is None:
            state = self.replicas[replica] = _Replica()
        return state

    def overlap(
        self, candidates: Sequence[ReplicaId], recorded: Overlap, marks: Sequence[tuple[int, int]]
    ) -> Overlap:
        """The matches ``candidates`` would have shown had the replayed decisions been made: the
        recorded ones where no mark says otherwise (and all of them when ``marks`` is empty)."""
        if not marks:
            return recorded
        if self.marks_held >= self.max_marks:
            self.unmodelled += 1
            return recorded
        blocks = dict(recorded.blocks)
        speculative = dict(recorded.speculative_blocks)
        for replica in dict.fromkeys(candidates):
            state = self._of(replica)
            routed, found, placed = state.routed, state.found, state.replayed
            held = recorded.blocks.get(replica, 0)
            matched = previous = 0
            covered = True
            short = False  # a mark within the recorded match is missing from the replayed cache
            for length, key in marks:
                segment, previous = length - previous, length
                if length <= held:
                    if key not in routed and key not in found:
                        found.add(key)
                        self.marks_held += 1
                        state.real_blocks += segment
                        if key not in placed:
                            state.replay_blocks += segment
                elif key in routed or key in found:  # evicted in the real run
                    state.real_blocks -= segment
                    if key in placed or key in found:
                        state.replay_blocks -= segment
                    self.marks_held -= _discard(routed, key) + _discard(found, key)
                    if placed.pop(key, None) is not None:
                        self.marks_held -= 1
                if covered:
                    if key in placed or key in found:
                        matched = length
                    else:
                        covered = False
                        short = length <= held
            replayed = matched if short else max(held, matched)
            if replayed != held:
                blocks[replica] = replayed
                if replica in speculative:
                    speculative[replica] = min(speculative[replica], replayed)
        return Overlap(
            blocks,
            recorded.best_rank,
            recorded.request_blocks,
            speculative,
            recorded.held_blocks,
            recorded.held_roots,
        )

    def place(
        self,
        routed: ReplicaId,
        replayed: ReplicaId,
        marks: Sequence[tuple[int, int]],
        *,
        capacity_blocks: float | None = None,
        held_blocks: int | None = None,
    ) -> None:
        """The request's prefix is now held where it was routed, and where the replay put it (its
        marks there most recently used, the shortest prefix last, as a radix cache evicts leaves
        first). ``capacity_blocks``: the replayed replica's KV pool and ``held_blocks`` what its
        cache held in the real run (the record's :attr:`Overlap.held_blocks`), when known: if the
        replay's placements hold more blocks there than the real run's, by more than the room the
        real run left (``capacity − held``), its least recently placed marks are evicted until
        they fit (:attr:`evicted`). A replay that places as recorded evicts nothing of its own."""
        if not marks or self.marks_held >= self.max_marks:
            return
        into = self._of(routed)
        into_routed = into.routed
        previous = 0
        for length, key in marks:
            if key not in into_routed:
                into_routed.add(key)
                self.marks_held += 1
                if key not in into.found:
                    into.real_blocks += length - previous
            previous = length
        state = self._of(replayed)
        into_replayed, found = state.replayed, state.found
        for index in range(len(marks) - 1, -1, -1):
            length, key = marks[index]
            segment = length - (marks[index - 1][0] if index else 0)
            if key in into_replayed:
                into_replayed.move_to_end(key)
                continue
            into_replayed[key] = segment
            self.marks_held += 1
            if key not in found:
                state.replay_blocks += segment
        if capacity_blocks is not None and held_blocks is not None:
            self._evict(state, max(0.0, capacity_blocks - held_blocks))

    def _evict(self, state: _Replica, room_blocks: float) -> None:
        """Evict ``state``'s least recently placed marks while the replay holds more than the real
        run there by more than ``room_blocks``."""
        replayed, found = state.replayed, state.found
        while state.replay_blocks - state.real_blocks > room_blocks and replayed:
            key, segment = replayed.popitem(last=False)
            self.marks_held -= 1
            self.evicted += 1
            if key not in found:
                state.replay_blocks -= segment


def _discard(keys: set[int], key: int) -> int:
    if key in keys:
        keys.remove(key)
        return 1
    return 0
