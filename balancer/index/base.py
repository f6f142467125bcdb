"""The ``PrefixIndex`` seam (pure): the apply interface event ingestion writes through.

Who calls it: :class:`~balancer.sources.pipeline.EventIngest` applies each replica's event batches
(``apply``) and forgets a replica that left (``drop_replica``). The request path never does: it reads
the synchronous :class:`~balancer.index.table.PrefixTable` of its key space (match, held blocks,
speculative adds) and never awaits an index.

Implementations:

* :class:`~balancer.index.memory.MemoryIndex`: the embedded index, a facade over the same
  ``PrefixTable`` routing reads (a balancer without Redis).
* :class:`~balancer.index.redis.index.RedisIndex`: the fleet's index in Redis; ingestion reaches it
  through :class:`~balancer.fleet.writer.FencedWriter` (lease generation and engine positions).
* The mirror, :class:`~balancer.index.redis.mirror.Mirror`, is the fleet's read side, not a
  ``PrefixIndex`` of its own: it replays the Redis index's applied-event stream into a local
  ``PrefixTable``, which routing reads.

``tests/contract/test_index_contract.py`` runs the same suite on three backends: the in-memory
index, the Redis index, and the mirror (writes through a ``RedisIndex``, then the mirror polls the
stream; reads and speculative entries on the mirror, as in fleet mode).

Semantics shared by all backends:

* ``apply`` takes one replica's events in order. A ``Stored`` whose parent engine hash is unknown for
  that (replica, dp_rank) is skipped whole and counted; a ``Removed`` of an unknown hash is counted and
  ignored; ``Cleared`` and ``Resync`` clear that (replica, dp_rank). (The router's own in-memory
  tables may instead hold a rank's blocks as suspect after ``Resync(rank, "gap")``:
  ``TableLimits.gap_hold_s``, 0 by default, which is what the contract tests run.)
* ``drop_blocks`` forgets one replica's real holdings of the keys given, on every rank; a later
  ``Removed`` of a dropped block is ignored, a later ``Stored`` holds it again, and its children still
  chain from it.
* ``match`` walks the request's keys from the root and stops when no candidate still holds the next
  block. A replica's overlap is the best of its DP ranks. Speculative entries count as held until
  they expire (or the replica is dropped, or evicted over the budget): a real store of the key by
  the replica confirms it beside them, and a ``Cleared``, ``Resync`` or ``Removed`` of that real
  copy, or ``drop_blocks``, leaves them (the request routed there is still in flight).
* Memory is bounded by a total block budget; the least recently used blocks go first.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from balancer.events import KvEvent
from balancer.types import BlockKey, Overlap, ReplicaId


@dataclass(slots=True)
class ApplyResult:
    """Counts of what one ``apply`` call did (summed into ``kvlb_index_*`` metrics)."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared_caches: int = 0
    resyncs: int = 0
    skipped_unknown_parent: int = 0
    unknown_removals: int = 0
    evicted_blocks: int = 0
    skipped_block_size_mismatch: int = 0
    """``Stored`` events whose block size or lookahead differs from the pool's, skipped whole."""

    def add(self, other: ApplyResult) -> None:
        self.stored_blocks += other.stored_blocks
        self.removed_blocks += other.removed_blocks
        self.cleared_caches += other.cleared_caches
        self.resyncs += other.resyncs
        self.skipped_unknown_parent += other.skipped_unknown_parent
        self.unknown_removals += other.unknown_removals
        self.evicted_blocks += other.evicted_blocks
        self.skipped_block_size_mismatch += other.skipped_block_size_mismatch


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A point-in-time view of an index's size."""

    unique_blocks: int
    held_blocks: int
    """(cache, block) holdings: a block held by three caches counts three times."""
    blocks_by_replica: dict[ReplicaId, int] = field(default_factory=dict)
    speculative_entries: int = 0
    capacity_blocks: int = 0
    bytes_per_block: float | None = None
    """Measured or estimated memory per held block; ``None`` when the backend cannot tell."""


@dataclass(frozen=True, slots=True)
class HeldKeys:
    """The block keys one cache (replica, DP rank) really holds, as far as a listing's cap allows
    (speculative entries are not listed)."""

    dp_rank: int
    held_blocks: int
    """Blocks the cache holds in all (what ``IndexStats.blocks_by_replica`` sums over ranks)."""
    keys: tuple[BlockKey, ...]
    """At most the listing's ``limit`` of them, in no particular order."""

    @property
    def truncated(self) -> bool:
        """Whether the cap left some out."""
        return len(self.keys) < self.held_blocks


class PrefixIndex(Protocol):
    """Who holds which blocks, as event ingestion writes it. All methods are coroutines so that
    remote backends fit. Ingestion calls only ``apply`` and ``drop_replica``; ``match``,
    ``add_speculative`` and ``stats`` complete the seam so that the contract suite checks every
    backend's state the same way (routing reads a ``PrefixTable`` instead)."""

    async def apply(self, replica: ReplicaId, events: Sequence[KvEvent], now: float) -> ApplyResult:
        """Apply one replica's events in order. ``now`` is monotonic seconds (for LRU/TTL)."""
        ...

    async def match(
        self, keys: Sequence[BlockKey], among: Collection[ReplicaId] | None, now: float
    ) -> Overlap:
        """Leading blocks of ``keys`` held by each replica in ``among`` (all known when ``None``)."""
        ...

    async def add_speculative(
        self, replica: ReplicaId, keys: Sequence[BlockKey], ttl_s: float, now: float
    ) -> None:
        """Pretend ``replica`` holds ``keys`` until ``now + ttl_s`` (a routed request will store them)."""
        ...

    async def drop_replica(self, replica: ReplicaId) -> int:
        """Forget every block of every DP rank of ``replica``; returns how many holdings went."""
        ...

    async def drop_blocks(self, replica: ReplicaId, keys: Sequence[BlockKey]) -> int:
        """Forget ``replica``'s real holdings of ``keys`` on every DP rank (its speculative entries
        and other replicas' holdings stay); returns how many holdings went. Receipts call it with
        the blocks past the point an engine reported (``docs/prefix-index.md``, "Receipts")."""
        ...

    async def stats(self) -> IndexStats:
        """Current size and per-replica block counts."""
        ...

    async def held_keys(self, replica: ReplicaId, limit: int) -> list[HeldKeys]:
        """The keys each DP rank of ``replica`` really holds (no speculative entry), at most
        ``limit`` per rank, ranks in ascending order (a rank a clear emptied is listed with 0
        blocks until ``drop_replica``; none for a replica never stored): what ``GET
        /admin/replicas/{id}/blocks`` lists, and how a check compares the index with an engine's
        own listing block for block. O(the listed blocks) plus the cache's stale map entries
        walked past (at most ``2 × held + 64``)."""
        ...

    async def aclose(self) -> None:
        """Release resources (connections, tasks)."""
        ...
