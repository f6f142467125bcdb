"""An engine that refuses kvlb's key leaves routing, on real processes: ``kvlb emulate --engine
<kind> --api-key`` (vLLM's and SGLang's ``--api-key`` do not guard ``/health``: with a wrong key in
kvlb its probe passes) and a real balancer reading its key from a file.

* with the wrong key the replica is out of routing, saying why (``/admin/replicas``' ``unroutable``
  and ``health.key_refused``, the 503 of explain and of a request, the CLI table,
  ``kvlb_replica_key_refused``), logged once, and no request reaches it;
* the passing ``/health`` probe is logged as answering but out of routing, not as healthy;
* the key file rotated to the engine's key puts it back (the key watcher's poll, then the next
  probe), and requests pass.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from kvlb_harness import MODEL, metric_value

from balancer.app import Balancer
from balancer.cli.command import replicas_table
from balancer.config import load
from balancer.tokenizer.tokenizer import TokenIdTokenizer

KEY = "sk-engine-right-51ab"
WRONG = "sk-engine-wrong-08ce"
BODY = {"model": MODEL, "prompt": list(range(1, 65)), "max_tokens": 2, "temperature": 0}
WAIT_S = 15.0


@asynccontextmanager
async def emulated(kind: str, api_key: str) -> AsyncIterator[str]:
    """``kvlb emulate`` of one replica with ``--api-key`` (its URL yielded), stopped at the end."""
    args = ["--replicas", "1", "--engine", kind, "--profile", "cpu-test", "--tokenizer", "none"]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "balancer", "emulate", *args, "--api-key", api_key,
        "--page-size", "16", "--time-scale", "20", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            line = ""
            while not line.startswith("{"):
                raw = await process.stdout.readline()
                assert raw, "kvlb emulate ended before listing its replica"
                line = raw.decode().strip()
        (replica,) = json.loads(line)["replicas"]
        yield str(replica["url"])
    finally:
        if process.returncode is None:
            process.terminate()
            async with asyncio.timeout(10):
                await process.wait()


async def view_of(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/admin/replicas") as response:
        assert response.status == 200
        (view,) = (await response.json())["replicas"]
        return dict(view)


async def until(session: aiohttp.ClientSession, url: str, routable: bool) -> dict[str, Any]:
    async with asyncio.timeout(WAIT_S):
        while (view := await view_of(session, url))["routable"] is not routable:  # noqa: ASYNC110 - polls another process
            await asyncio.sleep(0.05)
    return view


@pytest.mark.parametrize("kind", ["vllm", "sglang", "trtllm"])
async def test_an_engine_refusing_kvlbs_key_leaves_routing_until_the_key_rotates(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """vLLM and SGLang guard ``/v1/*`` but not ``/health``; TRT-LLM (no key of its own) stands behind
    a proxy that guards every path but ``/health`` (the emulator's ``--api-key``)."""
    caplog.set_level(logging.INFO, logger="balancer.health.prober")
    key_file = tmp_path / "engine.key"
    key_file.write_text(WRONG, encoding="utf-8")
    async with emulated(kind, KEY) as engine_url, aiohttp.ClientSession() as session:
        async with session.get(engine_url + "/health") as response:
            assert response.status == 200  # /health is not guarded: the probe passes
        tree = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": [
                {
                    "model": MODEL,
                    "replicas": [
                        {"id": "r0", "url": engine_url, "engine": kind, "block_size": 16,
                         "api_key_file": str(key_file)},
                    ],
                }
            ],
            "health_interval_s": 0.1,
            "scrape_interval_s": 0.2,
            "upstream": {"api_key_poll_s": 0.1},
        }  # fmt: skip
        path = tmp_path / "kvlb.yaml"
        path.write_text(yaml.safe_dump(tree), encoding="utf-8")
        balancer = Balancer(load(path, env={}), tokenizers={MODEL: TokenIdTokenizer()})
        await balancer.start()
        try:
            reason = f"engine refuses kvlb's key (api_key_file {key_file})"
            async with asyncio.timeout(WAIT_S):
                while (view := await view_of(session, balancer.url))["health"]["key_refused"] is None:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert view["routable"] is False and view["unroutable"] == reason
            assert view["health"]["key_refused"] == reason and view["health"]["probe_ok"] is True
            assert WRONG not in json.dumps(view)
            table = replicas_table([view]).splitlines()
            assert table[1].split()[:2] == ["r0", "no:key-refused"] and table[2] == f"r0: {reason}"
            # explain (its ``left_out`` when another replica is routable) and a request: a 503 saying why
            for route in ("/admin/explain", "/v1/completions"):
                async with session.post(balancer.url + route, json=BODY) as response:
                    assert response.status == 503 and "Retry-After" in response.headers
                    assert f"(1 {reason})" in (await response.json())["error"]["message"]
            async with session.get(balancer.url + "/metrics") as response:
                text = await response.text()
            assert metric_value(text, "kvlb_replica_key_refused", replica="r0") == 1
            await asyncio.sleep(0.5)  # several probes, each reading the list again
            said = [r for r in caplog.records if "is out of routing" in r.getMessage()]
            assert len(said) == 1 and "refusing kvlb's API key" in said[0].getMessage()
            # the passing probe is not logged as "healthy": the log says it stays out, and why
            lines = [r.getMessage() for r in caplog.records]
            assert not [line for line in lines if line.endswith("is healthy")], lines
            probe = f"replica r0 answers its health probe but stays out of routing: {reason}"
            assert lines.count(probe) == 1, lines

            key_file.write_text(KEY, encoding="utf-8")  # the rotation
            view = await until(session, balancer.url, routable=True)
            assert view["health"]["key_refused"] is None and view["unroutable"] is None
            async with session.post(balancer.url + "/v1/completions", json=BODY) as response:
                assert response.status == 200, await response.text()
            async with session.get(balancer.url + "/metrics") as response:
                text = await response.text()
            assert metric_value(text, "kvlb_replica_key_refused", replica="r0") == 0
            assert any("accepts kvlb's key" in r.getMessage() for r in caplog.records)
        finally:
            await balancer.stop()
