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
drained and not undrained. A replica drained and then removed by discovery keeps its entry (nothing
undrains it), so with pods renamed at each rollout the hash grows by one entry per such scale-down
(docs/reliability.md, "Open points").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

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
-- change. -> 1 if the key was repaired
redis.call('HSET', KEYS[1], '', '1')
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
redis.pcall('PUBLISH', ARGV[3], ARGV[1]) -- refused (an ACL user without the channel): the polls follow it
return repaired
"""
)

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
        self._warnings = LimitedWarnings(log, metrics.log_suppressed_total, clock=monotonic)

    # ------------------------------------------------------------------ local → Redis

    async def commit(self, replica: ReplicaId, note: DrainNote | None) -> None:
        """Store a drain (its ``note``) or, ``None``, an undrain for the whole fleet before it is
        applied here. Raises :class:`DrainCommitError` when Redis did not take it."""
        self._writes += 1
        self._writing += 1
        try:
            entry = "" if note is None else strict_json.dumps(note.to_json())
            async with self._lock:
                repaired = await self._write(keys=[self.key], args=[replica, entry, self.channel])
        except REDIS_ERRORS as exc:
            self._failed(exc)
            raise DrainCommitError(not_stored("replica", exc)) from exc
        finally:
            self._writing -= 1
        self._on_redis(None)
        self._repaired(repaired)

    async def _seed(self) -> None:
        """Write this balancer's drains over an absent (or garbage) hash."""
        drained = sorted((str(r), rec.drain) for r, rec in self.health.replicas.items() if rec.draining)
        args = [
            item
            for replica, note in drained
            for item in (replica, strict_json.dumps({} if note is None else note.to_json()))
        ]
        self._repaired(await self._seed_script(keys=[self.key], args=args))
        log.info("drained replicas seeded into Redis: %s", ", ".join(r for r, _ in drained) or "none")

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
        for replica, record in self.health.replicas.items():
            draining = replica in raw
            note = _note(raw[replica]) if draining else None
            if record.draining == draining and record.drain == note:
                continue
            changed = record.draining != draining
            self.health.set_draining(replica, draining, note)
            if changed:
                log.info("replica %s %s (from Redis)", replica, "draining" if draining else "undrained")

    async def run(self, stop: asyncio.Event) -> None:
        """Read the drained replicas at each change message and every ``poll_s`` (a message may be
        lost: pub/sub is fire-and-forget) until ``stop`` is set."""
        await follow_channel(self.client, self.channel, self.poll_s, self.sync, self._failed, stop)

    def _failed(self, exc: BaseException) -> None:
        self._on_redis(exc)
        self._metrics.redis_errors_total.labels("drain").inc()
        self._warnings.warning("drain_redis_error", "", "drain sync: redis error: %s", exc)
