"""The prompt roots of the prefix table and how many each replica holds (pure: no I/O, no clock).

:class:`RootCounts` is the part of :class:`~balancer.index.table.PrefixTable` behind
``held_roots``: the listed root keys (the first block of a ``Stored`` with no parent, or of a
routed prompt) and, kept as their holder masks change, per replica how many of them its slots hold
(a root held by two DP ranks, or both for real and speculatively, counts once) and how many listed
roots are in the table at all. The table tells it of every change of a listed root's mask
(:meth:`RootCounts.moved`); a key that is not a listed root costs its caller one dict membership
test. So a query costs O(replicas asked about), not O(roots): the numbers are those of walking every
listed root's mask, which ``tests/unit/test_index_roots_counts.py`` checks after every step of long
random sequences.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from balancer.index.slots import SlotRegistry
from balancer.types import ReplicaId

ROOTS_SLACK = 64
"""Listed roots tolerated beyond twice the live ones before a pruning pass (:meth:`RootCounts.note`)."""


class RootCounts:
    """Listed prompt roots and, per replica, how many of them its slots hold."""

    __slots__ = ("by_replica", "in_table", "listed", "live_at_prune")

    def __init__(self) -> None:
        self.listed: dict[int, None] = {}
        """Keys that began a prompt chain. Keys that left the table since stay listed until
        :meth:`prune` (past ``2 ×`` the live ones at the last pruning, plus :data:`ROOTS_SLACK`, or
        when more than half are gone at a query: ``PrefixTable.held_roots``), so the list is
        bounded by twice the table's own block budget. Pruned in place: a caller may hold a
        reference across calls."""
        self.by_replica: dict[ReplicaId, int] = {}
        """Replica → listed roots whose mask has one of its bits (absent: 0). A released replica's
        entry goes with it (:meth:`forget`)."""
        self.in_table = 0
        """Listed roots in the table (a nonzero mask); ``len(listed) - in_table`` are gone."""
        self.live_at_prune = 0
        """Live roots found by the last :meth:`prune` (or a snapshot's load)."""

    def moved(self, old: int, new: int, slots: SlotRegistry) -> None:
        """A listed root's holder mask went from ``old`` to ``new`` (0: not in the table). Bits of a
        released slot (no owner) count for no one: its replica's entry went with it."""
        if not old:
            self.in_table += 1
        elif not new:
            self.in_table -= 1
        changed = old ^ new
        owners = slots.owners
        replica_masks = slots.replica_masks
        counts = self.by_replica
        while changed:
            low = changed & -changed
            owner = owners[low.bit_length() - 1]
            if owner is None:
                changed ^= low
                continue
            replica = owner.replica
            mine = replica_masks[replica]
            changed &= ~mine  # every bit of the replica: it counts the root once
            if not old & mine:
                counts[replica] = counts.get(replica, 0) + 1
            elif not new & mine:
                counts[replica] -= 1

    def note(self, key: int, mask: int, slots: SlotRegistry, masks: dict[int, int]) -> None:
        """List ``key`` as a root (no-op if listed); ``mask`` is its holder mask now (0: absent),
        ``masks`` the table's, for a pruning pass once the list passes its bound."""
        listed = self.listed
        if key in listed:
            return
        listed[key] = None
        if mask:
            self.moved(0, mask, slots)
        if len(listed) > 2 * self.live_at_prune + ROOTS_SLACK:
            self.prune(masks)

    def prune(self, masks: dict[int, int]) -> None:
        """Forget the listed roots no longer in ``masks`` (amortised O(1) per root listed; counts
        unchanged: a root out of the table counts for no one)."""
        kept = dict.fromkeys(filter(masks.__contains__, self.listed))
        self.listed.clear()
        self.listed.update(kept)
        self.live_at_prune = len(kept)

    def forget(self, replica: ReplicaId) -> None:
        """``replica``'s slots were released and their bits unset."""
        self.by_replica.pop(replica, None)

    def relist(self, keys: Iterable[int], masks: dict[int, int], slots: SlotRegistry) -> None:
        """Start over with ``keys`` listed (a snapshot's roots), counted against ``masks``:
        O(keys), once."""
        self.listed.clear()
        self.listed.update(dict.fromkeys(keys))
        self.by_replica = {}
        self.in_table = 0
        self.live_at_prune = len(self.listed)
        get = masks.get
        for key in self.listed:
            if mask := get(key, 0):
                self.moved(0, mask, slots)

    def size_bytes(self) -> int:
        """The containers' sizes (the keys are the table's own ints)."""
        return sys.getsizeof(self.listed) + sys.getsizeof(self.by_replica)
