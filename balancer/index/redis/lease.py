"""``IngestionLease``: exactly one ingester per replica across the fleet (I/O, Redis).

A TRT-LLM ``/kv_cache_events`` drain must have one consumer, and one writer per replica keeps the
index's event order. The lease is a Redis string ``lease:<replica>`` = owner token, set with
``SET NX PX``:

* ``acquire`` takes a free (or expired) lease, or refreshes the caller's own. Taking it from nobody
  **bumps the replica's generation** in the same script, so a previous owner that lost the lease
  (paused, partitioned) gets :class:`~balancer.index.redis.index.StaleGenerationError` on its next
  write instead of interleaving with the new owner. The grant carries that generation and the last
  engine sequence number applied (``RedisIndex.apply(..., seq=)`` stores it with each batch), so
  the new owner resumes (or replays) from there.
* Positions are stored as text, ``rank:seq`` pairs joined by commas (``-`` when the engine has no
  sequence numbers, e.g. a TRT-LLM drain; a bare integer is rank 0's), then ``@`` and the number of
  writes so far (each write's text is unique, so a writer can tell whether its own write landed).
  A trailing ``!`` says the last holder stopped cleanly, with every event it took applied
  (:func:`encode_positions`).
* ``renew`` extends only the caller's own lease; ``release`` deletes only the caller's own lease.
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

_ACQUIRE = """
-- KEYS[1]: anchor; ARGV: prefix, replica, owner, ttl_ms -> {acquired, generation, last seq or ''}
local P, R, OWNER, TTL = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lk = P .. 'lease:' .. R
local holder = redis.call('GET', lk)
local gen
if holder == OWNER then
  redis.call('PEXPIRE', lk, TTL)
  gen = tonumber(redis.call('HGET', P .. 'gen', R) or '0')
elseif holder then
  return {0, 0, ''}
else
  redis.call('SET', lk, OWNER, 'PX', TTL)
  gen = redis.call('HINCRBY', P .. 'gen', R, 1)
end
return {1, gen, redis.call('HGET', P .. 'seq', R) or ''}
"""

_RENEW = """
-- KEYS[1]: anchor; ARGV: lease key, owner, ttl_ms -> 1 if still ours
if redis.call('GET', ARGV[1]) == ARGV[2] then
  return redis.call('PEXPIRE', ARGV[1], ARGV[3])
end
return 0
"""

_RELEASE = """
-- KEYS[1]: anchor; ARGV: lease key, owner -> 1 if it was ours
if redis.call('GET', ARGV[1]) == ARGV[2] then
  return redis.call('DEL', ARGV[1])
end
return 0
"""


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
        self._key = keys.lease(replica)
        self._anchor = [keys.counters]
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    async def acquire(self) -> LeaseGrant:
        """Take the lease if it is free or already ours (a new holder bumps the generation)."""
        args: list[str | int] = [self.keys.prefix, self.replica, self.owner, self.settings.ttl_ms]
        ok, generation, seq = cast("list[Any]", await self._acquire(keys=self._anchor, args=args))
        if ok:
            self.lost.clear()
        positions, clean, writes = decode_positions(seq) if seq else ({}, False, 0)
        return LeaseGrant(bool(ok), int(generation), positions.get(0), seq, positions, clean, writes)

    async def renew(self) -> bool:
        """Extend the lease if it is still ours."""
        args: list[str | int] = [self._key, self.owner, self.settings.ttl_ms]
        return bool(await self._renew(keys=self._anchor, args=args))

    async def release(self) -> bool:
        """Give the lease up if it is still ours (another ingester can take it at once)."""
        return bool(await self._release(keys=self._anchor, args=[self._key, self.owner]))

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
