"""What the fleet tells an operator about the Redis they run: whether it may evict kvlb's keys (its
``maxmemory-policy``: pure :func:`eviction_risk`; :func:`read_policies` is one ``INFO memory``, I/O),
what ``/readyz`` says of a failing Redis (pure :func:`redis_trouble`), and whether ``redis.tls_ca_file``
loads (:func:`check_tls_ca_file`, reads the file).

kvlb bounds its index itself (``limits.index_capacity_blocks``) and needs Redis to refuse writes when
full (``noeviction``), never to drop keys: a Redis that evicts removes, from the coldest first, index
keys (the mirrors, fed by the stream, still hold them), and under any policy eventually the keys that
fence and order the writers (generations, positions, entry counters, leases; the ``volatile-*``
policies evict exactly the leases, which carry a TTL). kvlb then recovers as after a data loss
(docs/redis-fleet.md, "Redis outage"), again and again. The runtime checks the policy at start and
every minute and says so in the log and in ``/readyz``.
"""

from __future__ import annotations

import ssl
from collections.abc import Collection, Mapping
from typing import Any

from redis.exceptions import AuthenticationError, RedisClusterException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from balancer.config import RedisConfig
from balancer.errors import ConfigError
from balancer.index.redis.client import RedisClient

SAFE_POLICY = "noeviction"


def eviction_risk(policies: Collection[str]) -> str | None:
    """The ``/readyz`` reason for evicting policies among ``policies`` (one per server read), or
    ``None`` when every one is ``noeviction`` (or none could be read)."""
    evicting = sorted({p for p in policies if p != SAFE_POLICY})
    if not evicting:
        return None
    return (
        f"redis maxmemory-policy {'/'.join(evicting)}: a full Redis evicts kvlb's keys (leases, positions, "
        "index) instead of refusing writes; set noeviction"
    )


async def read_policies(client: RedisClient) -> set[str]:
    """The ``maxmemory_policy`` of the server (or, for a cluster client, of the node(s) ``INFO`` went
    to); Redis errors propagate."""
    info: Mapping[str, Any] = await client.info("memory")
    if "maxmemory_policy" in info:
        return {str(info["maxmemory_policy"])}
    return {str(node["maxmemory_policy"]) for node in info.values() if isinstance(node, Mapping)}


_REFUSAL_CHARS = 160
"""The longest part of a Redis refusal ``/readyz`` quotes (its text comes from the server)."""


def redis_trouble(error: BaseException | None) -> str:
    """What ``/readyz`` says of a failing Redis: ``redis unreachable`` when it cannot be reached or
    does not answer in time (a cluster client with no node answering included), ``redis refuses
    kvlb's calls (<its answer>)`` when it answers with an error (a wrong password, an ACL without a
    command, out of memory with ``noeviction``, a read-only replica given as the URL), which no
    waiting heals. Until 2026-12-01 all of them read ``redis unreachable``. A server's answer names
    no password."""
    unreachable = (RedisConnectionError, RedisTimeoutError, OSError, RedisClusterException)  # no node answers
    if error is None or (isinstance(error, unreachable) and not isinstance(error, AuthenticationError)):
        return "redis unreachable"
    text = " ".join(str(error).split())
    if len(text) > _REFUSAL_CHARS:
        text = text[: _REFUSAL_CHARS - 1] + "…"
    return f"redis refuses kvlb's calls ({text})"


def check_tls_ca_file(config: RedisConfig) -> None:
    """Raise :class:`ConfigError` when ``redis.tls_ca_file`` cannot be loaded as a CA bundle (absent,
    unreadable, no certificate in it). Until 2026-12-01 this was found only at the first connection,
    as ``Error 2 connecting to host:port. No such file or directory.``: a Redis that looked
    unreachable, and a balancer never ready."""
    if config.tls_ca_file is None:
        return
    try:
        ssl.create_default_context(cafile=config.tls_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"redis.tls_ca_file {config.tls_ca_file!r} is not a usable CA bundle: {exc}"
        ) from None
