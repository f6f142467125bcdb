"""``DrainSync``: the drained replicas, shared by the fleet through Redis (I/O).

Redis holds the replicas drained by hand in one HASH (``<prefix>:drained``: replica id → its
:class:`~balancer.health.book.DrainNote` as JSON ``{"by", "caller", "at_wall_ts", "reason"}``, plus
the marker field ``""`` that says the hash was written by a balancer; a release before ``732957c``
(``9963daf`` and older) wrote ``{"by": <caller>, "at": <Unix s>}``, read as that call's note). A
drain or undrain made through any balancer's admin API (HTTP or gRPC) is written there first and
applied locally only once Redis took it (:meth:`DrainSync.commit`, ``HealthBook`` through
``ServiceState.drain_committer``): when Redis refuses it, the call is refused (503) and applied
nowhere, as a policy change is. The script publishes the change on ``<prefix>:drained:changed``;
every balancer, and every worker of ``kvlb serve --workers N``, syncs at each message and every
``poll_s`` (``redis.policy_poll_s``, in case a message was lost) and drains or undrains its replicas
to match, so a drain reaches the whole fleet within milliseconds, ``poll_s`` at worst.

A sync reads only what changed (since 2026-12-01, h-fleetfollow2; before, the whole hash at every
message and poll: 21–32 ms for 10,000 entries). Every write of this release also bumps the version
in ``<prefix>:drained:version{<prefix>:drained}`` (a HASH: ``version``, ``epoch``, ``floor``) and
records each entry it changed in ``<prefix>:drained:changes{<prefix>:drained}`` (a ZSET: replica id
→ the version of its last change, the newest :data:`MAX_CHANGE_LOG` kept; ``floor`` is the newest
version trimmed away). A sync runs one read-only script that answers Redis's ``TIME``, the version,
and the entries changed since the version this balancer last read
(:class:`~balancer.fleet.drained_entries.DrainedMirror` keeps them; the braces are a hash tag: with
Redis Cluster the three keys are in one slot, as a script needs, and all three match an ACL's
``~<prefix>:*``); it reads the whole hash instead when it has not read it yet, when the epoch
changed (Redis lost the keys: a write that finds the hash absent or garbage starts a new epoch),
when its version is older than ``floor`` or more than :data:`MAX_CHANGES_PER_SYNC` entries changed,
when a message came and the version did not move (a balancer of an older release wrote: it bumps no
version), and every :data:`FULL_READ_EVERY_SYNCS` syncs in any case (an older release's write whose
message was lost).

An absent hash (a fresh Redis, or one that lost its data) is seeded with this balancer's own drains,
so a Redis restart without persistence leaves drained replicas drained, with their notes. A key of
another type (garbage) is replaced the same way. Entries naming replicas this balancer does not know
are ignored (another balancer's discovery may know them); there is at most one entry per replica
drained and not undrained.

A drain belongs to the replica id and outlives its removal by ``health_drain_keep_s`` (as in memory,
:class:`~balancer.health.book.HealthBook`): the balancer whose discovery removes a drained replica
adds ``"removed_at_wall_ts"`` (Unix s, Redis's ``TIME``: one clock for the fleet since h-fleetfollow2;
before, the removing balancer's wall clock, compared with the pruning one's) to its entry
(:meth:`DrainSync.mark_removed`); a balancer that
still lists the replica keeps it drained and clears that time at its next sync (a ConfigMap reaches
pods up to a minute apart), leaving ``"kept_from_removal_wall_ts"`` (the same time) in its place;
an entry whose removal time is more than ``health_drain_keep_s`` before Redis's ``TIME`` is
deleted by the next sync of any balancer that does not list the replica, at most
:data:`MAX_PRUNES_PER_SYNC` per sync. Each of these writes is a compare-and-set on the entry as read,
so a drain, undrain or clearing meanwhile wins. Entries without the time (written before this
release, or by it before the removal) stay until undrained, as before; the older readers ignore the
extra field (``9963daf`` reads only the field's presence, ``732957c`` on only the note's keys) and
the two extra keys. The drains kept for replicas no pool lists here are listed by
:meth:`DrainSync.kept_drains` (``GET /admin/replicas``' ``kept_drains``).
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
from balancer.fleet.drain_scripts import READ, SEED, START, SWAP, WRITE
from balancer.fleet.drained_entries import (
    KEPT_FROM,
    MARKER,
    REMOVED_AT,
    DrainedMirror,
    RemovedEntry,
    note_of,
    removal_of,
)
from balancer.health.book import DrainNote, HealthBook, KeptDrainListing
from balancer.index.redis.client import REDIS_ERRORS, RedisClient, follow_channel, read_hash
from balancer.log_limit import LimitedWarnings
from balancer.metrics import Metrics
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

__all__ = ["KEPT_FROM", "MARKER", "REMOVED_AT", "DrainSync", "not_stored"]

MAX_PRUNES_PER_SYNC = 32
"""Most expired entries one sync deletes (the rest go at the next syncs): bounds a sync's writes."""
MAX_PRUNE_SCAN = 512
"""Most removed entries of replicas not listed here one sync looks at for an expired removal time,
taking up where the previous sync stopped."""
MAX_CHANGE_LOG = 4096
"""Most members of ``<prefix>:drained:changes{<prefix>:drained}`` (about 100 B of Redis each with a
short id); the oldest go first and a balancer that has not read them reads the whole hash once."""
MAX_CHANGES_PER_SYNC = 1024
"""Most changed entries one sync reads by id; more changed: it reads the whole hash instead."""
WHOLE_READ_REASONS = ("first", "epoch", "trimmed", "changes", "unversioned", "periodic")
"""Why a sync reads the whole hash (``kvlb_redis_drain_whole_reads_total{reason}``): its first read
(or no change log yet), a new epoch (Redis lost the keys), the log trimmed past its version, more
than :data:`MAX_CHANGES_PER_SYNC` changes, a message without a version move (an older release wrote),
the periodic read (:data:`FULL_READ_EVERY_SYNCS`)."""
FULL_READ_EVERY_SYNCS = 60
"""A sync reads the whole hash at least once in this many (30 s at ``redis.policy_poll_s: 0.5``):
the bound on how late a write of an older release (which bumps no version) whose message was lost
is seen."""


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
        """``client`` must decode responses. ``wall_clock`` is this balancer's (the difference to
        Redis's ``TIME`` is :attr:`redis_clock_offset_s`)."""
        self.client = client
        self.health = health
        self.key = f"{key_prefix}:drained"
        # under <prefix>: (an ACL's ~<prefix>:* covers them), and in <prefix>:drained's slot by their
        # hash tag (Redis Cluster: a script's keys share one)
        self.keys = [self.key, f"{self.key}:version{{{self.key}}}", f"{self.key}:changes{{{self.key}}}"]
        self.channel = f"{key_prefix}:drained:changed"
        self.poll_s = poll_s
        self._metrics = metrics
        self._on_redis = on_redis
        self._writes = 0
        """Local commits started: a read taken before one is not applied (it may predate it)."""
        self._writing = 0
        self._lock = asyncio.Lock()
        self._write = client.register_script(WRITE)
        self._seed_script = client.register_script(SEED)
        self._swap_script = client.register_script(SWAP)
        self._read = client.register_script(READ)
        self._start = client.register_script(START)
        self._wall_clock = wall_clock
        self.mirror = DrainedMirror()
        """The hash as last read (the entries changed since are read at the next sync)."""
        self._message = False
        """A change message came since the last sync."""
        self._syncs_since_full = 0
        self.full_reads = 0
        """Syncs that read the whole hash (the others read the changed entries only)."""
        self.redis_clock_offset_s = 0.0
        """Redis's ``TIME`` minus this balancer's wall clock at the last sync, seconds."""
        self._warnings = LimitedWarnings(
            log, metrics.log_suppressed_total, clock=monotonic, forgotten=metrics.log_causes_forgotten_total
        )
        for reason in WHOLE_READ_REASONS:
            metrics.redis_drain_whole_reads_total.labels(reason)

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
                repaired, existed = await self._write(
                    keys=self.keys, args=[replica, entry, self.channel, MAX_CHANGE_LOG]
                )
        except REDIS_ERRORS as exc:
            self._failed(exc)
            raise DrainCommitError(not_stored("replica", exc)) from exc
        finally:
            self._writing -= 1
        self._on_redis(None)
        self._repaired(repaired)
        return bool(existed)

    async def _swap(self, replica: str, read: str, written: str) -> bool:
        """Write ``written`` (``""``: delete) over ``replica``'s entry if it is still ``read``."""
        return bool(await self._swap_script(keys=self.keys, args=[replica, read, written, MAX_CHANGE_LOG]))

    async def mark_removed(self, replica: ReplicaId) -> None:
        """Discovery removed ``replica`` here while drained: add its removal time (Redis's ``TIME``)
        to its entry, so that the entry is pruned ``health_drain_keep_s`` later unless a balancer
        lists it again. An entry of an older release (``{"by", "at"}``, or damaged) is left as it is
        (kept until undrained, as that release does); a Redis error is logged and counted (the entry
        then stays until undrained)."""
        try:
            entry = await cast("Any", self.client.hget(self.key, replica))
            if entry is None or removal_of(entry) is not None:
                return
            raw = strict_json.loads(entry)
            if not isinstance(raw, dict) or (raw and DrainNote.from_json(raw) is None):
                return
            seconds, micros = await cast("Any", self.client.time())
            marked = strict_json.dumps({**raw, REMOVED_AT: int(seconds) + int(micros) / 1e6})
            await self._swap(replica, entry, marked)
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
        args: list[str | int] = [MAX_CHANGE_LOG]
        args += [item for replica in drained for item in (replica, strict_json.dumps(entries[replica]))]
        self._repaired(await self._seed_script(keys=self.keys, args=args))
        log.info("drained replicas seeded into Redis: %s", ", ".join(drained) or "none")

    def _repaired(self, repaired: object) -> None:
        if repaired:
            self._metrics.redis_wrongtype_keys_total.inc()
            log.warning("drained-replicas keys %s held garbage: rewritten", ", ".join(self.keys))

    # ------------------------------------------------------------------ Redis → local

    def on_message(self) -> None:
        """A change message came (the next sync reads the whole hash if the version did not move)."""
        self._message = True

    async def sync(self) -> None:
        """Drain and undrain this balancer's replicas as Redis says (seed it when it has nothing).
        Redis counts as working again only once the whole sync did, the seed's write included (as
        :meth:`PolicySync.sync <balancer.fleet.policy_sync.PolicySync.sync>`)."""
        await self._sync()
        self._on_redis(None)
        self._warnings.resolved("drain_redis_error", "")

    async def _sync(self) -> None:
        writes = self._writes
        message, self._message = self._message, False
        mirror = self.mirror
        reply = await self._read(keys=self.keys, args=[mirror.epoch, mirror.version, MAX_CHANGES_PER_SYNC])
        now_s = int(reply[0]) + int(reply[1]) / 1e6  # Redis's clock: the fleet's one
        self.redis_clock_offset_s = now_s - self._wall_clock()
        epoch, version, why = str(reply[2]), int(reply[3]), str(reply[4])
        self._syncs_since_full += 1
        if not why and message and version == mirror.version:
            why = "unversioned"  # a change without a version: a balancer of an older release wrote
        if not why and self._syncs_since_full >= FULL_READ_EVERY_SYNCS:
            why = "periodic"
        if why:
            self._metrics.redis_drain_whole_reads_total.labels(why).inc()
            if not epoch:  # no change log yet (a hash of an older release's), or no hash
                started = await self._start(keys=self.keys, args=[MAX_CHANGE_LOG])
                epoch, version = str(started[0]), int(started[1])
            raw = await read_hash(self.client, self.key)  # {} for garbage: the seed replaces it
            if MARKER not in raw:
                await self._seed()
                return
            if self._writing or writes != self._writes:
                return  # a local change is on its way: the next poll reads it back
            mirror.replace(raw, epoch, version)
            self._syncs_since_full = 0
            self.full_reads += 1
        elif self._writing or writes != self._writes:
            return
        elif version != mirror.version:
            ids, entries = reply[5], reply[6]
            mirror.apply(dict(zip(ids, entries, strict=True)), epoch, version)
        await self._apply(mirror.entries)
        await self._prune(now_s)

    async def _apply(self, raw: dict[str, str]) -> None:
        """Drain and undrain the replicas listed here as ``raw`` (the hash as read) says."""
        listed = self.health.replicas
        for replica, record in list(listed.items()):
            draining = replica in raw
            note = note_of(raw[replica]) if draining else None
            removal = removal_of(raw[replica]) if draining else None
            if record.draining != draining or record.drain != note:
                changed = record.draining != draining
                self.health.set_draining(replica, draining, note)
                if changed:
                    log.info("replica %s %s (from Redis)", replica, "draining" if draining else "undrained")
            if removal is not None:  # listed here: not removed any more (it stays drained)
                record.kept_from_removal_wall_ts = removal[1]  # the fleet's latest removal
                relisted = {k: v for k, v in removal[0].items() if k != REMOVED_AT}
                relisted[KEPT_FROM] = removal[1]
                await self._swap(replica, raw[replica], strict_json.dumps(relisted))
            elif draining and (kept := removal_of(raw[replica], KEPT_FROM)) is not None:
                record.kept_from_removal_wall_ts = kept[1]  # another balancer or worker cleared it
        for replica in [r for r in self.health.kept_drains if r not in raw]:
            self.health.forget_kept(replica)  # undrained through another balancer, or pruned

    async def _prune(self, now_s: float) -> None:
        """Delete the entries of replicas not listed here whose removal is more than
        ``health_drain_keep_s`` before ``now_s`` (Redis's ``TIME``): at most
        :data:`MAX_PRUNES_PER_SYNC` of the next :data:`MAX_PRUNE_SCAN` removed entries."""
        due = self.mirror.prune_candidates(
            self.health.replicas,
            now_s,
            self.health.drain_keep_s,
            scan=MAX_PRUNE_SCAN,
            limit=MAX_PRUNES_PER_SYNC,
        )
        for entry in due:
            if await self._swap(entry.replica, entry.entry, ""):
                log.info(
                    "replica %s: its drain, kept since its removal %.0f s ago, is forgotten",
                    entry.replica,
                    now_s - entry.removed_at_s,
                )

    def kept_drains(self) -> list[RemovedEntry]:
        """The drains the fleet keeps for replicas no pool lists here, newest removal first, as of
        the last sync (their times on Redis's clock: :attr:`redis_clock_offset_s`)."""
        return self.mirror.kept(self.health.replicas)

    def kept_listing(self) -> list[KeptDrainListing]:
        """:meth:`kept_drains` as ``GET /admin/replicas``' ``kept_drains`` lists them."""
        keep_s, offset = self.health.drain_keep_s, self.redis_clock_offset_s
        return [
            KeptDrainListing(
                kept.replica,
                note_of(kept.entry),
                kept.removed_at_s,
                kept.removed_at_s + keep_s,
                "redis",
                offset,
            )
            for kept in self.kept_drains()
        ]

    async def run(self, stop: asyncio.Event) -> None:
        """Sync at each change message and every ``poll_s`` (a message may be lost: pub/sub is
        fire-and-forget) until ``stop`` is set."""
        await follow_channel(
            self.client, self.channel, self.poll_s, self.sync, self._failed, stop, on_message=self.on_message
        )

    def _failed(self, exc: BaseException) -> None:
        self._on_redis(exc)
        self._metrics.redis_errors_total.labels("drain").inc()
        self._warnings.warning("drain_redis_error", "", "drain sync: redis error: %s", exc)
