"""``IngestionLease``: exactly one ingester per replica across the fleet (I/O, Redis).

A TRT-LLM ``/kv_cache_events`` drain must have one consumer, and one writer per replica keeps the
index's event order. The lease is a Redis string ``lease:<replica>`` = owner token, set with
``SET NX PX``:

* ``acquire`` takes a free (or expired) lease, or refreshes the caller's own. Taking it from nobody
  **bumps the replica's generation** in the same script, so a previous owner that lost the lease
  (paused, partitioned) gets :class:`~balancer.index.redis.index.StaleGenerationError` on its next
  write instead of interleaving with the new owner. An owner taking its own expired lease back
  while the stored generation is still the one it writes with keeps it (``keep_generation``):
  nobody held the lease in between, so there is nobody to fence. The grant carries the generation
  and the last engine sequence number applied (``RedisIndex.apply(..., seq=)`` stores it with each
  batch), so the new owner resumes (or replays) from there.
* Positions are stored as text, ``rank:seq`` pairs joined by commas (``-`` when the engine has no
  sequence numbers, e.g. a TRT-LLM drain; a bare integer is rank 0's), then ``@`` and the number of
  writes so far (each write's text is unique, so a writer can tell whether its own write landed).
  A trailing ``!`` says the last holder stopped cleanly, with every event it took applied
  (:func:`encode_positions`).
* ``renew`` extends only the caller's own lease; ``release`` deletes only the caller's own lease;
  ``retire`` (a replica that left) also deletes the replica's positions and generation (after
  raising the pool's generation floor to it), so ``seq`` and ``gen`` do not keep a field per
  replica id ever seen.
* ``keep`` renews every ``renew_every_s`` until stopped; it sets ``lost`` and returns when the
  lease is gone (expired and taken, or deleted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from balancer.index.redis.client import REDIS_ERRORS, RedisClient
from balancer.index.redis.schema import RedisKeys
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

_REPAIR = """
-- Garbage written over a key of ours (another type) is deleted and counted in the pool's counters
-- (KEYS[1], repaired first), so one bad write cannot cost a lease with WRONGTYPE.
local fixed = 0
local function repair(key, want, name)
  local t = redis.call('TYPE', key)['ok']
  if t == want or t == 'none' then return false end
  redis.call('DEL', key)
  fixed = fixed + 1
  redis.call('HINCRBY', KEYS[1], 'wrongtype_' .. name, 1)
  return true
end
repair(KEYS[1], 'hash', 'ctr')
-- The next generation of a replica: one more than its own, or, without a field (never leased, or
-- retired), than the pool's floor, which is at least every generation a retirement deleted.
local function next_generation(gen_key, replica)
  local current = redis.call('HGET', gen_key, replica) or redis.call('HGET', KEYS[1], 'gen_floor') or '0'
  local gen = (tonumber(current) or 0) + 1
  redis.call('HSET', gen_key, replica, gen)
  return gen
end
"""

_ACQUIRE = (
    _REPAIR
    + """
-- KEYS: counters, lease, gen, seq; ARGV: replica, owner, ttl_ms, kept generation ('' = none)
-- -> {acquired, generation, last seq or '', keys repaired}
local R, OWNER, TTL, KEEP = ARGV[1], ARGV[2], ARGV[3], ARGV[4] or ''
local lk, GEN, SEQ = KEYS[2], KEYS[3], KEYS[4]
repair(GEN, 'hash', 'gen')
repair(SEQ, 'hash', 'seq')
if repair(lk, 'string', 'lease') then
  return {0, 0, '', fixed}  -- its holder renews it first (next tick); else it is free then
end
local holder = redis.call('GET', lk)
local gen
if holder == OWNER then
  redis.call('PEXPIRE', lk, TTL)
  gen = tonumber(redis.call('HGET', GEN, R) or '0')
elseif holder then
  return {0, 0, '', fixed}
else
  redis.call('SET', lk, OWNER, 'PX', TTL)
  -- Taken back by the holder whose generation is still the stored one: nobody took the lease
  -- since (each taker bumps it), so there is no other writer to fence, and our own write in
  -- flight with that generation must land, not be refused and sent again
  if KEEP ~= '' and redis.call('HGET', GEN, R) == KEEP then
    gen = tonumber(KEEP)
  else
    gen = next_generation(GEN, R)
  end
end
return {1, gen, redis.call('HGET', SEQ, R) or '', fixed}
"""
)

_RENEW = (
    _REPAIR
    + """
-- KEYS: counters, lease; ARGV: owner, ttl_ms -> {1 if still ours, keys repaired}
-- Garbage over our lease: we held it at our last renewal, and a taker needs the key absent, so
-- it is ours again.
if repair(KEYS[2], 'string', 'lease') then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
  return {1, fixed}
end
if redis.call('GET', KEYS[2]) == ARGV[1] then
  return {redis.call('PEXPIRE', KEYS[2], ARGV[2]), fixed}
end
return {0, fixed}
"""
)

_RELEASE = (
    _REPAIR
    + """
-- KEYS: counters, lease; ARGV: owner -> 1 if it was ours
repair(KEYS[2], 'string', 'lease')
if redis.call('GET', KEYS[2]) == ARGV[1] then
  return redis.call('DEL', KEYS[2])
end
return 0
"""
)


_RETIRE = (
    _REPAIR
    + """
-- KEYS: counters, lease, seq, gen; ARGV: owner, replica -> 1 if the lease was ours
-- A replica that left: its lease goes, and so do its position, which nobody may resume from (the
-- caller dropped its blocks first), and its generation, which first raises the pool's floor
-- (`gen_floor` in the counters): the id's next generation is above every one it had, so a paused
-- writer of its earlier life stays fenced. Only while the lease is ours, or nobody's (it expired
-- while Redis was out of reach, and nobody took it since): a writer that holds the replica never
-- loses the position or generation it writes with.
repair(KEYS[2], 'string', 'lease')
repair(KEYS[3], 'hash', 'seq')
repair(KEYS[4], 'hash', 'gen')
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[3], ARGV[2])
local gen = tonumber(redis.call('HGET', KEYS[4], ARGV[2])) or 0
if gen > (tonumber(redis.call('HGET', KEYS[1], 'gen_floor')) or 0) then
  redis.call('HSET', KEYS[1], 'gen_floor', gen)
end
redis.call('HDEL', KEYS[4], ARGV[2])
if holder then return redis.call('DEL', KEYS[2]) end
return 0
"""
)


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    ttl_s: float = 10.0
    """Lease lifetime without renewal; another ingester can take the replica this long after the
    owner stops renewing (crash, partition)."""
    renew_every_s: float = 3.0
    """Renewal period of :meth:`IngestionLease.keep`; must be well below ``ttl_s``."""

    def __post_init__(self) -> None:
        if not 0 < self.renew_every_s < self.ttl_s:
            raise ValueError(f"need 0 < renew_every_s < ttl_s, got {self}")

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """The outcome of :meth:`IngestionLease.acquire`."""

    acquired: bool
    generation: int
    """The generation to pass to ``RedisIndex.apply`` while holding the lease (0 when refused)."""
    last_seq: int | None
    """Engine sequence number of rank 0's last batch applied for the replica, ``None`` if never."""
    applied: str = ""
    """The stored positions as text (empty: nothing was ever applied with positions)."""
    positions: Mapping[int, int] = field(default_factory=dict)
    """Last applied sequence number per DP rank."""
    clean: bool = False
    """The previous holder stopped cleanly (no event taken from the engine was left unapplied)."""
    writes: int = 0
    """Writes with positions so far (the ``@`` part)."""


def encode_positions(positions: Mapping[int, int], clean: bool = False, writes: int = 0) -> str:
    """``{rank: seq}`` as stored in the ``seq`` hash (see the module docstring)."""
    text = ",".join(f"{rank}:{seq}" for rank, seq in sorted(positions.items())) or "-"
    if writes:
        text += f"@{writes}"
    return text + "!" if clean else text


def decode_positions(text: str) -> tuple[dict[int, int], bool, int]:
    """``(positions, clean, writes)`` from :func:`encode_positions` text; bad pairs are ignored."""
    clean = text.endswith("!")
    body, _, count = text.rstrip("!").partition("@")
    writes = int(count) if count.isdigit() else 0
    if body.lstrip("-").isdigit():
        return {0: int(body)}, clean, writes
    positions: dict[int, int] = {}
    for pair in body.split(","):
        rank, sep, seq = pair.partition(":")
        if sep and rank.isdigit() and seq.lstrip("-").isdigit():
            positions[int(rank)] = int(seq)
    return positions, clean, writes


class IngestionLease:
    """The lease of one replica, held under one owner token. ``client`` decodes responses."""

    def __init__(
        self, client: RedisClient, keys: RedisKeys, replica: ReplicaId, owner: str, settings: LeaseSettings
    ) -> None:
        self.client = client
        self.keys = keys
        self.replica = replica
        self.owner = owner
        self.settings = settings
        self.lost = asyncio.Event()
        self.repaired_keys = 0
        """Wrong-typed keys (lease, ``gen``, ``seq``, ``ctr``) this lease's scripts deleted."""
        self._key = keys.lease(replica)
        self._anchor = [keys.counters]
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._retire = client.register_script(_RETIRE)

    async def acquire(self, keep_generation: int | None = None) -> LeaseGrant:
        """Take the lease if it is free or already ours (a new holder bumps the generation).

        ``keep_generation``: the generation this owner still writes with, for a lease of its own
        that expired (Redis unreachable longer than the TTL): if it is still the stored one, nobody
        took the lease since (each taker bumps it), and the lease is taken back *without* a bump, so
        the owner's write in flight lands instead of being refused as stale and sent again (after a
        Redis restart under load that redo cost up to 0.7 s a replica, 2026-12-01). Otherwise the
        generation is bumped as for any new holder."""
        keys = [*self._anchor, self._key, self.keys.generations, self.keys.applied_seq]
        kept = "" if keep_generation is None else str(keep_generation)
        args: list[str | int] = [self.replica, self.owner, self.settings.ttl_ms, kept]
        ok, generation, seq, fixed = cast("list[Any]", await self._acquire(keys=keys, args=args))
        self.repaired_keys += int(fixed)
        if ok:
            self.lost.clear()
        positions, clean, writes = decode_positions(seq) if seq else ({}, False, 0)
        return LeaseGrant(bool(ok), int(generation), positions.get(0), seq, positions, clean, writes)

    async def renew(self) -> bool:
        """Extend the lease if it is still ours."""
        args: list[str | int] = [self.owner, self.settings.ttl_ms]
        ours, fixed = cast("list[int]", await self._renew(keys=[*self._anchor, self._key], args=args))
        self.repaired_keys += int(fixed)
        return bool(ours)

    async def release(self) -> bool:
        """Give the lease up if it is still ours (another ingester can take it at once)."""
        return bool(await self._release(keys=[*self._anchor, self._key], args=[self.owner]))

    async def retire(self) -> bool:
        """Give the lease up for good, if it is still ours, deleting the replica's stored positions
        and generation in the same script (also when nobody holds the lease: it expired): for a
        replica that left discovery, once its blocks were dropped (they would resume nothing). The
        next holder of the same id starts without positions, with a generation above the pool's
        floor (above every deleted one). ``True`` when the lease was ours."""
        keys = [*self._anchor, self._key, self.keys.applied_seq, self.keys.generations]
        return bool(await self._retire(keys=keys, args=[self.owner, self.replica]))

    async def holder(self) -> str | None:
        return cast("str | None", await cast("Any", self.client.get(self._key)))

    async def keep(self, stop: asyncio.Event) -> None:
        """Renew until ``stop`` is set or the lease is lost (then ``lost`` is set).

        A Redis error is logged and the next renewal retried; if errors last longer than the
        lease, the next successful call finds it gone and reports it lost.
        """
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.renew_every_s)
            if stop.is_set():
                return
            try:
                still_ours = await self.renew()
            except REDIS_ERRORS as exc:
                log.warning("lease of %s: renewal failed: %s", self.replica, exc)
                continue
            if not still_ours:
                log.warning("lease of %s: lost", self.replica)
                self.lost.set()
                return
