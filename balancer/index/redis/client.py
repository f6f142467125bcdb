"""The Redis clients kvlb talks through, the errors that mean "Redis did not do it", and what the fleet's
policy and drains share: the read of their HASH (:func:`read_hash`) and the loop that follows their
change channel (:func:`follow_channel`) (I/O).

Two topologies (``docs/redis-fleet.md``, "Topologies"):

* **One server** (or a managed endpoint that looks like one): :class:`redis.asyncio.Redis`.
* **Redis Cluster** (``redis.cluster: true``): :class:`FailoverSafeCluster`, a
  :class:`redis.asyncio.cluster.RedisCluster`. The URL
  names a seed node; the client reads the slot table from it (``CLUSTER SLOTS``), sends each
  command to the master of its key's slot, follows ``MOVED`` (slot moved: table patched, then
  reloaded) and ``ASK`` (slot migrating), and after a connection error, a timeout or
  ``CLUSTERDOWN`` reloads the table from the nodes it knows before retrying (a few times, at
  once). A failover therefore shows up as a short burst of errors; every kvlb component already
  retries Redis errors with its own bounded backoff, and the first call after the promotion goes
  to the new master.

Every key kvlb touches in one call shares one slot (the ``{pool}`` hash tag, or a single fleet-wide
key), so both clients run the same commands and scripts.

:data:`REDIS_ERRORS` is what callers catch as "Redis unavailable": the cluster client raises some
topology errors (``RedisClusterException``: no reachable node, slot not covered) that are not
``RedisError`` subclasses.

**A redis-py 8.1 race, contained here.** When the cluster client reloads its topology (after a
connection error or ``CLUSTERDOWN``) it disconnects every connection of every node, including
connections another task is using at that moment. That task then fails inside redis-py with
``AttributeError`` (``'NoneType' object has no attribute 'writelines'``) or ``RuntimeError`` (the
transport is closed), not with a Redis error, and a loop catching Redis errors would die (seen
with the mirror in the failover test). :class:`FailoverSafeCluster` turns exactly those two, raised
from inside a cluster call, a pipeline or a pub/sub call, into ``redis.ConnectionError``; the
connection reconnects on its next use.

**Pooled connections that outlive a server restart or its idle ``timeout``.** redis-py's pool checks a
pooled connection when it hands it out (buffered data, or the server's close already seen) and
reconnects it, but not while ``maint_notifications_config`` is its default ``"auto"`` (truthy in
redis-py 8.1), so the first command on a connection the server had closed failed with
``ConnectionError``: after a SIGKILL and restart of ``redis-server`` two of three concurrent calls
failed (a ``health_check_interval`` did not prevent it), and after the server's idle ``timeout``
(managed services set 300 s) a fleet writer's next batch failed once, with a warning, and waited out
its backoff. :func:`connect` turns the notifications off (they need RESP3, which kvlb does not
speak), and the check works again (2026-12-01). :class:`RestartSafeRedis` (the single-server client)
also closes every idle connection of its pool at the first ``ConnectionError``, for connections whose
close the event loop has not seen yet when they are handed out. The cluster client rebuilds its node
connections on such errors already (and retries the call, ``CLUSTER_RETRIES``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias, cast

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, ClusterPubSub, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, RedisClusterException, RedisError, ResponseError
from redis.maint_notifications import MaintNotificationsConfig

log = logging.getLogger(__name__)

_RACES = (AttributeError, RuntimeError)
"""What redis-py raises for a connection closed under a running call (see the module doc)."""


def _reset(exc: BaseException) -> RedisConnectionError:
    return RedisConnectionError(f"cluster connection reset during a topology reload: {exc!r}")


class _SafePipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        try:
            return await super().execute(raise_on_error, allow_redirections)
        except _RACES as exc:
            raise _reset(exc) from exc


class _SafePubSub(ClusterPubSub):
    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except _RACES as exc:
            raise _reset(exc) from exc

    async def get_message(
        self,
        ignore_subscribe_messages: bool = False,
        timeout: float | None = 0.0,  # noqa: ASYNC109 - the signature of redis-py's method
    ) -> dict[str, Any] | None:
        try:
            message: dict[str, Any] | None = await super().get_message(ignore_subscribe_messages, timeout)
        except _RACES as exc:
            raise _reset(exc) from exc
        return message


class FailoverSafeCluster(RedisCluster):
    """A :class:`RedisCluster` whose calls fail with ``ConnectionError`` when redis-py closes their
    connection under them during a topology reload (see the module doc)."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except _RACES as exc:
            raise _reset(exc) from exc

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return _SafePipeline(self, transaction)  # type: ignore[abstract]  # as RedisCluster.pipeline does

    def pubsub(
        self, node: ClusterNode | None = None, host: str | None = None, port: int | None = None, **kwargs: Any
    ) -> ClusterPubSub:
        return _SafePubSub(self, node=node, host=host, port=port, **kwargs)


class _RestartSafePipeline(Pipeline):
    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        try:
            return await super().execute(raise_on_error)
        except RedisConnectionError:
            await self.connection_pool.disconnect(inuse_connections=False)
            raise


class RestartSafeRedis(aioredis.Redis):
    """A single-server client that closes its pool's idle connections at a ``ConnectionError``:
    they may be connections to a server that is gone (see the module doc), which would each fail
    one more call once it is back. Connections in use by other calls are left to fail (and be
    reconnected) on their own."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        try:
            return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
        except RedisConnectionError:
            await self.connection_pool.disconnect(inuse_connections=False)
            raise

    def pipeline(self, transaction: bool = True, shard_hint: Any | None = None) -> Pipeline:
        return _RestartSafePipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


RedisClient: TypeAlias = aioredis.Redis | RedisCluster
"""A single-server or a cluster client; kvlb uses only what both offer."""

REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)
"""Failures of a Redis call that a caller retries (server down, failover, timeout, refusal)."""

CLUSTER_RETRIES = 3
"""Attempts after the first one inside one cluster call, each after reloading the slot table. Few:
with an unreachable host each attempt may wait ``socket_timeout_s``, and the callers retry anyway."""


def connect(
    url: str,
    *,
    cluster: bool = False,
    decode: bool,
    socket_timeout_s: float | None = None,
    connect_timeout_s: float | None = None,
    tls_ca_file: str | None = None,
) -> RedisClient:
    """A pooled client for ``url`` (``redis://`` or ``rediss://``, AUTH in the URL). Connections are
    opened on first use, so this never blocks nor fails on an unreachable server."""
    kwargs: dict[str, Any] = {
        "decode_responses": decode,
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
    }
    if url.startswith("rediss://") and tls_ca_file:
        kwargs["ssl_ca_certs"] = tls_ca_file
    if cluster:
        retry = Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.5), CLUSTER_RETRIES)
        return FailoverSafeCluster.from_url(url, retry=retry, **kwargs)
    # "auto" (redis-py 8.1's default) is truthy, and with it the pool skips its check of a pooled
    # connection at checkout, so one the server closed failed its next call (see the module doc);
    # the notifications need RESP3, which kvlb does not speak
    return RestartSafeRedis.from_url(
        url, maint_notifications_config=MaintNotificationsConfig(enabled=False), **kwargs
    )


async def initialized(client: RedisClient) -> None:
    """Load a cluster client's slot table now if it has none yet (no-op otherwise). Pub/sub on a
    cluster client picks its node from that table and fails on an empty one (redis-py 8.1), so call
    this before ``client.pubsub()``."""
    if isinstance(client, RedisCluster):
        await client.initialize()


async def read_hash(client: RedisClient, key: str) -> dict[str, str]:
    """The HASH at ``key`` (a decoding client), or ``{}`` when it is absent or another type was
    written over it (``WRONGTYPE``: the caller's next write replaces it)."""
    try:
        return cast("dict[str, str]", await cast("Any", client.hgetall(key)))
    except ResponseError as exc:
        if "WRONGTYPE" not in str(exc):
            raise
        return {}


class _ChannelRefused(Exception):
    """The server refused this client the channel (``NOPERM``: an ACL user without it)."""


async def _on_channel(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except NoPermissionError as exc:
        raise _ChannelRefused(str(exc)) from exc


RESUBSCRIBE_POLLS = 20
"""After the server refused a channel, :func:`follow_channel` tries to subscribe again once every
this many polls (10 s at the default ``redis.policy_poll_s`` of 0.5 s): at most one refused
``SUBSCRIBE`` per 20 polls (5 % more calls than the polls alone)."""


async def follow_channel(
    client: RedisClient,
    channel: str,
    poll_s: float,
    sync: Callable[[], Awaitable[None]],
    failed: Callable[[BaseException], None],
    stop: asyncio.Event,
    *,
    on_message: Callable[[], None] = lambda: None,
) -> None:
    """Run ``sync`` at each message on ``channel`` and every ``poll_s`` (a message may be lost:
    pub/sub is fire-and-forget) until ``stop`` is set; ``on_message`` is called before the ``sync``
    of a message. A Redis error goes to ``failed``, then the
    subscription is made again after a backoff (``poll_s`` doubling up to 5 s). A server that refuses
    the channel (an ACL user without ``&<channel>``; Redis 7 grants no channel by default) is no
    Redis failure: it is logged once and ``sync`` runs every ``poll_s`` without a subscription,
    trying to subscribe again every :data:`RESUBSCRIBE_POLLS` polls; once the channel is granted
    the next try subscribes (an INFO line) and messages are followed at once. Until 2026-12-01 the
    refusal came between two ``sync`` calls that worked, so the loop logged it and reconnected
    every ``poll_s``, and showed Redis as failing; and until a later change the same day a refused
    channel was polled until a restart, however long after it was granted."""
    delay_s = poll_s
    subscribe = True
    refused = False
    while not stop.is_set():
        pubsub = None
        try:
            if subscribe:
                await initialized(client)
                pubsub = client.pubsub()
                await _on_channel(pubsub.subscribe(channel))
                if refused:
                    refused = False
                    log.info("redis grants channel %s now: following it at once", channel)
            await sync()
            delay_s = poll_s
            polls = 0
            while not stop.is_set():
                if pubsub is None:
                    if polls >= RESUBSCRIBE_POLLS:
                        subscribe = True
                        break
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), poll_s)
                    polls += 1
                elif await _on_channel(pubsub.get_message(ignore_subscribe_messages=True, timeout=poll_s)):
                    on_message()
                await sync()  # a message or the periodic check
        except _ChannelRefused as exc:
            subscribe = False
            if not refused:
                refused = True
                log.warning(
                    "redis refuses channel %s (%s): following it by polling every %g s instead of at once; "
                    "grant the channel to kvlb's user (ACL &%s): kvlb tries to subscribe again every "
                    "%d polls",
                    channel, exc, poll_s, channel, RESUBSCRIBE_POLLS,
                )  # fmt: skip
        except REDIS_ERRORS as exc:
            failed(exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay_s)
            delay_s = min(5.0, delay_s * 2)
        finally:
            if pubsub is not None:
                with contextlib.suppress(*REDIS_ERRORS):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
