"""``PolicySync``: the routing policy and its weights, shared by the fleet through Redis (I/O).

Redis holds the policy in force in one HASH (``<prefix>:policy``: ``name``, ``weights`` as JSON,
``version``, ``updated_by``, ``updated_at``, and the change's ``actor`` and ``reason``, so every
balancer that adopts it adds it to its own audit log with them, and ``noted``, which tells them
from the ones a previous release left in place: :func:`_attribution`). A change made through any
balancer's admin API (HTTP or gRPC) is written there by one script that increments ``version``
and publishes it on ``<prefix>:policy:changed``. Every balancer adopts it when the message
arrives, and also checks the version every ``poll_s`` in case a message was missed (pub/sub is
fire-and-forget). So a change reaches every balancer within ``poll_s`` at worst, usually within
milliseconds.

At start-up an empty Redis gets this balancer's configured policy (version 1); otherwise the stored
one wins. After Redis lost its data, the first balancer to notice writes its view back with its
version, so versions never go backwards. While a local change is still being written, remote
views are not adopted (no flicker back to the previous one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, cast

from balancer import strict_json
from balancer.errors import ConfigError
from balancer.fleet.drain_sync import not_stored
from balancer.index.redis.client import REDIS_ERRORS, RedisClient, follow_channel, read_hash
from balancer.log_limit import LimitedWarnings
from balancer.metrics import Metrics
from balancer.policy import PolicyWeights
from balancer.service.audit import DEFAULT_ACTOR, AuditEntry, AuditLog
from balancer.service.policy_control import PolicyCommitError, PolicyControl, PolicyView, differences

log = logging.getLogger(__name__)

_WRITE = """
-- KEYS[1]: policy HASH; ARGV: name, weights json, updated_by, updated_at, channel, version or '',
--          floor (the writer's version), actor, reason ('' for none)
-- version '' = a change: increment; else seed with that version, only if the hash is absent.
-- A key of another type, or a version that is not an integer (garbage written over it), is
-- repaired: the key is rewritten whole, numbered from `floor`, so versions never go back.
-- `noted` = [version, actor, reason] as this script wrote them (see `_attribution`).
-- -> {version, 1 if repaired} ({-1, 0}: a seed found a policy)
local repaired = 0
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'hash' and t ~= 'none' then
  redis.call('DEL', KEYS[1])
  repaired = 1
end
local stored = redis.call('HGET', KEYS[1], 'version')
if t == 'hash' and not stored then
  redis.call('DEL', KEYS[1])
  repaired = 1
elseif stored and not string.match(stored, '^%d+$') then
  redis.call('HSET', KEYS[1], 'version', ARGV[7])
  repaired = 1
end
if ARGV[6] ~= '' then
  if repaired == 0 and redis.call('EXISTS', KEYS[1]) == 1 then return {-1, 0} end
  redis.call('HSET', KEYS[1], 'version', ARGV[6])
end
local v = ARGV[6] ~= '' and tonumber(ARGV[6]) or redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HSET', KEYS[1], 'name', ARGV[1], 'weights', ARGV[2], 'updated_by', ARGV[3], 'updated_at', ARGV[4],
  'actor', ARGV[8], 'reason', ARGV[9], 'noted', cjson.encode({v, ARGV[8], ARGV[9]}))
redis.pcall('PUBLISH', ARGV[5], v) -- refused (an ACL user without the channel): the polls follow it
return {v, repaired}
"""


def _attribution(raw: dict[str, str]) -> dict[str, str | None]:
    """The ``actor`` and ``reason`` of the stored version. A release before ``a3b028d`` (before the
    actor and reason travelled in Redis) writes a change without them, which left the previous
    change's in place: in a mixed fleet its change was audited by this release's balancers under
    the previous change's actor and reason (h-upgrade). This release also writes ``noted``
    (``[version, actor, reason]``): fields still equal to a ``noted`` of an older version were left
    by such a writer, and count as not given. (A writer from ``a3b028d`` to before ``noted`` rewrites
    them: when it repeats the previous actor and reason exactly, they are dropped too.)"""
    actor, reason = raw.get("actor") or None, raw.get("reason") or None
    try:
        version, noted_actor, noted_reason = strict_json.loads(raw["noted"])
    except (KeyError, TypeError, ValueError, RecursionError):
        return {"actor": actor, "reason": reason}  # never written by this release: as stored
    unchanged = (noted_actor or None, noted_reason or None) == (actor, reason)
    left = str(version) != raw.get("version") and unchanged
    return {"actor": None, "reason": None} if left else {"actor": actor, "reason": reason}


class PolicySync:
    """Keeps one balancer's :class:`PolicyControl` and the fleet's policy in Redis equal."""

    def __init__(
        self,
        client: RedisClient,
        control: PolicyControl,
        *,
        key_prefix: str,
        poll_s: float,
        metrics: Metrics,
        on_redis: Callable[[BaseException | None], None] = lambda error: None,
        monotonic: Callable[[], float] = time.monotonic,
        audit: AuditLog | None = None,
    ) -> None:
        """``client`` must decode responses. A change adopted from Redis is added to ``audit``. A
        policy in Redis that cannot be read (a corrupt hash, another type at its key, out-of-range
        weights) is ignored and logged once, then once a minute with the count
        (``kvlb_log_suppressed_total{cause="policy_invalid"}``), however often it is polled; Redis
        errors likewise (``cause="policy_redis_error"``)."""
        self.client = client
        self.control = control
        self.key = f"{key_prefix}:policy"
        self.channel = f"{key_prefix}:policy:changed"
        self.poll_s = poll_s
        self._metrics = metrics
        self._on_redis = on_redis
        self.audit = audit
        self._write = client.register_script(_WRITE)
        self._writes = 0
        """Local commits started: a read taken before one is not adopted (it may predate it)."""
        self._writing = 0
        self._synced = False
        """Whether a policy was read from Redis yet: what the first read adopts replaces the
        configured one, and may span several versions."""
        self._lock = asyncio.Lock()
        self._warnings = LimitedWarnings(
            log, metrics.log_suppressed_total, clock=monotonic, forgotten=metrics.log_causes_forgotten_total
        )
        control.committer = self.commit

    @property
    def synced(self) -> bool:
        """Whether this balancer has read (or seeded) the fleet's policy in Redis yet."""
        return self._synced

    # ------------------------------------------------------------------ local → Redis

    async def commit(self, view: PolicyView) -> PolicyView:
        """Store a change made through this balancer's admin API for the whole fleet, before it is
        applied here (``PolicyControl.committer``); returns it with the fleet's version. Raises
        :class:`PolicyCommitError` when Redis did not take it: then it is applied nowhere."""
        self._writes += 1
        self._writing += 1
        try:
            async with self._lock:  # one write at a time: the fleet sees the changes in order
                version = await self._store(view, seed=False)
        except REDIS_ERRORS as exc:
            self._failed(exc)
            raise PolicyCommitError(not_stored("policy", exc)) from exc
        finally:
            self._writing -= 1
        self._on_redis(None)
        self._metrics.redis_policy_updates_total.labels("local").inc()
        log.info("policy v%d written to Redis", version)
        return _with_version(view, version)

    async def _store(self, view: PolicyView, *, seed: bool) -> int:
        args: list[Any] = [view.name, strict_json.dumps(view.weights.to_dict()), view.updated_by]
        args += [repr(view.updated_at_wall), self.channel, view.version if seed else "", view.version]
        args += [view.actor or "", view.reason or ""]
        version, repaired = cast("list[int]", await self._write(keys=[self.key], args=args))
        if repaired:
            self._metrics.redis_wrongtype_keys_total.inc()
            log.warning("policy key %s held garbage: rewritten with this balancer's policy", self.key)
        return int(version)

    # ------------------------------------------------------------------ Redis → local

    async def sync(self) -> None:
        """Adopt the stored policy, or seed Redis with ours when it has none. Redis counts as working
        again only once the whole sync did, the seed's write included: a server that answers reads
        and refuses writes (a read-only replica given as the URL, ``maxmemory`` with
        ``noeviction``) logged its refusal at every retry until 2026-12-01, its read having
        "resolved" it in between."""
        await self._sync()
        self._on_redis(None)
        self._warnings.resolved("policy_redis_error", "")

    async def _sync(self) -> None:
        writes = self._writes
        raw = await read_hash(self.client, self.key)  # {} for garbage: the seed repairs it with ours
        if not raw.get("version") or not raw["version"].isdigit():
            if await self._store(self.control.view, seed=True) >= 0:
                self._synced = True  # ours is the fleet's: later adoptions are changes
                log.info("policy v%d seeded into Redis", self.control.view.version)
            return
        if self._writing or writes != self._writes:
            return  # a local change is on its way or was made meanwhile: the next poll reads it back
        try:
            view = PolicyView(
                name=raw["name"],
                weights=PolicyWeights.from_dict(strict_json.loads(raw["weights"])),
                version=int(raw["version"]),
                updated_by=raw.get("updated_by", "?"),
                updated_at_wall=float(raw.get("updated_at", "0")),
                **_attribution(raw),
            )
            before, first = self.control.view, not self._synced
            self._synced = True
            adopted = self.control.adopt(view)
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            self._invalid(f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError) else str(exc))
            return
        self._warnings.resolved("policy_invalid", "")
        if adopted:
            self._metrics.redis_policy_updates_total.labels("remote").inc()
            log.info("policy v%d adopted from Redis (set by %s)", view.version, view.updated_by)
            self._audit_adopted(before, view, first)

    async def run(self, stop: asyncio.Event) -> None:
        """Listen for change messages and check every ``poll_s`` until ``stop`` is set."""
        await follow_channel(self.client, self.channel, self.poll_s, self.sync, self._failed, stop)

    def _audit_adopted(self, before: PolicyView, view: PolicyView, first: bool) -> None:
        """Keep a change another balancer made in this one's audit log too, with its actor, reason
        and caller (as stored in Redis) and what changed here (over every version missed)."""
        changes = differences(before.name, before.weights, view.name, view.weights)
        if self.audit is None or not changes:
            return
        skipped = ""
        if first or view.version != before.version + 1:  # one entry for several versions
            skipped = f", v{before.version} to v{view.version} at once: actor and reason of v{view.version}"
        self.audit.add(
            AuditEntry(
                wall_ts=view.updated_at_wall,
                actor=view.actor or DEFAULT_ACTOR,
                caller=f"{view.updated_by} (through Redis{skipped})",
                reason=view.reason,
                version=view.version,
                before={k: old for k, (old, _) in changes.items()},
                after={k: new for k, (_, new) in changes.items()},
            )
        )

    def _invalid(self, reason: str) -> None:
        self._warnings.warning("policy_invalid", "", "ignoring the policy stored in Redis: %s", reason)

    def _failed(self, exc: BaseException) -> None:
        self._on_redis(exc)
        self._metrics.redis_errors_total.labels("policy").inc()
        self._warnings.warning("policy_redis_error", "", "policy sync: redis error: %s", exc)

    async def aclose(self) -> None:
        if self.control.committer == self.commit:
            self.control.committer = None


def _with_version(view: PolicyView, version: int) -> PolicyView:
    return dataclasses.replace(view, version=version)
