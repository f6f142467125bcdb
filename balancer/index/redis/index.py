"""``RedisIndex``: the global :class:`~balancer.index.base.PrefixIndex` kept in Redis (I/O).

Redis holds the fleet's prefix index (DESIGN.md decision 3); the request path reads a local mirror
(:mod:`balancer.index.redis.mirror`), never this class. Key layout: :mod:`balancer.index.redis.schema`
and ``docs/redis-schema.md``.

One ``apply`` is one atomic ``EVALSHA`` (the batch, its stream entry and its ``seq``), preceded by
one pipelined ``HMGET`` only when a parent is neither in the batch nor in this writer's hints
(:mod:`balancer.index.redis.plan`). Keys are hashed here: XXH3 does not exist in Lua.

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
from balancer.events import KvEvent
from balancer.index.base import ApplyResult, IndexStats
from balancer.index.hashing import BlockHasher
from balancer.index.redis import scripts
from balancer.index.redis.client import RedisClient
from balancer.index.redis.plan import ParentHints, Parents, hint_checks, outside_parents, plan_batch
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
        self._anchor = [self.keys.counters]  # KEYS[1] of every script: routes to the pool's slot
        self._apply = client.register_script(scripts.APPLY)
        self._speculate = client.register_script(scripts.SPECULATE)
        self._drop = client.register_script(scripts.DROP)
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
        """Apply one replica's events in order, atomically.

        ``generation`` fences stale writers (see :class:`StaleGenerationError`). ``seq``, the engine
        sequence number of the batch's last event (or the positions text of
        :func:`balancer.index.redis.lease.encode_positions`), is stored with the batch in the same call,
        so a lease taker resumes exactly after it (:mod:`balancer.index.redis.lease`). With
        ``expect_seq`` (and ``generation``) the batch applies only if the stored ``seq`` is exactly
        that text, else :class:`PositionMismatchError`: a writer never builds on lost writes.
        """
        outside = outside_parents(self.hasher, events)
        hinted = self._hints.take(replica, outside)
        fence = "" if generation is None else str(generation)
        if fence and expect_seq is not None:
            fence += "|" + expect_seq
        head: _Args = [self.keys.prefix, replica, fence]
        head += [repr(float(now)), self.settings.capacity_blocks, self.settings.evict_target_blocks]
        maxlen = self.settings.stream_maxlen
        head += [maxlen, encode_batch(events) if maxlen else b"", "" if seq is None else seq]
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
        if reply[0] == _STALE_GENERATION:
            raise StaleGenerationError(replica, cast(int, generation), int(reply[1]))
        if reply[0] == _STALE_POSITION:
            raise PositionMismatchError(replica, cast(str, expect_seq))
        self._hints.learn(replica, plan)
        result = plan.result
        result.stored_blocks += reply[2]
        result.removed_blocks += reply[3]
        result.unknown_removals += reply[4]
        result.evicted_blocks += reply[5]
        result.skipped_unknown_parent += reply[6]
        return result

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
        """Leading blocks held per replica: one ``EVALSHA`` that stops where the candidates stop."""
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
        """``replica`` (as its rank 0) holds ``keys`` until ``now + ttl_s`` (its own chain: pass them all)."""
        if ttl_s <= 0 or not keys:
            return
        args: _Args = [self.keys.prefix, replica, repr(float(now)), repr(float(now + ttl_s))]
        args += [self.settings.capacity_blocks, self.settings.evict_target_blocks]
        args += [self.settings.max_speculative_keys, *_split_hex(hex_u64s(keys))]
        await self._speculate(keys=self._anchor, args=args)

    async def drop_replica(self, replica: ReplicaId) -> int:
        """Forget every rank and speculative entry of ``replica`` and bump its generation."""
        self._hints.forget(replica)
        args: _Args = [self.keys.prefix, replica, self.settings.stream_maxlen]
        reply = cast("list[int]", await self._drop(keys=self._anchor, args=args))
        return int(reply[0])

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
