"""CORS in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``) on a page
served from another 127.0.0.1 port calls kvlb's ``/v1/completions`` with ``fetch``, an API key and an
``x-stainless-*`` header (so the browser sends a preflight first), in front of an emulated SGLang
engine. From the listed origin the call succeeds and the page reads ``x-kvlb-replica``; from a page
of another port the browser refuses it (``TypeError: Failed to fetch``). Skipped, saying why, without
the browser (as tests/e2e/test_console_browser.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq.asyncio
from aiohttp import web
from emulated_replica import started
from kvlb_harness import MODEL, replica_entry, wait_ready
from settings_tree import settings_from
from test_console_browser import _browser_missing, chromium

from balancer.app import Balancer
from balancer.tokenizer.tokenizer import TokenIdTokenizer
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile

pytestmark = pytest.mark.skipif(_browser_missing() is not None, reason=_browser_missing() or "")

CLIENT_KEY = "sk-browser-cors"
FETCH = """
const [url, key, body, done] = arguments;
fetch(url + "/v1/completions", {
  method: "POST",
  headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json", "x-stainless-os": "Linux"},
  body: JSON.stringify(body),
}).then(async (r) => done({status: r.status, replica: r.headers.get("x-kvlb-replica"), text: await r.text()}))
  .catch((e) => done({error: String(e)}));
"""


async def page_server() -> tuple[web.AppRunner, str]:
    async def page(request: web.Request) -> web.Response:
        return web.Response(
            text="<!doctype html><title>page</title><p>a page of another origin</p>", content_type="text/html"
        )

    app = web.Application()
    app.router.add_get("/", page)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def fetch_from(tmp: Path, page: str, kvlb: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": list(range(1, 33)), "max_tokens": 2, "temperature": 0}
    tmp.mkdir(parents=True, exist_ok=True)
    with chromium(tmp) as driver:
        driver.set_script_timeout(20)
        driver.get(page + "/")
        result: dict[str, Any] = driver.execute_async_script(FETCH, kvlb, CLIENT_KEY, body)
        return result


async def test_a_page_of_a_listed_origin_calls_kvlb_and_another_is_refused(tmp_path: Path) -> None:
    listed_runner, listed = await page_server()
    other_runner, other = await page_server()
    zctx = zmq.asyncio.Context()
    config = ReplicaConfig(name="r0", engine="sglang", profile=get_profile("cpu-test"), time_scale=20.0)
    try:
        async with started(config, zctx) as replica, aiohttp.ClientSession() as session:
            tree = {
                "listen": {"host": "127.0.0.1", "port": 0, "cors_allow_origins": [listed]},
                "pools": [{"model": MODEL, "replicas": [replica_entry(replica)]}],
                "health_interval_s": 0.1,
                "auth": {"api_keys": [CLIENT_KEY]},
            }
            balancer = Balancer(settings_from(tree, {}), tokenizers={MODEL: TokenIdTokenizer()})
            await balancer.start()
            try:
                await wait_ready(session, balancer.url)
                ok = await asyncio.to_thread(fetch_from, tmp_path / "a", listed, balancer.url)
                assert ok.get("status") == 200, ok
                assert ok["replica"] == "r0"
                assert json.loads(ok["text"])["choices"]
                refused = await asyncio.to_thread(fetch_from, tmp_path / "b", other, balancer.url)
                assert "Failed to fetch" in refused.get("error", ""), refused
            finally:
                await balancer.stop()
    finally:
        zctx.destroy(linger=0)
        await listed_runner.cleanup()
        await other_runner.cleanup()
