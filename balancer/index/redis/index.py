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
from balancer.index.base import ApplyResult, HeldKeys, IndexStats
from balancer.index.hashing import BlockHasher
from balancer.index.redis import scripts
from balancer.index.redis.client import RedisClient
from balancer.index.redis.plan import (
    OpKeys,
    ParentHints,
    Parents,
    hint_checks,
    op_keys,
    outside_parents,
    plan_batch,
    split_batch,
    split_hex,
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
_STALE_GENERATION = 1
_STALE_HINT = 2
_STALE_POSITION = 3
_ATTEMPTS = 8
"""Calls of one script before giving up when the keys it must declare keep changing under it."""
_MAX_ROUNDS = 100_000
"""Bound of the loops that empty a map or expire entries a bounded step at a time."""
_EVICT_ROUNDS = 4
"""Eviction rounds after one write (each of at most ``max_script_blocks`` blocks)."""


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
        self.stream_byte_trims = 0
        """Stream entries this index's appends trimmed because the stream passed
        ``stream_max_bytes`` (``ctr.stream_byte_trims`` counts every writer's)."""
        self.key_retries = 0
        """Script calls retried because a key they had to touch was not declared: the state moved
        between the read that names the keys and the script (another writer)."""
        self._fixed = self.keys.fixed  # the first KEYS of every script (``ctr`` routes the call)
        self._apply = client.register_script(scripts.APPLY)
        self._speculate = client.register_script(scripts.SPECULATE)
        self._drop = client.register_script(scripts.DROP)
        self._drop_blocks = client.register_script(scripts.DROP_BLOCKS)
        self._clear_step = client.register_script(scripts.CLEAR_STEP)
        self._match = client.register_script(scripts.MATCH)
        self._stats = client.register_script(scripts.STATS)
        self._expire_script = client.register_script(scripts.EXPIRE)
        self._evict_script = client.register_script(scripts.EVICT)
        self._compact_script = client.register_script(scripts.COMPACT)

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
        """One ``APPLY`` call (at most ``max_script_blocks`` blocks, :func:`split_batch`), then an
        eviction round when the pool is past its capacity."""
        spec, unique = await self._expire(now)
        outside = outside_parents(self.hasher, events)
        hinted = self._hints.take(replica, outside)
        head: _Args = [self.keys.prefix, replica, fence]
        head += [self.settings.capacity_blocks, self.settings.evict_target_blocks]
        head.append(self.settings.max_script_blocks)
        maxlen = self.settings.stream_maxlen
        head += [maxlen, self.settings.stream_max_bytes]
        head += [encode_batch(events) if maxlen else b"", "" if seq is None else seq]
        stale_hint = False
        plan = plan_batch(self.hasher, events, {**hinted, **await self._fetch_parents(replica, outside)})
        if not plan.ops and generation is None and seq is None:
            return plan.result
        keys = await self._apply_keys(replica, op_keys(plan.ops, hinted), spec, unique)
        for _attempt in range(_ATTEMPTS):
            args = [*head, len(hinted), *hint_checks(hinted), *plan.ops]
            reply = cast("list[Any]", await self._apply(keys=keys, args=args))
            if reply[0] == _STALE_HINT and not stale_hint:
                stale_hint = True  # a stale hint costs one retry that reads every parent
                self.hint_retries += 1
                self._hints.forget(replica)
                for rank, eh in hinted:
                    outside.setdefault(rank, set()).add(eh)
                hinted = {}
                plan = plan_batch(self.hasher, events, await self._fetch_parents(replica, outside))
                keys = await self._apply_keys(replica, op_keys(plan.ops, hinted), spec, unique)
            elif reply[0] == scripts.RETRY:
                self.key_retries += 1  # the blocks a store replaces, or a stale hint: declare them
                keys = list(dict.fromkeys([*keys, *cast("list[str]", reply[2])]))
            else:
                break
        else:
            raise BalancerError(f"replica {replica!r}: the keys of a batch kept changing")
        self._refused(replica, reply, generation, expect_seq)
        self.repaired_keys += int(reply[7])
        self.stream_byte_trims += int(reply[10])
        self._hints.learn(replica, plan)
        result = plan.result
        result.stored_blocks += reply[2]
        result.removed_blocks += reply[3]
        result.unknown_removals += reply[4]
        result.skipped_unknown_parent += reply[6]
        result.evicted_blocks += int(reply[5]) + await self._evict(int(reply[8]), cast("list[str]", reply[9]))
        return result

    async def _apply_keys(self, replica: ReplicaId, named: OpKeys, spec: list[str], unique: int) -> list[str]:
        """``KEYS`` of one ``APPLY``: the fixed keys, the replica's, every speculative set, the maps
        and blocks it names, the blocks its removals release (from this writer's hints, else read)
        and, near the capacity, the blocks its evictions may take (one pipelined read, if any)."""
        maps = {rank: self.keys.engine_map(cache_id(replica, rank)) for rank in sorted(named.ranks)}
        keys = [*self._fixed, self.keys.ranks(replica), self.keys.speculative(replica), *maps.values()]
        keys += [self.keys.speculative(r) for r in spec]
        keys += [self.keys.block(key) for key in named.stored_keys]
        reads: list[tuple[int, list[str]]] = []
        for rank, fields in named.removed_fields.items():
            if rank in named.cleared:
                continue
            hinted, unknown = self._hints.split_known(replica, rank, fields)
            keys += [self.keys.block(hex_u64(key)) for key in hinted]
            if unknown:
                reads.append((rank, unknown))
        victims = self._victims_to_read(unique, named)
        if reads or named.cleared or victims:
            pipe = self.client.pipeline(transaction=False)
            for rank, fields in reads:
                pipe.hmget(maps[rank], fields)
            for rank in named.cleared:
                pipe.hvals(maps[rank])
            if victims:
                pipe.zrange(self.keys.lru, 0, victims - 1)
            for values in cast("list[list[str | None]]", await pipe.execute()):
                keys += [self.keys.block(value) for value in values if value is not None]
        return list(dict.fromkeys(keys))

    async def _expire(self, now: float) -> tuple[list[str], int]:
        """Drop the speculative entries due at ``now`` (``EXPIRE`` calls of at most
        ``max_script_blocks`` entries, each after a read of which they are); returns the replicas
        with speculative entries and the pool's unique blocks, as the next call must declare them."""
        limit = self.settings.max_script_blocks
        for _round in range(_MAX_ROUNDS):
            pipe = self.client.pipeline(transaction=False)
            pipe.smembers(self.keys.speculative_replicas)
            pipe.zcard(self.keys.lru)
            members, unique = cast("tuple[set[str], int]", tuple(await pipe.execute()))
            replicas = sorted(members)
            if not replicas:
                return replicas, int(unique)
            pipe = self.client.pipeline(transaction=False)
            for replica in replicas:
                pipe.zrangebyscore(self.keys.speculative(replica), "-inf", now, start=0, num=limit)
            due = cast("list[list[str]]", await pipe.execute())
            if not any(due):
                return replicas, int(unique)
            keys = [*self._fixed, *(self.keys.speculative(r) for r in replicas)]
            keys += [self.keys.block(key) for keys_due in due for key in keys_due]
            args: _Args = [self.keys.prefix, repr(float(now))]
            _expired, stopped = await self._expire_script(keys=keys, args=args)
            if not stopped:
                return await self._expire_done()
        return await self._expire_done()

    async def _expire_done(self) -> tuple[list[str], int]:
        pipe = self.client.pipeline(transaction=False)
        pipe.smembers(self.keys.speculative_replicas)
        pipe.zcard(self.keys.lru)
        members, unique = await pipe.execute()
        return sorted(cast("set[str]", members)), int(unique)

    def _victims_to_read(self, unique: int, named: OpKeys) -> int:
        """Blocks at the head of ``lru`` that the evictions after the ``S`` ops of one ``APPLY`` may
        take: the excess over the target, at most ``max_script_blocks`` per op (0 below capacity)."""
        adding = len(named.stored_keys)
        if unique + adding <= self.settings.capacity_blocks:
            return 0
        excess = unique + adding - self.settings.evict_target_blocks
        return min(excess, self.settings.max_script_blocks * named.stores)

    async def _evict(self, unique_blocks: int, touched: list[str]) -> int:
        """Eviction rounds of at most ``max_script_blocks`` blocks while the pool is past its
        capacity (at most :data:`_EVICT_ROUNDS` per call: the rest on the next write); then the maps
        of the caches that lost blocks (``touched``, and in these rounds) are compacted. Returns the
        blocks evicted."""
        capacity, target = self.settings.capacity_blocks, self.settings.evict_target_blocks
        limit = self.settings.max_script_blocks
        evicted = 0
        lost = set(touched)
        for _round in range(_EVICT_ROUNDS):
            if unique_blocks <= capacity:
                break
            pipe = self.client.pipeline(transaction=False)
            pipe.zrange(self.keys.lru, 0, min(unique_blocks - target, limit) - 1)
            pipe.smembers(self.keys.speculative_replicas)
            victims, spec = cast("tuple[list[str], set[str]]", tuple(await pipe.execute()))
            keys = [*self._fixed, *(self.keys.block(key) for key in victims)]
            keys += [self.keys.speculative(replica) for replica in sorted(spec)]
            args: _Args = [self.keys.prefix, capacity, target, limit]
            n, unique_blocks, cids = cast("list[Any]", await self._evict_script(keys=keys, args=args))
            evicted += int(n)
            lost.update(cids)
            if not n:
                break
        if lost:
            await self._compact(sorted(lost))
        return evicted

    async def _compact(self, cids: list[str]) -> None:
        """Drop the dead entries of the maps that outnumber their cache's blocks (a random sample of
        ``max_script_blocks`` entries per map and call, more than half dead when it runs)."""
        limit = self.settings.max_script_blocks
        pipe = self.client.pipeline(transaction=False)
        for cid in cids:
            pipe.hlen(self.keys.engine_map(cid))
            pipe.hget(self.keys.held, cid)
        sizes = await pipe.execute()
        for cid, n, held in zip(cids, sizes[::2], sizes[1::2], strict=True):
            if int(n) <= 2 * int(held or 0) + 64:
                continue
            mk = self.keys.engine_map(cid)
            if int(n) > limit:
                pairs = cast(
                    "list[str]", await cast("Any", self.client.hrandfield(mk, limit, withvalues=True))
                )
            else:
                flat = cast("dict[str, str]", await cast("Any", self.client.hgetall(mk)))
                pairs = [x for item in flat.items() for x in item]
            keys = [*self._fixed, mk, *(self.keys.block(v) for v in pairs[1::2])]
            await self._compact_script(keys=keys, args=[self.keys.prefix, cid, "".join(pairs[::2])])

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
        mk = self.keys.engine_map(cache_id(replica, rank))
        released = 0
        for _round in range(_MAX_ROUNDS):
            pairs = await self._sample(mk)
            if not pairs:
                break
            keys = [*self._fixed, mk, *(self.keys.block(v) for v in pairs[1::2])]
            args: _Args = [self.keys.prefix, replica, fence, rank, "".join(pairs[::2])]
            reply = cast("list[int]", await self._clear_step(keys=keys, args=args))
            self._refused(replica, reply, generation, expect_seq)
            released += int(reply[2])
            self.repaired_keys += int(reply[3])
            if int(reply[1]) == 0:
                break
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
        """Leading blocks held per replica: one ``EVALSHA`` that stops where the candidates stop
        (after the ``EXPIRE`` of due speculative entries, so that ``stats`` agrees with the table).

        Routing never calls this (it reads the mirror's table). It keeps the seam uniform: the
        contract suite checks the Redis index's state through it, and the Redis integration tests
        use it as the oracle the mirrors must agree with."""
        await self._expire(now)
        asked = None if among is None else list(among)
        args: _Args = [self.keys.prefix, repr(float(now)), -1 if asked is None else len(asked)]
        args += asked or []
        hexes = split_hex(hex_u64s(keys)) if keys else []
        args += hexes
        script_keys = [*self._fixed, *dict.fromkeys(self.keys.block(key) for key in hexes)]
        listed, pairs = cast("list[Any]", await self._match(keys=script_keys, args=args))
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
        await self._expire(now)
        hexes = split_hex(hex_u64s(keys))
        args: _Args = [self.keys.prefix, replica, repr(float(now + ttl_s))]
        args += [self.settings.max_speculative_keys, *hexes]
        for _attempt in range(_ATTEMPTS):
            replicas = await self._speculative_replicas()
            script_keys = [*self._fixed, *(self.keys.speculative(r) for r in sorted({*replicas, replica}))]
            script_keys += dict.fromkeys(self.keys.block(key) for key in hexes)
            code, _taken, unique_blocks = cast(
                "list[int]", await self._speculate(keys=script_keys, args=args)
            )
            if code != scripts.RETRY:
                break
            self.key_retries += 1
        else:
            raise BalancerError("the replicas with speculative entries kept changing")
        await self._evict(int(unique_blocks), [])

    async def drop_replica(self, replica: ReplicaId) -> int:
        """Forget every rank and speculative entry of ``replica`` and bump its generation."""
        self._hints.forget(replica)
        released = 0
        ranks = await self._ranks(replica)
        for rank in ranks:
            released += await self._clear_steps(replica, int(rank))
        args: _Args = [self.keys.prefix, replica, self.settings.stream_maxlen, self.settings.stream_max_bytes]
        for _attempt in range(_ATTEMPTS):
            ranks = sorted(
                cast("set[str]", await cast("Any", self.client.smembers(self.keys.ranks(replica))))
            )
            maps = [self.keys.engine_map(f"{replica}#{rank}") for rank in ranks]
            pipe = self.client.pipeline(transaction=False)
            for mk in maps:
                pipe.hvals(mk)
            pipe.zrange(self.keys.speculative(replica), 0, -1)
            held = cast("list[list[str]]", await pipe.execute())
            keys = [*self._fixed, self.keys.ranks(replica), self.keys.speculative(replica), *maps]
            keys += dict.fromkeys(self.keys.block(key) for values in held for key in values)
            reply = cast("list[int]", await self._drop(keys=keys, args=args))
            if reply[0] != scripts.RETRY:
                break
            self.key_retries += 1
        else:
            raise BalancerError(f"replica {replica!r}: its keys kept changing during the drop")
        self.repaired_keys += int(reply[3])
        self.stream_byte_trims += int(reply[4])
        return released + int(reply[1])

    async def _ranks(self, replica: ReplicaId) -> list[str]:
        return sorted(cast("set[str]", await cast("Any", self.client.smembers(self.keys.ranks(replica)))))

    async def _sample(self, map_key: str) -> list[str]:
        """Up to ``max_script_blocks`` random entries of a map, as field, value, field, value..."""
        limit = self.settings.max_script_blocks
        return cast("list[str]", await cast("Any", self.client.hrandfield(map_key, limit, withvalues=True)))

    async def _speculative_replicas(self) -> set[str]:
        return cast("set[str]", await cast("Any", self.client.smembers(self.keys.speculative_replicas)))

    async def drop_blocks(self, replica: ReplicaId, keys: Sequence[BlockKey]) -> int:
        """Forget ``replica``'s real holdings of ``keys`` on every rank, in calls of at most
        ``max_script_blocks`` keys; each call that dropped something appends the keys to the stream
        (field ``x``), so every mirror drops them too. The script declares every key it touches (the
        pool's fixed keys, the replica's ``ranks:`` set, each key's ``b:`` hash). Unfenced: a receipt
        is not an ingest write, and each call is atomic against the ingest writer's ``APPLY``."""
        step = self.settings.max_script_blocks
        prefix = self.keys.prefix
        fixed = [*self._fixed, self.keys.ranks(replica)]
        dropped = 0
        for start in range(0, len(keys), step):
            part = list(dict.fromkeys(keys[start : start + step]))
            joined = hex_u64s(part)
            blocks = [self.keys.block(key) for key in split_hex(joined)]
            args: _Args = [
                prefix,
                replica,
                self.settings.stream_maxlen,
                self.settings.stream_max_bytes,
                joined,
            ]
            reply = cast("list[int]", await self._drop_blocks(keys=[*fixed, *blocks], args=args))
            dropped += int(reply[0])
            self.repaired_keys += int(reply[1])
            self.stream_byte_trims += int(reply[2])
        return dropped

    async def generation(self, replica: ReplicaId) -> int:
        """The generation a writer of ``replica`` must pass to ``apply`` (0 before any drop)."""
        value = await cast("Any", self.client.hget(self.keys.generations, replica))
        return 0 if value is None else int(value)

    @property
    def hints_dropped(self) -> int:
        """Parent hints dropped past ``parent_hints_per_cache`` (:class:`ParentHints`)."""
        return self._hints.dropped

    async def counters(self) -> dict[str, int]:
        """Cumulative counters kept in Redis (evictions, stale writes, speculative outcomes)."""
        raw = await cast("Any", self.client.hgetall(self.keys.counters))
        return {name: int(value) for name, value in raw.items()}

    async def stats(self) -> IndexStats:
        """Sizes from Redis; ``bytes_per_block`` is ``None`` (see ``docs/redis-schema.md`` figures)."""
        for _attempt in range(_ATTEMPTS):
            replicas = await self._speculative_replicas()
            keys = [*self._fixed, *(self.keys.speculative(r) for r in sorted(replicas))]
            code, unique, held_pairs, speculative = cast(
                "list[Any]", await self._stats(keys=keys, args=[self.keys.prefix])
            )
            if code != scripts.RETRY:
                break
            self.key_retries += 1
        else:
            raise BalancerError("the replicas with speculative entries kept changing")
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

    async def held_keys(self, replica: ReplicaId, limit: int) -> list[HeldKeys]:
        """The keys each rank of ``replica`` holds, at most ``limit`` per rank: its caches are the
        ranks with a ``held`` field; each one's ``m:`` map is walked with ``HSCAN`` (``COUNT``
        ``max_script_blocks``) and a key counts when its ``b:`` hash has the cache's field (one
        pipelined ``HEXISTS`` per step). Read in steps, not atomically: an apply between two steps
        may show in one and not in the other (a check compares several readings)."""
        ranks = cast("set[str]", await cast("Any", self.client.smembers(self.keys.ranks(replica))))
        out: list[HeldKeys] = []
        step = self.settings.max_script_blocks
        for rank in sorted(int(r) for r in ranks):
            cid = cache_id(replica, rank)
            held = await cast("Any", self.client.hget(self.keys.held, cid))
            if held is None:
                continue  # no cache now (dropped, or never stored)
            keys: dict[str, None] = {}
            cursor = 0
            while len(keys) < limit:
                cursor, page = cast(
                    "tuple[int, dict[str, str]]",
                    await cast("Any", self.client.hscan(self.keys.engine_map(cid), cursor, count=step)),
                )
                fresh = [key for key in dict.fromkeys(page.values()) if key not in keys]
                if fresh:
                    pipe = self.client.pipeline(transaction=False)
                    for key in fresh:
                        pipe.hexists(self.keys.block(key), cid)
                    present = await pipe.execute()
                    for key, there in zip(fresh, present, strict=True):
                        if there and len(keys) < limit:
                            keys[key] = None
                if not int(cursor):
                    break
            out.append(HeldKeys(rank, int(held), tuple(BlockKey(int(key, 16)) for key in keys)))
        return out

    async def aclose(self) -> None:
        """Close the connection pool if this index created it."""
        if self._owns_client:
            await self.client.aclose()
