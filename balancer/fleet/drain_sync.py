"""``DrainSync``: the drained replicas, shared by the fleet through Redis (I/O).

Redis holds the replicas drained by hand in one HASH (``<prefix>:drained``: replica id → its
:class:`~balancer.health.book.DrainNote` as JSON ``{"by", "caller", "at_wall_ts", "reason"}``, plus
the marker field ``""`` that says the hash was written by a balancer; a release before ``732957c``
(``9963daf`` and older) wrote ``{"by": <caller>, "at": <Unix s>}``, read as that call's note). A
drain or undrain made through any balancer's admin API (HTTP or gRPC) is written there first and
applied locally only once Redis took it (:meth:`DrainSync.commit`, ``HealthBook`` through
``ServiceState.drain_committer``): when Redis refuses it, the call is refused (503) and applied
nowhere, as a policy change is. The script publishes the change on ``<prefix>:drained:changed``;
every balancer, and every worker of ``kvlb serve --workers N``, reads the hash at each message and
every ``poll_s`` (``redis.policy_poll_s``, in case a message was lost) and drains or undrains its
replicas to match, so a drain reaches the whole fleet within milliseconds, ``poll_s`` at worst.

An absent hash (a fresh Redis, or one that lost its data) is seeded with this balancer's own drains,
so a Redis restart without persistence leaves drained replicas drained, with their notes. A key of
another type (garbage) is replaced the same way. Entries naming replicas this balancer does not know
are ignored (another balancer's discovery may know them); there is at most one entry per replica
drained and not undrained.

A drain belongs to the replica id and outlives its removal by ``health_drain_keep_s`` (as in memory,
:class:`~balancer.health.book.HealthBook`): the balancer whose discovery removes a drained replica
adds ``"removed_at_wall_ts"`` (Unix s) to its entry (:meth:`DrainSync.mark_removed`); a balancer that
still lists the replica keeps it drained and clears that time at its next sync (a ConfigMap reaches
pods up to a minute apart), leaving ``"kept_from_removal_wall_ts"`` (the same time) in its place;
an entry whose removal time is more than ``health_drain_keep_s`` old is
deleted by the next sync of any balancer that does not list the replica, at most
:data:`MAX_PRUNES_PER_SYNC` per sync. Each of these writes is a compare-and-set on the entry as read,
so a drain, undrain or clearing meanwhile wins. Entries without the time (written before this
release, or by it before the removal) stay until undrained, as before; the older readers ignore the
extra field (``9963daf`` reads only the field's presence, ``732957c`` on only the note's keys).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, cast

from redis.exceptions import TimeoutError as RedisTimeoutError

from balancer import strict_json
from balancer.errors import DrainCommitError
from balancer.health.book import DrainNote, HealthBook
from balancer.index.redis.client import REDIS_ERRORS, RedisClient, follow_channel, read_hash
from balancer.log_limit import LimitedWarnings
from balancer.metrics import Metrics
from balancer.service.audit import DEFAULT_ACTOR
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

MARKER = ""
"""The hash's marker field (no replica id is empty): present once a balancer wrote the hash."""
REMOVED_AT = "removed_at_wall_ts"
"""The key of an entry's removal time (Unix s), written by the balancer whose discovery removed it."""
KEPT_FROM = "kept_from_removal_wall_ts"
"""The key that replaces :data:`REMOVED_AT` when a balancer lists the replica again: the drain was
kept from before that removal (``health.drain_kept`` on every balancer and worker, whichever of them
cleared the removal time first)."""
MAX_PRUNES_PER_SYNC = 32
"""Most expired entries one sync deletes (the rest go at the next syncs): bounds a sync's writes."""
MAX_PRUNE_SCAN = 512
"""Most entries of replicas not listed here one sync looks at for an expired removal time, taking up
where the previous sync stopped: bounds the JSON parsing on the event loop (measured, 10,000 entries
with a removal time parsed at every sync took the sync from 32 to 113 ms at load 4.5 on 2 cores)."""

_REPLACE_GARBAGE = """
-- KEYS[1]: drained HASH. A key of another type (garbage written over it) is deleted: `repaired`
local repaired = 0
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'hash' and t ~= 'none' then
  redis.call('DEL', KEYS[1])
  repaired = 1
end
"""

_WRITE = (
    _REPLACE_GARBAGE
    + """
-- ARGV[1]: replica, ARGV[2]: its entry (JSON), '' to undrain it; ARGV[3]: the channel told of the
-- change. -> {1 if the key was repaired, 1 if the entry was there (an undrain) or a drain}
redis.call('HSET', KEYS[1], '', '1')
local existed = 1
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
else
  existed = redis.call('HDEL', KEYS[1], ARGV[1])
end
redis.pcall('PUBLISH', ARGV[3], ARGV[1]) -- refused (an ACL user without the channel): the polls follow it
return {repaired, existed}
"""
)

_SWAP = """
-- KEYS[1]: drained HASH. ARGV[1]: replica, ARGV[2]: its entry as read, ARGV[3]: the entry to write
-- ('' deletes it). Written only if the entry is still the one read. -> 1 if written
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  return 0
end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
return 1
"""

_SEED = (
    _REPLACE_GARBAGE
    + """
-- ARGV: pairs of a replica id this balancer has drained and its note (JSON). Adds them (keeping
-- entries already there) and the marker. -> 1 if the key was repaired
for i = 1, #ARGV, 2 do
  redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('HSET', KEYS[1], '', '1')
return repaired
"""
)


def not_stored(what: str, exc: BaseException) -> str:
    """The 503's message for a change Redis did not confirm. A refusal (an error answer, a refused
    connection) means it was stored nowhere; a timeout does not: Redis may run the write once it
    answers again (a stalled server runs what its socket holds), and every balancer then follows it."""
    if isinstance(exc, (RedisTimeoutError, TimeoutError)):
        return (
            f"{what} not confirmed: Redis did not answer in time ({exc}); it may still be stored and "
            "reach every balancer once Redis answers, so read it back before trying again"
        )
    return f"{what} not changed: Redis did not store it ({exc})"


def _note(entry: str) -> DrainNote | None:
    """The note of a hash entry (``None`` for one seeded without a note, or damaged). An entry of a
    release before ``732957c`` (``{"by": <caller>, "at": <Unix s>}``, which a balancer of that release
    still writes in a mixed fleet during a rolling upgrade or a rollback) reads as the note this
    release writes for the same call: the caller it names, no actor given (``admin``), no reason.
    Until 2026-12-01 (h-upgrade) such a drain showed no note at all on the new balancers."""
    try:
        raw = strict_json.loads(entry)
    except (ValueError, RecursionError):
        return None
    return DrainNote.from_json(raw) or _previous_note(raw)


def _previous_note(raw: object) -> DrainNote | None:
    """The note of a previous release's entry ``{"by": <caller>, "at": <Unix s>}``, else ``None``."""
    if not isinstance(raw, dict) or set(raw) != {"by", "at"}:
        return None
    caller, at = raw["by"], raw["at"]
    if not isinstance(caller, str) or isinstance(at, bool) or not isinstance(at, int | float):
        return None
    return DrainNote(DEFAULT_ACTOR, caller, float(at), None)


def _removal(entry: str, key: str = REMOVED_AT) -> tuple[dict[str, object], float] | None:
    """An entry with its removal time (``key``: :data:`REMOVED_AT`, or :data:`KEPT_FROM`): its JSON
    object and that time; ``None`` for any other."""
    if key not in entry:  # most entries: no parse
        return None
    try:
        raw = strict_json.loads(entry)
    except (ValueError, RecursionError):
        return None
    at = raw.get(key) if isinstance(raw, dict) else None
    if isinstance(at, bool) or not isinstance(at, int | float):
        return None
    return raw, float(at)


class DrainSync:
    """Keeps one balancer's drained replicas (:class:`HealthBook`) and the fleet's in Redis equal."""

    def __init__(
        self,
        client: RedisClient,
        health: HealthBook,
        *,
        key_prefix: str,
        poll_s: float,
        metrics: Metrics,
        on_redis: Callable[[BaseException | None], None] = lambda error: None,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``client`` must decode responses."""
        self.client = client
        self.health = health
        self.key = f"{key_prefix}:drained"
        self.channel = f"{key_prefix}:drained:changed"
        self.poll_s = poll_s
        self._metrics = metrics
        self._on_redis = on_redis
        self._writes = 0
        """Local commits started: a read taken before one is not applied (it may predate it)."""
        self._writing = 0
        self._lock = asyncio.Lock()
        self._write = client.register_script(_WRITE)
        self._seed_script = client.register_script(_SEED)
        self._swap = client.register_script(_SWAP)
        self._wall_clock = wall_clock
        self._prune_from = 0
        """Where in the hash's entries the next sync's prune window starts."""
        self._warnings = LimitedWarnings(log, metrics.log_suppressed_total, clock=monotonic)

    # ------------------------------------------------------------------ local → Redis

    async def commit(self, replica: ReplicaId, note: DrainNote | None) -> bool:
        """Store a drain (its ``note``) or, ``None``, an undrain for the whole fleet before it is
        applied here; ``False`` for an undrain of an id the hash did not hold. Raises
        :class:`DrainCommitError` when Redis did not take it."""
        self._writes += 1
        self._writing += 1
        try:
            entry = "" if note is None else strict_json.dumps(note.to_json())
            async with self._lock:
                repaired, existed = await self._write(keys=[self.key], args=[replica, entry, self.channel])
        except REDIS_ERRORS as exc:
            self._failed(exc)
            raise DrainCommitError(not_stored("replica", exc)) from exc
        finally:
            self._writing -= 1
        self._on_redis(None)
        self._repaired(repaired)
        return bool(existed)

    async def mark_removed(self, replica: ReplicaId, wall: float) -> None:
        """Discovery removed ``replica`` here while drained: add its removal time ``wall`` (Unix s)
        to its entry, so that the entry is pruned ``health_drain_keep_s`` later unless a balancer
        lists it again. An entry of an older release (``{"by", "at"}``, or damaged) is left as it is
        (kept until undrained, as that release does); a Redis error is logged and counted (the entry
        then stays until undrained)."""
        try:
            entry = await cast("Any", self.client.hget(self.key, replica))
            if entry is None or _removal(entry) is not None:
                return
            raw = strict_json.loads(entry)
            if not isinstance(raw, dict) or (raw and DrainNote.from_json(raw) is None):
                return
            marked = strict_json.dumps({**raw, REMOVED_AT: wall})
            await self._swap(keys=[self.key], args=[replica, entry, marked])
        except (ValueError, RecursionError):
            return
        except REDIS_ERRORS as exc:
            self._failed(exc)

    async def _seed(self) -> None:
        """Write this balancer's drains over an absent (or garbage) hash: its replicas' and those it
        keeps from before their removal (with their removal time)."""
        entries: dict[str, dict[str, object]] = {
            str(replica): {} if kept.note is None else kept.note.to_json()
            for replica, kept in self.health.kept_drains.items()
        }
        for replica, kept in self.health.kept_drains.items():
            entries[str(replica)][REMOVED_AT] = kept.removed_at_wall_ts
        for replica, rec in self.health.replicas.items():
            if rec.draining:
                entries[str(replica)] = {} if rec.drain is None else rec.drain.to_json()
        drained = sorted(entries)
        args = [item for replica in drained for item in (replica, strict_json.dumps(entries[replica]))]
        self._repaired(await self._seed_script(keys=[self.key], args=args))
        log.info("drained replicas seeded into Redis: %s", ", ".join(drained) or "none")

    def _repaired(self, repaired: object) -> None:
        if repaired:
            self._metrics.redis_wrongtype_keys_total.inc()
            log.warning("drained-replicas key %s held garbage: rewritten", self.key)

    # ------------------------------------------------------------------ Redis → local

    async def sync(self) -> None:
        """Drain and undrain this balancer's replicas as Redis says (seed it when it has nothing).
        Redis counts as working again only once the whole sync did, the seed's write included (as
        :meth:`PolicySync.sync <balancer.fleet.policy_sync.PolicySync.sync>`)."""
        await self._sync()
        self._on_redis(None)
        self._warnings.resolved("drain_redis_error", "")

    async def _sync(self) -> None:
        writes = self._writes
        raw = await read_hash(self.client, self.key)  # {} for garbage: the seed replaces it with ours
        if MARKER not in raw:
            await self._seed()
            return
        if self._writing or writes != self._writes:
            return  # a local change is on its way: the next poll reads it back
        listed = self.health.replicas
        for replica, record in list(listed.items()):
            draining = replica in raw
            note = _note(raw[replica]) if draining else None
            removal = _removal(raw[replica]) if draining else None
            if record.draining != draining or record.drain != note:
                changed = record.draining != draining
                self.health.set_draining(replica, draining, note)
                if changed:
                    log.info("replica %s %s (from Redis)", replica, "draining" if draining else "undrained")
            if removal is not None:  # listed here: not removed any more (it stays drained)
                record.kept_from_removal_wall_ts = removal[1]  # the fleet's latest removal
                relisted = {k: v for k, v in removal[0].items() if k != REMOVED_AT}
                relisted[KEPT_FROM] = removal[1]
                await self._swap(keys=[self.key], args=[replica, raw[replica], strict_json.dumps(relisted)])
            elif draining and (kept := _removal(raw[replica], KEPT_FROM)) is not None:
                record.kept_from_removal_wall_ts = kept[1]  # another balancer or worker cleared it
        for replica in [r for r in self.health.kept_drains if r not in raw]:
            self.health.forget_kept(replica)  # undrained through another balancer, or pruned
        await self._prune(raw)

    async def _prune(self, raw: dict[str, str]) -> None:
        """Delete the entries of replicas not listed here whose removal is more than
        ``health_drain_keep_s`` old: at most :data:`MAX_PRUNES_PER_SYNC` of the next
        :data:`MAX_PRUNE_SCAN` entries (a window that moves on at each sync)."""
        now, keep_s, pruned = self._wall_clock(), self.health.drain_keep_s, 0
        entries = list(raw.items())
        start = self._prune_from % len(entries) if entries else 0
        window = (entries[start:] + entries[:start])[:MAX_PRUNE_SCAN]
        self._prune_from = start + len(window)
        for replica, entry in window:
            if replica in self.health.replicas or (removal := _removal(entry)) is None:
                continue
            if now - removal[1] <= keep_s:
                continue
            if await self._swap(keys=[self.key], args=[replica, entry, ""]):
                log.info(
                    "replica %s: its drain, kept since its removal %.0f s ago, is forgotten",
                    replica,
                    now - removal[1],
                )
            pruned += 1
            if pruned >= MAX_PRUNES_PER_SYNC:
                return

    async def run(self, stop: asyncio.Event) -> None:
        """Read the drained replicas at each change message and every ``poll_s`` (a message may be
        lost: pub/sub is fire-and-forget) until ``stop`` is set."""
        await follow_channel(self.client, self.channel, self.poll_s, self.sync, self._failed, stop)

    def _failed(self, exc: BaseException) -> None:
        self._on_redis(exc)
        self._metrics.redis_errors_total.labels("drain").inc()
        self._warnings.warning("drain_redis_error", "", "drain sync: redis error: %s", exc)
