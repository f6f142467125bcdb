"""What the fleet tells an operator about the Redis they run: whether it may evict kvlb's keys (its
``maxmemory-policy``: pure :func:`eviction_risk`; :func:`read_policies` is one ``INFO memory``, I/O),
what ``/readyz`` says of a failing Redis (pure :func:`redis_trouble`), whether ``redis.tls_ca_file``
loads (:func:`check_tls_ca_file`, reads the file), and whether the server has ``redis.url``'s
database (:func:`check_database`, at start: one ``PING``, and ``CONFIG GET databases`` on database 0
when it has not).

kvlb bounds its index itself (``limits.index_capacity_blocks``) and needs Redis to refuse writes when
full (``noeviction``), never to drop keys: a Redis that evicts removes, from the coldest first, index
keys (the mirrors, fed by the stream, still hold them), and under any policy eventually the keys that
fence and order the writers (generations, positions, entry counters, leases; the ``volatile-*``
policies evict exactly the leases, which carry a TTL). kvlb then recovers as after a data loss
(docs/redis-fleet.md, "Redis outage"), again and again. The runtime checks the policy at start and
every minute and says so in the log and in ``/readyz``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

from redis.exceptions import AuthenticationError, RedisClusterException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from balancer.config import RedisConfig
from balancer.errors import ConfigError
from balancer.index.redis.client import REDIS_ERRORS, RedisClient, connect

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


DATABASE_REFUSED = "DB index is out of range"
"""Redis's answer to ``SELECT`` of a database it does not have (its ``databases`` setting, 16 by
default, counts them from 0)."""


def url_database(url: str) -> int:
    """The database a ``redis://`` URL names, as redis-py reads it: the path (``/3``), else a
    ``db`` query argument, else 0 (the settings' rules refuse a path that is no number)."""
    parts = urlsplit(url)
    path = parts.path.strip("/")
    if path.isdigit():
        return int(path)
    given = parse_qs(parts.query).get("db", [""])[0]
    return int(given) if given.isdigit() else 0


def database_refused(error: BaseException | None) -> bool:
    """Whether ``error`` is the server's refusal of the URL's database (every call fails with it)."""
    return error is not None and DATABASE_REFUSED in str(error)


def database_missing(database: int, count: int | None) -> str:
    """The one line for a database the server does not have, naming the setting and, when it could be
    read, how many the server has."""
    has = (
        f"the server has {count} (0..{count - 1}; its `databases` setting)"
        if count is not None and count > 0
        else "how many the server has could not be read (CONFIG GET databases refused)"
    )
    return f"redis.url: database {database} is not on the server ({DATABASE_REFUSED}): {has}"


def redis_trouble(error: BaseException | None, database: int = 0) -> str:
    """What ``/readyz`` says of a failing Redis: ``redis unreachable`` when it cannot be reached or
    does not answer in time (a cluster client with no node answering included), ``redis refuses
    kvlb's calls (<its answer>)`` when it answers with an error (a wrong password, an ACL without a
    command, out of memory with ``noeviction``, a read-only replica given as the URL), which no
    waiting heals; for a server that no longer has ``redis.url``'s ``database`` (restarted with a
    lower ``databases``: checked at start, :func:`check_database`) the refusal names it. Until
    2026-12-01 all of them read ``redis unreachable``. A server's answer names no password."""
    unreachable = (RedisConnectionError, RedisTimeoutError, OSError, RedisClusterException)  # no node answers
    if error is None or (isinstance(error, unreachable) and not isinstance(error, AuthenticationError)):
        return "redis unreachable"
    if database_refused(error):
        return f"redis refuses kvlb's calls (redis.url: database {database} is not on the server)"
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


_CHECK_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *REDIS_ERRORS)
"""What a start-up check's call may fail with: no answer in time, or any Redis failure."""


async def check_database(config: RedisConfig) -> None:
    """Raise :class:`ConfigError` (:func:`database_missing`) when the server at ``redis.url`` refuses
    its database; every other outcome (it answers; unreachable or no answer within
    ``redis.socket_timeout_s``, which the balancer waits out as before; another refusal, said at run
    time) returns. One ``PING`` on a connection of its own, only for a URL of a database other than
    0 on one server (a cluster has only database 0, the rules see to it). ``kvlb serve`` checks at
    the start of each balancer and, with ``--workers N``, in the supervisor before the workers
    start. Until 2026-12-01 the refusal was found at run time only: logged once per component, the
    mirrors never warm, ``/readyz`` not ready."""
    if config.url is None or config.cluster:
        return
    database = url_database(config.url)
    if database == 0:
        return
    try:
        await _call(config, config.url, lambda client: client.ping())
    except _CHECK_ERRORS as exc:
        if not database_refused(exc):
            return
    else:
        return
    raise ConfigError(database_missing(database, await _database_count(config)))


async def _call(config: RedisConfig, url: str, call: Callable[[RedisClient], Awaitable[Any]]) -> Any:
    """``call`` on a client of its own for ``url`` (closed after), within ``redis.socket_timeout_s``."""
    client = connect(
        url,
        decode=True,
        socket_timeout_s=config.socket_timeout_s,
        connect_timeout_s=config.socket_timeout_s,
        tls_ca_file=config.tls_ca_file,
    )
    try:
        return await asyncio.wait_for(call(client), config.socket_timeout_s)
    finally:
        await client.aclose()


async def _database_count(config: RedisConfig) -> int | None:
    """The server's ``databases``, read on database 0 of the same URL (``None``: refused or no
    answer in time, an ACL without ``CONFIG`` or a managed service)."""
    assert config.url is not None
    parts = urlsplit(config.url)
    query = "&".join(p for p in parts.query.split("&") if p and not p.startswith("db="))
    url = urlunsplit((parts.scheme, parts.netloc, "/0", query, parts.fragment))
    try:
        answer = await _call(config, url, lambda client: client.config_get("databases"))
    except _CHECK_ERRORS:
        return None
    count = str(answer.get("databases", ""))
    return int(count) if count.isdigit() else None
