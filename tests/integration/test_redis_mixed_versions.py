"""A rolling upgrade (and a rollback): balancers of the previous release share a real private
``redis-server`` with this one. The previous release's writes are made here with redis-py, in the
shapes it wrote (``docs/operations.md``, "Upgrades"), and this release's balancers must read them
as that release meant them; what this release writes must keep what the previous one reads.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis
from kvlb_harness import shared_deepseek, wait_for
from redis_cluster import RedisTarget
from redis_server import RedisServer
from test_redis_fleet import fleet, fleet_of

from balancer import strict_json
from balancer.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.redis


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def test_a_drain_written_by_the_previous_release_keeps_its_note(
    redis_server: RedisServer, tokenizer: Tokenizer
) -> None:
    """Before ``732957c`` (e.g. ``9963daf``) a drain entry is ``{"by": <caller>, "at": <Unix s>}``;
    today's is ``{"by", "caller", "at_wall_ts", "reason"}``. In a mixed fleet (h-upgrade walk) the
    new balancers drained a replica drained through an old one but showed no note at all: who
    drained it and when were lost. They now read it as the note they write for the same call (no
    actor: ``admin``). The old release reads an entry's presence only, so today's entries drain
    there."""
    async with fleet(RedisTarget("server", redis_server.url), tokenizer, balancers=1) as f:
        (a,) = f.balancers
        prefix = fleet_of(a).config.key_prefix
        redis = aioredis.Redis.from_url(redis_server.url, decode_responses=True)

        async def notes() -> dict[str, Any]:
            views = (await f.get(a, "/admin/replicas"))["replicas"]
            return {v["id"]: (v["health"]["draining"], v["health"]["drain"]) for v in views}

        try:
            # what a balancer of the previous release writes for POST /admin/replicas/r1/drain,
            # and for a drain it wrote back after Redis lost its data (no note: {})
            old_entry = {"by": "token:1a2b3c4d@10.0.0.7", "at": 1796000000.5}
            await redis.hset(f"{prefix}:drained", mapping={"r1": strict_json.dumps(old_entry), "r2": "{}"})
            await redis.publish(f"{prefix}:drained:changed", "r1")

            async def drained() -> bool:
                seen = await notes()
                return seen["r1"][0] and seen["r2"][0]

            await wait_for("the old release's drains to apply", drained, timeout_s=3)
            seen = await notes()
            by, caller, at = seen["r1"][1]["by"], seen["r1"][1]["caller"], seen["r1"][1]["at_wall_ts"]
            assert (by, caller, at, seen["r1"][1]["reason"]) == (
                "admin",
                "token:1a2b3c4d@10.0.0.7",
                1796000000.5,
                None,
            ), seen["r1"]
            assert seen["r2"] == (True, None)
            assert seen["r0"] == (False, None)

            # the other way: a drain through this release is an entry of the hash (all the previous
            # release asks of it), and an undrain through the previous release (HDEL) undrains here
            headers = {"x-kvlb-actor": "alice"}
            async with f.session.post(a.url + "/admin/replicas/r0/drain", headers=headers) as sent:
                assert sent.status == 200, await sent.text()
            stored = await redis.hgetall(f"{prefix}:drained")
            assert {"", "r0", "r1", "r2"} == set(stored)
            assert strict_json.loads(stored["r0"])["by"] == "alice"
            await redis.hdel(f"{prefix}:drained", "r1")
            await redis.publish(f"{prefix}:drained:changed", "r1")

            async def r1_undrained() -> bool:
                return not (await notes())["r1"][0]

            await wait_for("the old release's undrain to apply", r1_undrained, timeout_s=3)
        finally:
            await redis.aclose()


async def test_a_policy_change_by_a_release_without_actors_is_not_audited_under_the_previous_one(
    redis_server: RedisServer, tokenizer: Tokenizer
) -> None:
    """A release before ``a3b028d`` (e.g. ``a735704``) writes a policy change without ``actor`` and
    ``reason``; Redis kept the previous change's, and this release's balancers audited the old
    balancer's change under them (h-upgrade walk: a change through the old one was logged as
    ``alice``'s "long answers"). Now it is audited with no actor (``admin``) and no reason, while a
    change by a release that writes them keeps its own."""
    async with fleet(RedisTarget("server", redis_server.url), tokenizer, balancers=1) as f:
        (a,) = f.balancers
        prefix = fleet_of(a).config.key_prefix
        key = f"{prefix}:policy"
        redis = aioredis.Redis.from_url(redis_server.url, decode_responses=True)

        async def synced() -> bool:
            return fleet_of(a).policy.synced  # type: ignore[union-attr]

        async def old_write(decode_weight: float, **attribution: str) -> int:
            """A change as a previous release's policy script writes it (HINCRBY, then HSET)."""
            stored = strict_json.loads(await redis.hget(key, "weights") or "{}")
            version = int(await redis.hincrby(key, "version", 1))
            fields = {
                "name": "cost",
                "weights": strict_json.dumps({**stored, "decode_weight": decode_weight}),
            }
            fields |= {"updated_by": "anonymous@10.0.0.9", "updated_at": "1796000000.0", **attribution}
            await redis.hset(key, mapping=fields)
            await redis.publish(f"{prefix}:policy:changed", str(version))
            return version

        async def audited(version: int) -> dict[str, Any]:
            async def there() -> bool:
                entries = (await f.get(a, "/admin/audit"))["entries"]
                return any(e["version"] == version for e in entries)

            await wait_for(f"v{version} in the audit log", there, timeout_s=3)
            entries = (await f.get(a, "/admin/audit"))["entries"]
            return next(e for e in entries if e["version"] == version)

        try:
            await wait_for("the balancer to read the fleet's policy", synced)
            headers = {"x-kvlb-actor": "alice"}
            body = {"weights": {"decode_weight": 0.3}, "reason": "long answers"}
            async with f.session.put(a.url + "/admin/policy", json=body, headers=headers) as response:
                assert response.status == 200, await response.text()

            # a735704's script: no actor, no reason (Redis keeps alice's)
            entry = await audited(await old_write(0.4))
            assert (entry["actor"], entry["reason"]) == ("admin", None), entry
            assert entry["change"] == {"before": {"decode_weight": 0.3}, "after": {"decode_weight": 0.4}}

            # 9963daf's script: its own actor and reason
            entry = await audited(await old_write(0.5, actor="carol", reason="rollback test"))
            assert (entry["actor"], entry["reason"]) == ("carol", "rollback test"), entry

            # and this release's own change after both: its own
            body = {"weights": {"decode_weight": 0.6}, "reason": "back"}
            async with f.session.put(a.url + "/admin/policy", json=body, headers=headers) as response:
                assert response.status == 200, await response.text()
                version = (await response.json())["version"]
            assert (await redis.hget(key, "actor"), await redis.hget(key, "reason")) == ("alice", "back")
            assert strict_json.loads(await redis.hget(key, "noted") or "null") == [version, "alice", "back"]
        finally:
            await redis.aclose()
