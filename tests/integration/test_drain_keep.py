"""A drain belongs to the replica id and outlives the replica's removal by discovery for
``health_drain_keep_s``, the same with and without Redis (2026-12-01, h-drainkeep).

With Redis: real :class:`~balancer.fleet.drain_sync.DrainSync` objects (one per balancer) on a
private ``redis-server``, each over its own :class:`~balancer.health.book.HealthBook` (what its
discovery lists). Without: a real :class:`~balancer.app.Balancer` with file discovery over the
emulator. Before this change, a drain stayed in ``<prefix>:drained`` for ever once the replica was
removed, and in memory it ended with the removal.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import redis.asyncio as aioredis
import yaml
from kvlb_harness import MODEL, replica_entry, settings_for, shared_deepseek, wait_for, wait_ready
from prometheus_client import CollectorRegistry
from redis_server import RedisServer
from test_discovery_app import balancer_over, two_replicas

from balancer import strict_json
from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer._proto.kvlb.v1 import balancer_pb2_grpc as pb_grpc
from balancer.app import Balancer
from balancer.fleet.drain_sync import MAX_PRUNES_PER_SYNC, DrainSync
from balancer.health.book import DrainNote, HealthBook
from balancer.metrics import Metrics
from balancer.serve_options import ServeOptions
from balancer.types import ReplicaId
from replicas.sim.replica import Replica

PREFIX = "dk"
KEY = f"{PREFIX}:drained"
NOTE = DrainNote(by="ops", caller="anonymous@127.0.0.1", at_wall_ts=1_796_000_000.0, reason="node repair")
R1 = ReplicaId("web-1")


class Clock:
    """A wall clock the test moves (the balancers' ``wall_clock``)."""

    def __init__(self) -> None:
        self.now = 1_796_000_100.0

    def __call__(self) -> float:
        return self.now


def balancer(client: Any, clock: Clock, keep_s: float, *listed: ReplicaId) -> DrainSync:
    book = HealthBook(drain_keep_s=keep_s)
    for replica in listed:
        book.add(replica, probe_ok=True, now=0.0)
    metrics = Metrics.create(CollectorRegistry())
    return DrainSync(client, book, key_prefix=PREFIX, poll_s=0.1, metrics=metrics, wall_clock=clock)


async def entry(client: Any, replica: str) -> dict[str, Any] | None:
    raw = await client.hget(KEY, replica)
    return None if raw is None else strict_json.loads(raw)


async def kept_on_both_faces(setup: Any) -> tuple[dict[str, dict[str, Any]], dict[str, pb.KeptDrain]]:
    """The drains kept for removed replicas, by id, as ``GET /admin/replicas`` and gRPC
    ``ListReplicas`` list them (h-fleetfollow2: listed by neither before)."""
    async with setup.session.get(f"{setup.balancer.url}/admin/replicas") as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
    assert answer["kept_drains_total"] == len(answer["kept_drains"])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{setup.balancer.grpc_port}") as channel:
        listed = await pb_grpc.AdminStub(channel).ListReplicas(pb.ListReplicasRequest())
    assert listed.kept_drains_total == len(listed.kept_drains)
    return {k["id"]: k for k in answer["kept_drains"]}, {k.id: k for k in listed.kept_drains}


async def redis_now(client: Any) -> float:
    """Redis's clock (``TIME``), the one the keep time counts on."""
    seconds, micros = await client.time()
    return int(seconds) + int(micros) / 1e6


def remove(sync: DrainSync, replica: ReplicaId, wall: float) -> None:
    """What the service's discovery does to the book when it removes ``replica``."""
    sync.health.remove(replica, now=1.0, wall=wall)


@pytest.mark.redis
async def test_a_removed_replicas_drain_is_kept_while_listed_anywhere_then_pruned(
    redis_server: RedisServer,
) -> None:
    """The keep time counts on Redis's clock (``TIME``), so this test waits it out (1 s)."""
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    clock = Clock()
    keep_s = 1.0
    await client.delete(KEY)
    try:
        a = balancer(client, clock, keep_s, R1)
        b = balancer(client, clock, keep_s, R1)
        await a.sync()  # seeds the hash
        assert await a.commit(R1, NOTE)
        await a.sync()
        await b.sync()
        assert a.health.replicas[R1].draining and b.health.replicas[R1].draining

        # A's discovery removes it: its entry gains the removal time (Redis's); B still lists it, so
        # it stays drained there and B's next sync clears the time
        remove(a, R1, clock.now)
        await a.mark_removed(R1)
        removed_at = await redis_now(client)
        stored = await entry(client, R1)
        assert stored is not None and abs(stored.pop("removed_at_wall_ts") - removed_at) < 1.0
        assert stored == NOTE.to_json()
        await a.sync()
        await b.sync()  # every poll_s (0.5 s by default)
        assert b.health.replicas[R1].draining
        # re-listed: the removal time is cleared (kept as where the drain was kept from)
        stored = await entry(client, R1)
        assert (
            stored is not None
            and "removed_at_wall_ts" not in stored
            and "kept_from_removal_wall_ts" in stored
        )
        await asyncio.sleep(keep_s + 0.2)  # past the keep time since A's removal
        await a.sync()
        assert await entry(client, R1) is not None  # B lists it: A does not prune it

        # B's discovery removes it too; re-added on A within the keep time: drained, and says so
        remove(b, R1, clock.now)
        await b.mark_removed(R1)
        removed_at = float((await entry(client, R1) or {})["removed_at_wall_ts"])
        await a.sync()
        await b.sync()
        assert [kept.replica for kept in a.kept_drains()] == [R1]  # listed nowhere: kept by the fleet
        a.health.add(R1, probe_ok=True, now=2.0)
        await a.sync()
        assert a.kept_drains() == []
        record = a.health.replicas[R1]
        assert record.draining and record.drain == NOTE and record.kept_from_removal_wall_ts == removed_at
        assert (await entry(client, R1)) == {**NOTE.to_json(), "kept_from_removal_wall_ts": removed_at}
        c = balancer(client, clock, keep_s, R1)  # another worker, whose sync comes after A's clearing
        await c.sync()
        assert (
            c.health.replicas[R1].draining and c.health.replicas[R1].kept_from_removal_wall_ts == removed_at
        )

        # removed everywhere, and kept longer than health_drain_keep_s: pruned by a sync
        remove(a, R1, clock.now)
        await a.mark_removed(R1)
        await b.sync()
        assert await entry(client, R1) is not None  # within the keep time
        await asyncio.sleep(keep_s + 0.2)
        await b.sync()
        assert await entry(client, R1) is None
        a.health.add(R1, probe_ok=True, now=2.0)
        await a.sync()
        assert not a.health.replicas[R1].draining
    finally:
        await client.delete(KEY)
        await client.aclose()


@pytest.mark.redis
async def test_older_entries_stay_a_prune_is_bounded_and_an_unlisted_id_can_be_undrained(
    redis_server: RedisServer,
) -> None:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    clock = Clock()
    await client.delete(KEY)
    try:
        a = balancer(client, clock, 60.0)
        await a.sync()
        old = strict_json.dumps({"by": "token:1a2b3c4d@10.0.0.7", "at": 1_795_000_000.5})
        await client.hset(KEY, "old-release", old)  # a release before 732957c wrote it
        await a.mark_removed(ReplicaId("old-release"))
        assert await client.hget(KEY, "old-release") == old  # left as it was: kept until undrained
        expired = {**NOTE.to_json(), "removed_at_wall_ts": await redis_now(client) - 61.0}
        await client.hset(
            KEY, mapping={f"gone-{i}": strict_json.dumps(expired) for i in range(MAX_PRUNES_PER_SYNC + 5)}
        )
        await a.sync()
        assert await client.hlen(KEY) == 1 + 1 + 5  # the marker, the old entry, 5 for the next sync
        await a.sync()
        assert set(await client.hkeys(KEY)) == {"", "old-release"}

        # `kvlb admin undrain` of an id no pool lists: the commit says whether there was an entry
        assert await a.commit(ReplicaId("old-release"), None)
        assert not await a.commit(ReplicaId("never-drained"), None)
        assert set(await client.hkeys(KEY)) == {""}
    finally:
        await client.delete(KEY)
        await client.aclose()


async def test_without_redis_a_drain_outlives_the_removal_and_an_unlisted_id_can_be_undrained(
    tmp_path: Path,
) -> None:
    """Before h-drainkeep, without Redis, a drained replica that discovery removed and added again
    came back undrained (the h-lifecycle2 walk), and ``kvlb admin undrain`` of it answered 404."""
    listed = tmp_path / "replicas.yaml"
    listed.write_text("pools: []\n")
    overrides = {
        "discovery__kind": "file",
        "discovery__file": str(listed),
        "discovery__reload_interval_s": 0.1,
        "listen__grpc_port": 0,
    }

    def write(replicas: list[Replica]) -> None:
        fresh = tmp_path / "replicas.yaml.new"
        entries = [replica_entry(r) for r in replicas]
        fresh.write_text(yaml.safe_dump({"pools": [{"model": MODEL, "replicas": entries}]}))
        fresh.replace(listed)

    async with (
        two_replicas(**overrides) as (static, extra, settings),
        balancer_over(static, extra, settings) as setup,
    ):

        async def r1_listed() -> bool:
            return "r1" in await setup.views()

        async def r1_gone() -> bool:
            return "r1" not in await setup.views()

        write([extra])
        await wait_for("r1 discovered", r1_listed, timeout_s=10)
        url = f"{setup.balancer.url}/admin/replicas/r1"
        async with setup.session.post(f"{url}/drain", json={"reason": "node repair"}) as response:
            assert response.status == 200, await response.text()
        write([])
        await wait_for("r1 removed", r1_gone, timeout_s=10)
        http_kept, grpc_kept = await kept_on_both_faces(setup)
        assert list(http_kept) == ["r1"] and list(grpc_kept) == ["r1"], http_kept
        kept = http_kept["r1"]
        assert kept["source"] == "memory" and kept["drain"]["reason"] == "node repair", kept
        assert kept["text"].startswith("drained (kept from before its removal at "), kept
        keep_s = setup.balancer.settings.health_drain_keep_s
        assert kept["expires_at_wall_ts"] == pytest.approx(kept["removed_at_wall_ts"] + keep_s, abs=1.0)
        assert 0 <= kept["removed_at_age_s"] < 10 and keep_s - 10 < kept["expires_in_s"] <= keep_s, kept
        assert grpc_kept["r1"].text == kept["text"] and grpc_kept["r1"].source == "memory"
        assert grpc_kept["r1"].removed_at_wall_ts == kept["removed_at_wall_ts"]
        assert dict(grpc_kept["r1"].drain)["reason"] == "node repair"
        write([extra])
        await wait_for("r1 discovered again", r1_listed, timeout_s=10)
        assert (await kept_on_both_faces(setup)) == ({}, {})  # listed again: not a kept drain
        r1 = (await setup.views())["r1"]
        assert r1["health"]["draining"] and not r1["routable"], r1
        assert r1["health"]["drain"]["reason"] == "node repair", r1
        assert r1["health"]["drain_kept"].startswith("drained (kept from before its removal at "), r1
        assert r1["health"]["drain_kept"].endswith(" by admin: node repair)"), r1
        async with grpc.aio.insecure_channel(f"127.0.0.1:{setup.balancer.grpc_port}") as channel:
            listed_grpc = await pb_grpc.AdminStub(channel).ListReplicas(pb.ListReplicasRequest())
        r1_grpc = {r.id: r for r in listed_grpc.replicas}["r1"]  # the same fact over gRPC (h-grpcparity)
        assert r1_grpc.drain_kept == r1["health"]["drain_kept"] and r1_grpc.unroutable == "draining"

        write([])
        await wait_for("r1 removed again", r1_gone, timeout_s=10)
        async with setup.session.post(f"{url}/undrain") as response:  # listed nowhere: was 404
            assert response.status == 200, await response.text()
        async with setup.session.post(f"{url}/undrain") as response:  # nothing kept any more
            assert response.status == 404, await response.text()
        write([extra])
        await wait_for("r1 discovered a third time", r1_listed, timeout_s=10)
        r1 = (await setup.views())["r1"]
        assert not r1["health"]["draining"] and r1["health"]["drain_kept"] is None, r1


@pytest.mark.redis
async def test_a_redis_that_lost_its_data_gets_the_kept_drains_back(redis_server: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    clock = Clock()
    await client.delete(KEY)
    try:
        a = balancer(client, clock, 3600.0, R1)
        await a.sync()
        await a.commit(R1, NOTE)
        await a.sync()
        assert a.health.replicas[R1].draining
        remove(a, R1, 1_796_000_050.0)
        await a.mark_removed(R1)
        await client.delete(KEY)  # a restart without persistence
        await a.sync()  # the seed
        assert (await entry(client, R1)) == {**NOTE.to_json(), "removed_at_wall_ts": 1_796_000_050.0}
        assert R1 in a.health.kept_drains
    finally:
        await client.delete(KEY)
        await client.aclose()


@pytest.mark.redis
async def test_with_redis_the_balancers_discovery_marks_the_removal_and_a_relisting_clears_it(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The service's wiring: its discovery's removal marks the entry, its re-listing clears it and
    the replica comes back drained, and an undrain of the id no pool lists deletes the entry."""
    listed = tmp_path / "replicas.yaml"
    listed.write_text("pools: []\n")
    overrides = {
        "discovery__kind": "file",
        "discovery__file": str(listed),
        "discovery__reload_interval_s": 0.1,
        "redis__url": redis_server.url,
        "redis__key_prefix": "dkb",
        "redis__policy_poll_s": 0.1,
        "listen__grpc_port": 0,
    }
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)

    def write(replicas: list[Replica]) -> None:
        fresh = tmp_path / "replicas.yaml.new"
        entries = [replica_entry(r) for r in replicas]
        fresh.write_text(yaml.safe_dump({"pools": [{"model": MODEL, "replicas": entries}]}))
        fresh.replace(listed)

    try:
        async with (
            two_replicas(**overrides) as (static, extra, settings),
            balancer_over(static, extra, settings) as setup,
        ):

            async def r1_listed() -> bool:
                return "r1" in await setup.views()

            async def r1_gone() -> bool:
                return "r1" not in await setup.views()

            write([extra])
            await wait_for("r1 discovered", r1_listed, timeout_s=10)
            url = f"{setup.balancer.url}/admin/replicas/r1"
            async with setup.session.post(f"{url}/drain", json={"reason": "node repair"}) as response:
                assert response.status == 200, await response.text()
            write([])
            await wait_for("r1 removed", r1_gone, timeout_s=10)
            stored = strict_json.loads(await client.hget("dkb:drained", "r1"))
            assert stored["reason"] == "node repair" and isinstance(stored["removed_at_wall_ts"], float)

            async def kept_in_redis() -> bool:
                return (await kept_on_both_faces(setup))[0].get("r1", {}).get("source") == "redis"

            await wait_for("the fleet's kept drain listed", kept_in_redis, timeout_s=5)
            http_kept, grpc_kept = await kept_on_both_faces(setup)
            assert http_kept["r1"]["removed_at_wall_ts"] == stored["removed_at_wall_ts"]
            assert http_kept["r1"]["drain"]["reason"] == "node repair"
            assert grpc_kept["r1"].source == "redis" and grpc_kept["r1"].text == http_kept["r1"]["text"]

            write([extra])
            await wait_for("r1 discovered again", r1_listed, timeout_s=10)

            async def cleared() -> bool:
                raw = await client.hget("dkb:drained", "r1")
                return raw is not None and "kept_from_removal_wall_ts" in strict_json.loads(raw)

            await wait_for("the re-listing to clear the removal time", cleared, timeout_s=5)
            r1 = (await setup.views())["r1"]
            assert r1["health"]["draining"] and r1["health"]["drain_kept"].endswith("by admin: node repair)")

            write([])
            await wait_for("r1 removed again", r1_gone, timeout_s=10)
            async with setup.session.post(f"{url}/undrain") as response:  # listed nowhere: was 404
                assert response.status == 200, await response.text()
            assert await client.hget("dkb:drained", "r1") is None
    finally:
        await client.delete("dkb:drained")
        await client.aclose()


@pytest.mark.redis
async def test_two_balancers_with_skewed_clocks_keep_a_drain_for_the_keep_time_on_redis_clock(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Two real balancers on one ``redis-server``, A's wall clock 10 days behind, B's 10 days ahead,
    each with its own discovery file, ``health_drain_keep_s: 3``. r1 is drained, B's discovery drops
    it, then A's: the drain is kept (listed by both as a ``redis`` kept drain) for the keep time on
    Redis's clock, then pruned. Before h-fleetfollow2, A stamped the removal 10 days back and B
    (20 days past it) deleted the entry at its next sync."""
    keep_s = 3.0
    redis = aioredis.Redis.from_url(redis_server.url, decode_responses=True)

    def files(name: str) -> tuple[Path, dict[str, Any]]:
        listed = tmp_path / f"{name}.yaml"
        listed.write_text("pools: []\n")
        return listed, {
            "discovery__kind": "file",
            "discovery__file": str(listed),
            "discovery__reload_interval_s": 0.1,
            "redis__url": redis_server.url,
            "redis__key_prefix": "dks",
            "redis__policy_poll_s": 0.1,
            "health_drain_keep_s": keep_s,
        }

    def write(path: Path, replicas: list[Replica]) -> None:
        fresh = path.with_suffix(".new")
        entries = [replica_entry(r) for r in replicas]
        fresh.write_text(yaml.safe_dump({"pools": [{"model": MODEL, "replicas": entries}]}))
        fresh.replace(path)

    file_a, overrides_a = files("a")
    file_b, overrides_b = files("b")
    balancers: list[Balancer] = []
    try:
        async with (
            two_replicas(**overrides_a) as (static, extra, settings_a),
            aiohttp.ClientSession() as session,
        ):
            settings_b = settings_for([static], limits__speculative_ttl_s=0.001, **overrides_b)
            for settings, skew_s in ((settings_a, -10 * 86_400.0), (settings_b, 10 * 86_400.0)):
                options = ServeOptions(wall_clock=lambda skew_s=skew_s: time.time() + skew_s)
                balancer = Balancer(settings, tokenizers={MODEL: shared_deepseek()}, options=options)
                balancers.append(balancer)
                await balancer.start()
                await wait_ready(session, balancer.url)
            a, b = balancers

            async def answer(on: Balancer) -> dict[str, Any]:
                async with session.get(f"{on.url}/admin/replicas") as response:
                    assert response.status == 200, await response.text()
                    return dict(await response.json())

            async def r1_draining_on_both() -> bool:
                for on in (a, b):
                    views = {v["id"]: v for v in (await answer(on))["replicas"]}
                    if "r1" not in views or not views["r1"]["health"]["draining"]:
                        return False
                return True

            write(file_a, [extra])
            write(file_b, [extra])
            await wait_for("r1 listed on both", lambda: answer_lists(answer, a, b, "r1"), timeout_s=10)
            async with session.post(f"{a.url}/admin/replicas/r1/drain", json={"reason": "disk swap"}) as sent:
                assert sent.status == 200, await sent.text()
            await wait_for("r1 drained on both", r1_draining_on_both, timeout_s=10)

            write(file_b, [])  # B's discovery drops it first: A still lists it and clears the time

            async def cleared() -> bool:
                raw = await redis.hget("dks:drained", "r1")
                return raw is not None and "kept_from_removal_wall_ts" in strict_json.loads(raw)

            await wait_for("A to clear B's removal", cleared, timeout_s=10)
            write(file_a, [])  # then A's: removed everywhere

            async def removed() -> bool:
                raw = await redis.hget("dks:drained", "r1")
                return raw is not None and "removed_at_wall_ts" in strict_json.loads(raw)

            await wait_for("A's removal mark", removed, timeout_s=10)
            stamped = float(strict_json.loads(await redis.hget("dks:drained", "r1"))["removed_at_wall_ts"])
            assert abs(stamped - await redis_now(redis)) < 5.0  # Redis's clock, not A's (10 days back)
            await asyncio.sleep(0.5)  # both balancers synced several times (every 0.1 s)
            assert await redis.hget("dks:drained", "r1") is not None  # B, 20 days past A's clock, kept it
            for on in (a, b):
                kept = {k["id"]: k for k in (await answer(on))["kept_drains"]}
                assert kept["r1"]["source"] == "redis" and 0 < kept["r1"]["expires_in_s"] <= keep_s, kept
                assert kept["r1"]["drain"]["reason"] == "disk swap"

            async def pruned() -> bool:
                return await redis.hget("dks:drained", "r1") is None

            await wait_for("the prune after the keep time", pruned, timeout_s=keep_s + 10)
            assert await redis_now(redis) - stamped > keep_s  # not before the keep time on Redis's clock
    finally:
        for balancer in balancers:
            await balancer.stop()
        await redis.delete(
            "dks:drained", "dks:drained:version{dks:drained}", "dks:drained:changes{dks:drained}"
        )
        await redis.aclose()


async def answer_lists(answer: Any, a: Balancer, b: Balancer, replica: str) -> bool:
    for on in (a, b):
        if replica not in {v["id"] for v in (await answer(on))["replicas"]}:
            return False
    return True
