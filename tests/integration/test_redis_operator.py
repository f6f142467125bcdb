"""What a Redis operator does to the Redis a fleet shares, on a real private ``redis-server``: ACL users
(docs/redis-fleet.md, "Redis users and ACLs"), a replica given as the URL, a ``FLUSHALL``, a TLS CA
file that cannot be used.

The ACL and replica tests start their own servers (their users and roles stay there) and stop them by
PID; the others use the session's server. The balancers are real
:class:`~balancer.app.Balancer` s in front of a fake replica that only answers ``/health``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import redis.asyncio as aioredis
from kvlb_harness import balancer_over, completion_replica, wait_for
from redis_server import RedisServer, fresh_settings, start_server

from balancer.app import Balancer
from balancer.errors import ConfigError
from balancer.events import Removed
from balancer.index.hashing import BlockHasher
from balancer.index.redis.index import RedisIndex
from balancer.index.redis.mirror import Mirror, MirrorSettings
from balancer.types import EngineHash, ReplicaId

pytestmark = pytest.mark.redis

FAST = {"lease_ttl_s": 1.5, "tick_s": 0.25, "policy_poll_s": 0.25}


async def _unused(request: Any) -> Any:
    raise AssertionError("no completion is sent in these tests")


async def _json(session: aiohttp.ClientSession, balancer: Balancer, path: str) -> Any:
    async with session.get(balancer.url + path) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_an_acl_user_without_channels_changes_policy_and_drains(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A user granted kvlb's keys and every command but no channel (Redis 7 grants none by default):
    a policy change and a drain are stored, answered 200 and reach the other balancer by its polls;
    the refused channel is logged once per channel and balancer, and Redis is not shown as failing.
    Before 2026-12-01 the scripts' PUBLISH failed after the write: a 503 saying "Redis did not store
    it" for a change every balancer then adopted, and each sync logged the refusal every poll."""
    caplog.set_level(logging.WARNING)
    server = start_server()
    try:
        with redis.Redis(host="127.0.0.1", port=server.port) as admin:
            admin.execute_command("ACL", "SETUSER", "kvlb", "on", ">pw", "~kvlb:*", "+@all")
        url = f"redis://kvlb:pw@127.0.0.1:{server.port}/0"
        async with (
            completion_replica(_unused) as replica_url,
            balancer_over(replica_url, redis={"url": url, **FAST}) as (one, session),
            balancer_over(replica_url, redis={"url": url, **FAST}) as (two, _),
        ):
            body = {"name": "cost", "weights": {"overlap_credit": 2.0}}
            async with session.put(one.url + "/admin/policy", json=body) as response:
                assert response.status == 200, await response.text()
            async with session.post(one.url + "/admin/replicas/r0/drain") as response:
                assert response.status == 200, await response.text()

            async def followed() -> bool:
                policy = await _json(session, two, "/admin/policy")
                replicas = (await _json(session, two, "/admin/replicas"))["replicas"]
                return bool(policy["weights"]["overlap_credit"] == 2.0 and replicas[0]["health"]["draining"])

            await wait_for("the other balancer follows by polling", followed, timeout_s=3.0)
            await asyncio.sleep(1.0)  # 4 polls more
            for balancer in (one, two):
                assert balancer.fleet is not None and not balancer.fleet.redis_down()
                assert balancer.fleet.degraded() == []
        refusals = [r.getMessage() for r in caplog.records if "channel" in r.getMessage()]
        assert len(refusals) == 4, refusals  # 2 channels (policy, drains) x 2 balancers, once each
        assert all("following it by polling" in line for line in refusals), refusals
    finally:
        server.stop()


async def test_channels_granted_while_a_balancer_polls_are_followed_without_a_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A balancer whose ACL user has no channel follows the policy and drains by polling; once the
    operator grants the channels (``ACL SETUSER kvlb &kvlb:*``) it subscribes within
    ``RESUBSCRIBE_POLLS`` polls (2 s at 0.1 s a poll): the server counts its subscriptions, and one
    INFO line per channel says so. Until 2026-12-01 (h-smallfollow) only a restart subscribed."""
    caplog.set_level(logging.INFO, logger="balancer.index.redis.client")
    server = start_server()
    channels = ("kvlb:policy:changed", "kvlb:drained:changed")
    try:
        with redis.Redis(host="127.0.0.1", port=server.port, decode_responses=True) as admin:
            admin.execute_command("ACL", "SETUSER", "kvlb", "on", ">pw", "~kvlb:*", "+@all")
            url = f"redis://kvlb:pw@127.0.0.1:{server.port}/0"

            def subscribers() -> list[int]:
                return [int(count) for _, count in admin.pubsub_numsub(*channels)]

            async with (
                completion_replica(_unused) as replica_url,
                balancer_over(replica_url, redis={"url": url, **FAST, "policy_poll_s": 0.1}) as (one, _),
            ):
                await asyncio.sleep(1.0)  # 10 polls: refused, polling
                assert subscribers() == [0, 0]
                admin.execute_command("ACL", "SETUSER", "kvlb", "&kvlb:*")

                async def subscribed() -> bool:
                    return subscribers() == [1, 1]

                await wait_for("the balancer subscribes to both channels", subscribed, timeout_s=8.0)
                assert one.fleet is not None and not one.fleet.redis_down()
        lines = [r.getMessage() for r in caplog.records]
        for channel in channels:
            assert sum(line.startswith(f"redis refuses channel {channel} ") for line in lines) == 1, lines
            assert lines.count(f"redis grants channel {channel} now: following it at once") == 1, lines
    finally:
        server.stop()


async def test_a_database_gone_after_start_is_named_in_readyz() -> None:
    """The server restarted with fewer databases (``--databases 4``, then 2) under a balancer of
    database 3: ``/readyz`` names ``redis.url``'s database (a balancer started against it refuses
    to start: tests/e2e/test_serve_redis_database.py). Before 2026-12-01 (h-smallfollow) it quoted
    the bare ``DB index is out of range``."""
    server = start_server(extra_args=["--databases", "4"])
    try:
        url = f"redis://127.0.0.1:{server.port}/3"
        async with (
            completion_replica(_unused) as replica_url,
            balancer_over(replica_url, redis={"url": url, **FAST}) as (balancer, session),
        ):
            assert (await _json(session, balancer, "/readyz")).get("degraded", []) == []
            port = server.port
            server.stop()
            server = start_server(port=port, extra_args=["--databases", "2"])
            named = "redis refuses kvlb's calls (redis.url: database 3 is not on the server)"

            async def said() -> bool:
                ready = await _json(session, balancer, "/readyz")  # 200: ready on its mirrors
                return any(reason.startswith(named) for reason in ready.get("degraded", []))

            await wait_for("/readyz names the database", said, timeout_s=8.0)
    finally:
        server.stop()


async def test_a_read_only_replica_as_the_url_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A replica of the fleet's Redis given as ``redis.url`` by mistake answers reads and refuses
    every write (``READONLY``): the balancer stays ready on its mirrors, ``/readyz`` quotes the
    refusal (until 2026-12-01 it said "redis unreachable", as for any failure), and each
    component logs the refusal once while it lasts (retrying with backoff). Before 2026-12-01 the
    policy and drain syncs' read "resolved" their warning before their seed's write failed again:
    a line at every retry (4 each in these 2.5 s)."""
    caplog.set_level(logging.WARNING)
    primary, replica = start_server(), start_server()
    try:
        with redis.Redis(host="127.0.0.1", port=replica.port) as client:
            client.execute_command("REPLICAOF", "127.0.0.1", str(primary.port))
        async with (
            completion_replica(_unused) as replica_url,
            balancer_over(replica_url, redis={"url": replica.url, **FAST}) as (balancer, session),
        ):
            await asyncio.sleep(2.5)
            assert balancer.fleet is not None and balancer.fleet.redis_down()
            ready = await _json(session, balancer, "/readyz")  # 200: ready on its mirrors
            refusal = "redis refuses kvlb's calls (You can't write against a read only replica"
            assert [r for r in ready["degraded"] if r.startswith(refusal)], ready  # not "unreachable"
        for sync in ("policy sync", "drain sync"):
            lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(sync)]
            assert len(lines) == 1, lines
            assert "read only replica" in lines[0]
    finally:
        replica.stop()
        primary.stop()


async def test_a_flushed_stream_is_named_as_lost_not_as_negative_missing_entries(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's ``FLUSHALL`` (or a restart without persistence) restarts a key space's entry
    numbers at 1: the mirror rebuilds from what Redis holds and says so. Before 2026-12-01 it logged
    ``entries 4..0 missing``."""
    caplog.set_level(logging.WARNING, logger="balancer.index.redis.mirror")
    text = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        settings = fresh_settings()
        hasher = BlockHasher("flush-test", 4)
        writer = RedisIndex(text, hasher, settings)
        mirror = Mirror(raw, hasher, settings, time.monotonic, MirrorSettings(block_ms=50))
        await mirror.warm_start()
        replica = ReplicaId("a")
        for i in range(3):
            await writer.apply(replica, [Removed(0, (EngineHash(i),))], 0.0)
        assert await mirror.poll(block_ms=10) == 3
        # A stream flushed within the millisecond of its last entry restarts at IDs at or below the
        # ones the mirror read (18 of 50 tries back to back), and XREAD skips those; a later entry
        # then shows the numbers went back. Here the next entry must show it.
        await asyncio.sleep(0.01)
        await text.flushall()
        await writer.apply(replica, [Removed(0, (EngineHash(9),))], 0.0)
        await mirror.poll(block_ms=10)
        assert (mirror.counters.resyncs, mirror.last_number, mirror.partial) == (1, 1, False)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "entry numbers went back (1 after 3): Redis lost the stream" in lines[0]
    finally:
        await text.aclose()
        await raw.aclose()


@pytest.mark.parametrize("ca", ["absent.crt", "not-a-cert.crt"])
async def test_an_unusable_tls_ca_file_stops_the_start(tmp_path: Path, ca: str) -> None:
    """``redis.tls_ca_file`` absent or holding no certificate: the start stops with a configuration
    error naming the setting (``kvlb serve`` exits 2 with that line). Before 2026-12-01 the balancer
    started, logged ``Error 2 connecting to host:port. No such file or directory.`` (a Redis that
    looked unreachable) and was never ready."""
    (tmp_path / "not-a-cert.crt").write_text("not a certificate\n")
    redis_settings = {"url": "rediss://:pw@127.0.0.1:1/0", "tls_ca_file": str(tmp_path / ca)}
    with pytest.raises(ConfigError, match=r"redis.tls_ca_file '.*' is not a usable CA bundle"):
        async with asyncio.timeout(10):
            async with completion_replica(_unused) as url, balancer_over(url, redis=redis_settings):
                pass


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
async def test_a_redis_that_evicts_is_named_in_readyz_and_logged_once(
    caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    """A Redis whose ``maxmemory-policy`` evicts (``allkeys-*`` anything, ``volatile-*`` the leases):
    ``/readyz`` says so under ``degraded`` (ready: routing is unaffected until keys go) and the log
    says it once. Before 2026-12-01 nothing did until keys were gone: generations read 0, entry
    numbers went back, leases were lost."""
    caplog.set_level(logging.WARNING, logger="balancer.fleet.runtime")
    server = start_server()
    try:
        with redis.Redis(host="127.0.0.1", port=server.port) as admin:
            admin.config_set("maxmemory-policy", policy)
        async with (
            completion_replica(_unused) as replica_url,
            balancer_over(replica_url, redis={"url": server.url, **FAST}) as (balancer, session),
        ):

            async def named() -> bool:
                ready = await _json(session, balancer, "/readyz")
                return any(f"redis maxmemory-policy {policy}" in r for r in ready.get("degraded", []))

            await wait_for("the eviction policy in /readyz", named)
            await asyncio.sleep(1.0)  # 4 ticks more
        lines = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
        assert len(lines) == 1 and "set noeviction" in lines[0], lines
    finally:
        server.stop()


async def test_a_redis_that_does_not_evict_is_not_named(redis_server: RedisServer) -> None:
    async with (
        completion_replica(_unused) as replica_url,
        balancer_over(replica_url, redis={"url": redis_server.url, **FAST}) as (balancer, session),
    ):
        await asyncio.sleep(0.5)
        assert "degraded" not in await _json(session, balancer, "/readyz")


async def test_a_redis_out_of_memory_stays_degraded_while_reads_work() -> None:
    """``maxmemory`` reached with ``noeviction``: Redis refuses every write (the lease manager's
    heartbeat) and answers every read (the policy and drain syncs' polls). ``/readyz`` lists the
    refusal at every look, and the balancer stays ready. Before 2026-12-01 one "last call wins"
    verdict let each read that worked clear it: degraded in 5 of 20 looks on the walk's fleet."""
    server = start_server()
    try:
        async with (
            completion_replica(_unused) as replica_url,
            balancer_over(replica_url, redis={"url": server.url, **FAST}) as (balancer, session),
        ):
            fleet = balancer.fleet
            assert fleet is not None and fleet.policy is not None and fleet.drains is not None

            async def seeded() -> bool:  # the policy and the drains are in Redis: the syncs only read
                with redis.Redis(host="127.0.0.1", port=server.port) as client:
                    return bool(
                        fleet.policy is not None and fleet.policy.synced and client.exists("kvlb:drained")
                    )

            await wait_for("the policy and drains seeded", seeded)
            await asyncio.sleep(0.5)
            with redis.Redis(host="127.0.0.1", port=server.port) as admin:
                admin.config_set("maxmemory", 1)  # below what it uses: every write is refused
            await asyncio.sleep(0.5)  # two ticks of the lease manager
            looks = []
            for _ in range(25):
                ready = await _json(session, balancer, "/readyz")
                looks.append(any("maxmemory" in reason for reason in ready.get("degraded", [])))
                await asyncio.sleep(0.08)
            assert all(looks), f"degraded in {sum(looks)} of {len(looks)} looks"
    finally:
        server.stop()
