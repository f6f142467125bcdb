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
exactly. What it does not model: the evictions a different placement would cause (a replica given
more prefixes fills sooner), which speculative entries would still be prefilling (the replayed part
is counted confirmed), and the load: each decision still reads the recorded load snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from balancer.types import Overlap, ReplicaId

MAX_MARKS_HELD = 1_000_000
"""Marks the model holds at most, over every replica's sets (a set slot, and an int shared by the
sets of one record: 52 MB traced at the bound, for distinct 63-bit keys of 72-block prompts).
Reached (a replay of 100,000 decisions of long, distinct prompts), the records after it are scored
on their recorded matches, counted in :attr:`ReplayCache.unmodelled`. The default of the setting
``console.whatif_max_cache_marks``, which the console passes (:func:`balancer.service.whatif.replay`)."""


@dataclass(slots=True)
class _Replica:
    routed: set[int] = field(default_factory=set)
    replayed: set[int] = field(default_factory=set)
    found: set[int] = field(default_factory=set)


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
            held = recorded.blocks.get(replica, 0)
            matched = 0
            covered = True
            short = False  # a mark within the recorded match is missing from the replayed cache
            for length, key in marks:
                if length <= held:
                    if key not in state.routed and key not in state.found:
                        state.found.add(key)
                        self.marks_held += 1
                elif key in state.routed or key in state.found:  # evicted in the real run
                    self.marks_held -= _discard(state.routed, key) + _discard(state.found, key)
                    self.marks_held -= _discard(state.replayed, key)
                if covered:
                    if key in state.replayed or key in state.found:
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

    def place(self, routed: ReplicaId, replayed: ReplicaId, marks: Sequence[tuple[int, int]]) -> None:
        """The request's prefix is now held where it was routed, and where the replay put it."""
        if not marks or self.marks_held >= self.max_marks:
            return
        into_routed, into_replayed = self._of(routed).routed, self._of(replayed).replayed
        for _, key in marks:
            if key not in into_routed:
                into_routed.add(key)
                self.marks_held += 1
            if key not in into_replayed:
                into_replayed.add(key)
                self.marks_held += 1


def _discard(keys: set[int], key: int) -> int:
    if key in keys:
        keys.remove(key)
        return 1
    return 0
