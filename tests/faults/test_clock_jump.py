"""Wall-clock jumps: the embedded balancer reads the wall clock only for display, so jumping it by
hours, back and forth, while requests and events flow changes nothing: every request succeeds, no
replica is marked unhealthy, and the index still matches the engines' caches.

In process (the clock is ``time.time`` of this process): two emulated replicas (SGLang and TRT-LLM)
and a balancer on one event loop, with ``time.time`` jumping between -2 h and +1 day every 100 ms.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest
from kvlb_harness import MODEL, Harness, running, shared_deepseek, wait_for

JUMPS_S = (0.0, 3600.0, -7200.0, 86400.0, -60.0)


async def blocks(h: Harness) -> tuple[dict[str, int], dict[str, int]]:
    engines: dict[str, int] = {}
    for replica in h.replicas:
        async with h.session.get(replica.url + "/admin/stats") as response:
            stats: dict[str, Any] = await response.json()
        size = replica.config.block_size
        engines[replica.config.name] = sum(r["num_cached_tokens"] for r in stats["ranks"]) // size
    views = (await h.admin("GET", "/admin/replicas"))["replicas"]
    return engines, {v["id"]: v["index"]["blocks"] for v in views}


async def test_wall_clock_jumps_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = time.time
    offset = [0.0]
    monkeypatch.setattr(time, "time", lambda: real() + offset[0])

    async def jump() -> None:
        for value in itertools.cycle(JUMPS_S):
            offset[0] = value
            await asyncio.sleep(0.1)

    async with running(shared_deepseek(), 2, engines=("sglang", "trtllm")) as h:
        h.balancer.state.wall_clock = time.time  # type: ignore[union-attr]
        jumper = asyncio.create_task(jump())
        try:
            for index in range(30):
                # 33 prompt tokens and 32 generated: TRT-LLM (32-token blocks) keys (prompt + output)[:-1],
                # 64 tokens, so neither engine ever holds a partial block
                prompt = [100 + index % 7, *range(200, 232)]
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "stream": index % 2 == 0}
                answer = await h.post("/v1/completions", body)
                assert answer.status == 200, answer.body
                assert b"error" not in answer.body
                await asyncio.sleep(0.02)
            views = (await h.admin("GET", "/admin/replicas"))["replicas"]
            assert all(v["routable"] for v in views), views

            async def converged() -> bool:
                engines, index = await blocks(h)
                return engines == index

            try:
                await wait_for("the index to match the engines", converged, timeout_s=3.0)
            except AssertionError as exc:
                raise AssertionError(f"{exc}: engines, index = {await blocks(h)}") from None
        finally:
            jumper.cancel()
