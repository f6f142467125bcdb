"""What a Redis operator does to the Redis a fleet shares, on a real private ``redis-server``: ACL users
(docs/redis-fleet.md, "Redis users and ACLs").

Each test starts its own server (its ACL users stay there) and stops it by PID; the balancers are real
:class:`~balancer.app.Balancer` s in front of a fake replica that only answers ``/health``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
import redis
from kvlb_harness import balancer_over, completion_replica, wait_for
from redis_server import start_server

from balancer.app import Balancer

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
