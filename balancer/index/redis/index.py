"""``RedisIndex``: the global :class:`~balancer.index.base.PrefixIndex` kept in Redis (I/O).

Redis holds the fleet's prefix index (``docs/architecture.md``, decision 3); the request path reads a
local mirror (:mod:`balancer.index.redis.mirror`), never this class. Key layout:
:mod:`balancer.index.redis.schema` and ``docs/redis-schema.md``.

A batch is applied in segments of at most ``max_script_blocks`` blocks
(:func:`~balancer.index.redis.plan.split_batch`), so that no script holds Redis for long. Each
segment is one atomic ``EVALSHA`` (the segment and its stream entry; the last one also stores
``seq``), preceded by one pipelined ``HMGET`` only when a parent is neither in the segment nor in
this writer's hints (:mod:`balancer.index.redis.plan`), and, for a segment that clears a cache, by
``CLEAR_STEP`` calls that empty it in bounded steps. Keys are hashed here: XXH3 does not exist in
Lua.

Generation fencing: ``apply(..., generation=g)`` is rejected whole, with
:class:`StaleGenerationError` and a ``stale_generation`` count in Redis, unless ``g`` is the
replica's current generation (0 at first; ``drop_replica`` and a new lease holder bump it).

``now`` is stored (speculative expiry), so processes sharing one Redis index must pass the same
clock, e.g. wall-clock seconds. LRU order does not depend on ``now``: each touch takes a tick.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, cast

import redis.asyncio as aioredis

from balancer.errors import BalancerError
from balancer.events import Cleared, KvEvent, Resync
from balancer.index.base import ApplyResult, IndexStats
from balancer.index.hashing import BlockHasher
from balancer.index.redis import scripts
from balancer.index.redis.client import RedisClient
from balancer.index.redis.plan import (
    ParentHints,
    Parents,
    hint_checks,
    outside_parents,
    plan_batch,
    split_batch,
)
from balancer.index.redis.schema import (
    RedisIndexSettings,
    RedisKeys,
    cache_id,
    hex_u64,
    hex_u64s,
    split_cache_id,
)
from balancer.index.redis.stream import encode_batch
from balancer.types import BlockKey, Overlap, ReplicaId

_Args = list[str | int | bytes]
_FIXED_NAMES = ("lru", "held", "spec", "replicas", "tick", "gen", "seq", "events")
"""The pool's keys after ``ctr`` that ``DROP_BLOCKS`` declares (its ``KEYS[2..9]``)."""
_STALE_GENERATION = 1
_STALE_HINT = 2
_STALE_POSITION = 3


class StaleGenerationError(BalancerError):
    """A write carried a replica generation that is no longer current (dropped, or leased anew).

    The batch was not applied. The writer must stop: another ingester owns the replica now, or it
    must re-read :meth:`RedisIndex.generation` and resynchronise the replica from scratch.
    """

    def __init__(self, replica: ReplicaId, expected: int, current: int) -> None:
        super().__init__(f"replica {replica!r}: write with generation {expected}, current is {current}")
        self.replica = replica
        self.expected = expected
        self.current = current


class PositionMismatchError(BalancerError):
    """``apply(..., expect_seq=)`` found other positions stored: Redis lost writes (a restart
    without them), or another writer wrote. Nothing was applied; re-read the positions and resume."""

    def __init__(self, replica: ReplicaId, expected: str) -> None:
        super().__init__(f"replica {replica!r}: stored positions are not {expected!r}")
        self.replica = replica
        self.expected = expected


class RedisIndex:
    """A prefix index of one pool stored in Redis, shared by every balancer of the fleet."""

    def __init__(
        self,
        client: RedisClient,
        hasher: BlockHasher,
        settings: RedisIndexSettings,
        *,
        owns_client: bool = False,
    ) -> None:
        """``client`` must be created with ``decode_responses=True``."""
        self.client = client
        self.hasher = hasher
        self.settings = settings
        self.keys = RedisKeys(settings)
        self._owns_client = owns_client
        self._hints = ParentHints(settings.parent_hints_per_cache)
        self.hint_retries = 0
        """``apply`` calls retried because a parent hint was stale (another writer, a drop)."""
        self.repaired_keys = 0
        """Keys of the pool found holding another type (garbage written over them) and deleted by
        this index's scripts (``ctr.wrongtype_<key>`` in Redis; ``docs/redis-schema.md``)."""
        self._anchor = [self.keys.counters]  # KEYS[1] of every script: routes to the pool's slot
        self._apply = client.register_script(scripts.APPLY)
        self._speculate = client.register_script(scripts.SPECULATE)
        self._drop = client.register_script(scripts.DROP)
        self._drop_blocks = client.register_script(scripts.DROP_BLOCKS)
        self._clear_step = client.register_script(scripts.CLEAR_STEP)
        self._match = client.register_script(scripts.MATCH)
        self._stats = client.register_script(scripts.STATS)

    @classmethod
    def from_url(cls, url: str, hasher: BlockHasher, settings: RedisIndexSettings) -> RedisIndex:
        """An index with its own connection pool (closed by :meth:`aclose`)."""
        client = aioredis.Redis.from_url(url, decode_responses=True)
        return cls(client, hasher, settings, owns_client=True)

    # ------------------------------------------------------------------ events

    async def apply(
        self,
        replica: ReplicaId,
        events: Sequence[KvEvent],
        now: float,
        *,
        generation: int | None = None,
        seq: int | str | None = None,
        expect_seq: str | None = None,
    ) -> ApplyResult:
        """Apply one replica's events in order: each segment of at most ``max_script_blocks``
        blocks atomically, the positions (``seq``) with the last one.

        ``generation`` fences stale writers (see :class:`StaleGenerationError`). ``seq``, the engine
        sequence number of the batch's last event (or the positions text of
        :func:`balancer.index.redis.lease.encode_positions`), is stored in the same call as the last
        segment, so a lease taker resumes exactly after the batch, or replays all of it when a write
        was cut short between segments (:mod:`balancer.index.redis.lease`). With
        ``expect_seq`` (and ``generation``) each segment applies only if the stored ``seq`` is exactly
        that text, else :class:`PositionMismatchError`: a writer never builds on lost writes. A
        refusal on the first segment leaves Redis untouched.
        """
        fence = "" if generation is None else str(generation)
        if fence and expect_seq is not None:
            fence += "|" + expect_seq
        total = ApplyResult()
        segments = split_batch(self.hasher, events, self.settings.max_script_blocks)
        if not segments and (seq is not None or generation is not None):
            segments = [[]]  # the fence is still checked, positions alone still move
        for position, segment in enumerate(segments):
            last = position == len(segments) - 1
            first = segment[0] if segment else None
            if isinstance(first, Cleared | Resync):
                await self._clear_steps(replica, first.dp_rank, fence, generation, expect_seq)
            # Only the last segment stores ``seq``: a write cut short between segments leaves the old
            # positions, so it is retried (or replayed by the next holder) from the start, and
            # re-applying the segments that landed is harmless (stores and clears are idempotent).
            stored_seq = seq if last else None
            part = await self._apply_segment(replica, segment, now, fence, stored_seq, generation, expect_seq)
            total.add(part)
        return total

    async def _apply_segment(
        self,
        replica: ReplicaId,
        events: Sequence[KvEvent],
        now: float,
        fence: str,
        seq: int | str | None,
        generation: int | None,
        expect_seq: str | None,
    ) -> ApplyResult:
        """One ``APPLY`` call: at most ``max_script_blocks`` blocks (:func:`split_batch`)."""
        outside = outside_parents(self.hasher, events)
        hinted = self._hints.take(replica, outside)
        head: _Args = [self.keys.prefix, replica, fence]
        head += [repr(float(now)), self.settings.capacity_blocks, self.settings.evict_target_blocks]
        maxlen = self.settings.stream_maxlen
        head += [maxlen, encode_batch(events) if maxlen else b"", "" if seq is None else seq]
        head.append(self.settings.max_script_blocks)
        for _attempt in range(2):  # a stale hint costs one retry that reads every parent
            plan = plan_batch(self.hasher, events, {**hinted, **await self._fetch_parents(replica, outside)})
            if not plan.ops and generation is None and seq is None:
                return plan.result
            args = [*head, len(hinted), *hint_checks(hinted), *plan.ops]
            reply = cast("list[int]", await self._apply(keys=self._anchor, args=args))
            if reply[0] != _STALE_HINT:
                break
            self.hint_retries += 1
            self._hints.forget(replica)  # read every parent from Redis and try once more
            for rank, eh in hinted:
                outside.setdefault(rank, set()).add(eh)
            hinted = {}
        self._refused(replica, reply, generation, expect_seq)
        self.repaired_keys += int(reply[7])
        self._hints.learn(replica, plan)
        result = plan.result
        result.stored_blocks += reply[2]
        result.removed_blocks += reply[3]
        result.unknown_removals += reply[4]
        result.evicted_blocks += reply[5]
        result.skipped_unknown_parent += reply[6]
        return result

    async def _clear_steps(
        self,
        replica: ReplicaId,
        rank: int,
        fence: str = "",
        generation: int | None = None,
        expect_seq: str | None = None,
    ) -> int:
        """Empty one cache in calls of at most ``max_script_blocks`` map entries (before the call
        that clears it whole and publishes the clear); returns the holdings released."""
        args: _Args = [self.keys.prefix, replica, fence, rank, self.settings.max_script_blocks]
        released = 0
        while True:
            reply = cast("list[int]", await self._clear_step(keys=self._anchor, args=args))
            self._refused(replica, reply, generation, expect_seq)
            released += int(reply[2])
            self.repaired_keys += int(reply[3])
            if int(reply[1]) == 0:
                return released

    @staticmethod
    def _refused(
        replica: ReplicaId, reply: list[int], generation: int | None, expect_seq: str | None
    ) -> None:
        if reply[0] == _STALE_GENERATION:
            raise StaleGenerationError(replica, cast(int, generation), int(reply[1]))
        if reply[0] == _STALE_POSITION:
            raise PositionMismatchError(replica, expect_seq or "")

    async def _fetch_parents(self, replica: ReplicaId, outside: dict[int, set[int]]) -> Parents:
        """One pipelined ``HMGET`` per rank for the parents that neither the batch nor a hint gives."""
        wanted = [(rank, sorted(ehs)) for rank, ehs in outside.items() if ehs]
        if not wanted:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for rank, ehs in wanted:
            pipe.hmget(self.keys.engine_map(cache_id(replica, rank)), [hex_u64(eh) for eh in ehs])
        replies = cast("list[list[str | None]]", await pipe.execute())
        found: Parents = {}
        for (rank, ehs), values in zip(wanted, replies, strict=True):
            for eh, value in zip(ehs, values, strict=True):
                found[rank, eh] = None if value is None else int(value, 16)
        return found

    # ------------------------------------------------------------------ queries

    async def match(
        self, keys: Sequence[BlockKey], among: Collection[ReplicaId] | None, now: float
    ) -> Overlap:
        """Leading blocks held per replica: one ``EVALSHA`` that stops where the candidates stop.

        Routing never calls this (it reads the mirror's table). It keeps the seam uniform: the
        contract suite checks the Redis index's state through it, and the Redis integration tests
        use it as the oracle the mirrors must agree with."""
        asked = None if among is None else list(among)
        args: _Args = [self.keys.prefix, repr(float(now)), -1 if asked is None else len(asked)]
        args += asked or []
        if keys:
            args += _split_hex(hex_u64s(keys))
        listed, pairs = cast("list[Any]", await self._match(keys=self._anchor, args=args))
        replicas = [ReplicaId(r) for r in listed] if asked is None else asked
        blocks = dict.fromkeys(replicas, 0)
        best = dict.fromkeys(replicas, 0)
        for field, depth in zip(pairs[::2], pairs[1::2], strict=True):
            replica, rank = split_cache_id(field)
            rank = 0 if rank is None else rank
            if depth > blocks[replica] or (depth == blocks[replica] and rank < best[replica]):
                blocks[replica] = depth
                best[replica] = rank
        return Overlap(blocks, best, len(keys))

    async def add_speculative(
        self, replica: ReplicaId, keys: Sequence[BlockKey], ttl_s: float, now: float
    ) -> None:
        """``replica`` (as its rank 0) holds ``keys`` until ``now + ttl_s`` (its own chain: pass them all).

        Fleet balancers keep speculative entries in their mirror's table, so only the contract suite
        and the Redis tests call this."""
        if ttl_s <= 0 or not keys:
            return
        args: _Args = [self.keys.prefix, replica, repr(float(now)), repr(float(now + ttl_s))]
        args += [self.settings.capacity_blocks, self.settings.evict_target_blocks]
        args += [self.settings.max_speculative_keys, *_split_hex(hex_u64s(keys))]
        await self._speculate(keys=self._anchor, args=args)

    async def drop_replica(self, replica: ReplicaId) -> int:
        """Forget every rank and speculative entry of ``replica`` and bump its generation."""
        self._hints.forget(replica)
        ranks = cast("set[str]", await cast("Any", self.client.smembers(self.keys.ranks(replica))))
        released = 0
        for rank in sorted(ranks):
            released += await self._clear_steps(replica, int(rank))
        args: _Args = [self.keys.prefix, replica, self.settings.stream_maxlen]
        reply = cast("list[int]", await self._drop(keys=self._anchor, args=args))
        self.repaired_keys += int(reply[2])
        return released + int(reply[0])

    async def drop_blocks(self, replica: ReplicaId, keys: Sequence[BlockKey]) -> int:
        """Forget ``replica``'s real holdings of ``keys`` on every rank, in calls of at most
        ``max_script_blocks`` keys; each call that dropped something appends the keys to the stream
        (field ``x``), so every mirror drops them too. The script declares every key it touches (the
        pool's fixed keys, the replica's ``ranks:`` set, each key's ``b:`` hash). Unfenced: a receipt
        is not an ingest write, and each call is atomic against the ingest writer's ``APPLY``."""
        step = self.settings.max_script_blocks
        prefix = self.keys.prefix
        fixed = [self.keys.counters, *(prefix + name for name in _FIXED_NAMES), self.keys.ranks(replica)]
        dropped = 0
        for start in range(0, len(keys), step):
            part = list(dict.fromkeys(keys[start : start + step]))
            joined = hex_u64s(part)
            blocks = [f"{prefix}b:{key}" for key in _split_hex(joined)]
            args: _Args = [prefix, replica, self.settings.stream_maxlen, joined]
            reply = cast("list[int]", await self._drop_blocks(keys=[*fixed, *blocks], args=args))
            dropped += int(reply[0])
            self.repaired_keys += int(reply[1])
        return dropped

    async def generation(self, replica: ReplicaId) -> int:
        """The generation a writer of ``replica`` must pass to ``apply`` (0 before any drop)."""
        value = await cast("Any", self.client.hget(self.keys.generations, replica))
        return 0 if value is None else int(value)

    async def counters(self) -> dict[str, int]:
        """Cumulative counters kept in Redis (evictions, stale writes, speculative outcomes)."""
        raw = await cast("Any", self.client.hgetall(self.keys.counters))
        return {name: int(value) for name, value in raw.items()}

    async def stats(self) -> IndexStats:
        """Sizes from Redis; ``bytes_per_block`` is ``None`` (see ``docs/redis-schema.md`` figures)."""
        unique, held_pairs, speculative = cast(
            "list[Any]", await self._stats(keys=self._anchor, args=[self.keys.prefix])
        )
        by_replica: dict[ReplicaId, int] = {}
        for field, value in zip(held_pairs[::2], held_pairs[1::2], strict=True):
            replica, _ = split_cache_id(field)
            by_replica[replica] = by_replica.get(replica, 0) + int(value)
        return IndexStats(
            unique_blocks=int(unique),
            held_blocks=sum(by_replica.values()),
            blocks_by_replica=by_replica,
            speculative_entries=int(speculative),
            capacity_blocks=self.settings.capacity_blocks,
        )

    async def aclose(self) -> None:
        """Close the connection pool if this index created it."""
        if self._owns_client:
            await self.client.aclose()


def _split_hex(joined: str) -> list[str]:
    return [joined[i : i + 16] for i in range(0, len(joined), 16)]
