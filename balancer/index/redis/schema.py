"""The Redis key schema of one pool's global prefix index, in one place (pure).

Every key name starts with ``<prefix>:{<pool>}:``. The ``{pool}`` hash tag puts all keys of one pool
in one Redis Cluster slot, so each Lua script (which touches many keys) runs on one node and every
pipeline of one pool goes to one node. ``docs/redis-schema.md`` describes each key. Python code
spells the names of the keys only here. The Lua scripts (:mod:`balancer.index.redis.scripts`) are
given every key they touch in ``KEYS`` (:attr:`RedisKeys.fixed` first, then the ``m:``, ``b:`` and
``s:`` keys of the call) and :attr:`RedisKeys.prefix`, from which they spell the names they check.

Identifiers inside names and fields:

* a block key and an engine hash are 16 lowercase hex digits (u64, big-endian);
* a *cache id* is ``<replica>#<dp_rank>``; a replica's speculative holder is ``<replica>#s``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from balancer.types import U64_MASK, ReplicaId

SPEC_TAG = "s"
"""The rank tag of a replica's speculative holder field (``<replica>#s``)."""


@dataclass(frozen=True, slots=True)
class RedisIndexSettings:
    """Where one pool's index lives in Redis and how big it may grow."""

    pool: str
    """Pool name (normally the model name): the hash tag of every key. Must not contain ``{``, ``}``."""
    key_prefix: str = "kvlb"
    """First component of every key name, so several deployments can share one Redis."""
    capacity_blocks: int = 4_000_000
    """Unique block keys kept. Past it the least recently touched keys are evicted with all their
    holders, down to ``capacity - capacity // 128``, and counted (``evicted_blocks``)."""
    max_speculative_keys: int = 100_000
    """Speculative (replica, key) holdings alive at once; more are not added and are counted in
    the ``speculative_overflow`` counter. 0 disables speculative entries."""
    parent_hints_per_cache: int = 65_536
    """Engine hashes per (replica, rank) whose keys a writer remembers from its own writes, so that
    a batch continuing an earlier one needs no read round trip. Past it the oldest are forgotten
    (their parents are then read from Redis); 0 disables the hints."""
    stream_maxlen: int = 10_000
    """Approximate length cap (``XADD MAXLEN ~``) of the pool's applied-event stream, in batches.
    Each entry carries its batch's tokens (about 4 B per token), so 10k batches of 32 blocks of 16
    tokens take about 25 MB. A mirror that falls further behind than this resyncs (counted).
    0 disables the stream (no mirrors)."""
    stream_max_bytes: int = 64 * 1024 * 1024
    """Bytes of the stream's entries (their fields' names and values) kept, besides
    ``stream_maxlen``: each append trims the oldest entries, exactly (``XTRIM MINID``), until the
    rest fit, keeping the newest entry whatever its size; entries trimmed for this reason are
    counted (``ctr.stream_byte_trims``). The sizes are kept in the ``evbytes`` list (about 35 B of
    Redis an entry). Redis's memory for the stream is about 1.2–1.25 × this (measured). 0: no
    byte bound (the count alone, as before 2026-12-01)."""
    max_script_blocks: int = 512
    """Blocks (engine hashes of ``Stored`` and ``Removed``, or map entries emptied by a clear) one
    script call may touch. A longer batch is applied in several calls, each with its own stream
    entry, so that Redis answers other clients between them (``docs/redis-schema.md``, "Script
    time"). Must be ≥ 1."""

    def __post_init__(self) -> None:
        if not self.pool or "{" in self.pool or "}" in self.pool:
            raise ValueError(f"pool must be non-empty without braces, got {self.pool!r}")
        if not self.key_prefix or "{" in self.key_prefix or "}" in self.key_prefix:
            raise ValueError(f"key_prefix must be non-empty without braces, got {self.key_prefix!r}")
        counts = (
            self.max_speculative_keys,
            self.parent_hints_per_cache,
            self.stream_maxlen,
            self.stream_max_bytes,
        )
        if self.capacity_blocks <= 0 or self.max_script_blocks <= 0 or min(counts) < 0:
            raise ValueError(f"invalid Redis index settings: {self}")

    @property
    def evict_target_blocks(self) -> int:
        """Unique keys left after an eviction round (evicting in batches keeps scripts short)."""
        return self.capacity_blocks - self.capacity_blocks // 128


class RedisKeys:
    """Key names of one pool (see ``docs/redis-schema.md`` for types and contents)."""

    __slots__ = ("prefix",)

    def __init__(self, settings: RedisIndexSettings) -> None:
        self.prefix = f"{settings.key_prefix}:{{{settings.pool}}}:"
        """Common start of every key of the pool; the Lua scripts append their suffixes to it."""

    @property
    def fixed(self) -> list[str]:
        """The keys every index script declares (``KEYS[1]`` = :attr:`counters` routes the call)."""
        names = ("lru", "held", "spec", "replicas", "tick", "gen", "seq", "events", "evbytes")
        return [self.counters, *(self.prefix + name for name in names)]

    @property
    def lru(self) -> str:
        """ZSET: block key (hex) scored by the tick of its last touch; its size is the pool's
        unique blocks."""
        return f"{self.prefix}lru"

    @property
    def held(self) -> str:
        """HASH: cache id → blocks it holds."""
        return f"{self.prefix}held"

    @property
    def speculative_replicas(self) -> str:
        """SET: replicas with speculative entries (each has a :meth:`speculative` set)."""
        return f"{self.prefix}spec"

    def speculative(self, replica: ReplicaId | str) -> str:
        """ZSET: block key (hex) → expiry of ``replica``'s speculative holdings."""
        return f"{self.prefix}s:{replica}"

    def block(self, key_hex: str) -> str:
        """HASH: holder field (cache id → handle count, ``<replica>#s`` → expiry) of one block."""
        return f"{self.prefix}b:{key_hex}"

    def engine_map(self, cache_id: str) -> str:
        """HASH: engine hash (hex) → block key (hex) of one cache; also its reverse set."""
        return f"{self.prefix}m:{cache_id}"

    def ranks(self, replica: ReplicaId) -> str:
        """SET: the DP ranks of ``replica`` that have (or had) a cache."""
        return f"{self.prefix}ranks:{replica}"

    @property
    def generations(self) -> str:
        """HASH: replica → generation (absent = 0); bumped by ``drop_replica`` to fence old writers."""
        return f"{self.prefix}gen"

    @property
    def counters(self) -> str:
        """HASH: cumulative counters (``evicted_blocks``, ``stale_generation``, ``speculative_*``)."""
        return f"{self.prefix}ctr"

    @property
    def stream(self) -> str:
        """STREAM: applied event batches of the pool, tailed by every balancer's mirror."""
        return f"{self.prefix}events"

    @property
    def stream_sizes(self) -> str:
        """LIST: ``<entry id> <start> <end>`` of each stream entry appended under a byte bound, oldest
        first: the running byte offsets of its fields, so the stream's bytes are the last ``end``
        minus the first ``start`` (``stream_max_bytes``; ``docs/redis-schema.md``)."""
        return f"{self.prefix}evbytes"

    def lease(self, replica: ReplicaId) -> str:
        """STRING with a PX expiry: owner token of ``replica``'s ingestion lease."""
        return f"{self.prefix}lease:{replica}"

    @property
    def snapshot(self) -> str:
        """STRING: the latest table snapshot of a mirror, with the stream entry it reflects."""
        return f"{self.prefix}snap"

    @property
    def snapshot_lease(self) -> str:
        """STRING with a PX expiry: the balancer that writes this key space's snapshots."""
        return f"{self.prefix}snaplease"

    @property
    def applied_seq(self) -> str:
        """HASH: replica → engine positions applied by its lease holder (``rank:seq,...``; a trailing
        ``!`` marks a clean hand-over; see :mod:`balancer.index.redis.lease`)."""
        return f"{self.prefix}seq"


def cache_id(replica: ReplicaId, dp_rank: int) -> str:
    """The field name of one (replica, dp_rank) cache in block hashes."""
    return f"{replica}#{dp_rank}"


def split_cache_id(field: str) -> tuple[ReplicaId, int | None]:
    """``(replica, dp_rank)`` of a holder field; ``dp_rank`` is ``None`` for a speculative holder."""
    replica, _, tag = field.rpartition("#")
    return ReplicaId(replica), None if tag == SPEC_TAG else int(tag)


def hex_u64s(values: Sequence[int]) -> str:
    """u64 values as concatenated 16-digit lowercase hex (one C call for a whole chain)."""
    return struct.pack(f">{len(values)}Q", *(v & U64_MASK for v in values)).hex()


def hex_u64(value: int) -> str:
    return f"{value & U64_MASK:016x}"
