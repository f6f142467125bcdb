"""``GET /admin/series`` gathered by worker 0 of ``--workers 2`` when the other worker's answer
cannot be merged: a real balancer (worker 0, its ``WorkerRole`` on a socket of its own) and, as
worker 1, an HTTP server on 127.0.0.1 answering the series as a kvlb from before 2026-12-01 did
(rows without ``ttft_histogram``), as a worker the supervisor restarted after an upgrade could.
The answer is worker 0's own with worker 1 named missing: a 200, never a 5xx. A sibling that
answers in the present form is merged (its requests counted)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kvlb_harness import MODEL, running, shared_deepseek

from balancer.app import Balancer
from balancer.serve_options import ServeOptions, WorkerRole
from balancer.service.series import SeriesSampler
from balancer.tokenizer.tokenizer import Tokenizer


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


@asynccontextmanager
async def sibling(answer: dict[str, Any]) -> AsyncIterator[str]:
    """Worker 1: an HTTP server on 127.0.0.1 whose ``/admin/series`` answers ``answer``."""

    async def series(request: web.Request) -> web.Response:
        return web.json_response(answer)

    app = web.Application()
    app.router.add_get("/admin/series", series)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def sibling_series(now: float, *, histograms: bool) -> dict[str, Any]:
    """Worker 1's series: 7 requests in the current interval, with or without the histograms."""
    sampler = SeriesSampler(5.0, 180, 256)
    for i in range(7):
        sampler.on_commit("r0", 100, 0, now)
        sampler.on_ttft(0.01 * (i + 1), now)
    answer = sampler.series(5, now, ttft_histograms=True)
    if not histograms:
        for row in answer["intervals"]:
            del row["ttft_histogram"]
    return answer


@pytest.mark.parametrize("histograms", [False, True])
async def test_a_sibling_answer_without_histograms_leaves_this_worker_s_own(
    tokenizer: Tokenizer, tmp_path: Path, histograms: bool
) -> None:
    async with running(tokenizer, 1) as h:  # the replicas and settings; its own balancer is not asked
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        fd = listener.detach()  # the balancer takes the socket over (and closes it), as a worker does
        role = WorkerRole(index=0, count=2, listen_fd=fd, run_dir=str(tmp_path))
        worker0 = Balancer(
            h.balancer.settings, tokenizers={MODEL: tokenizer}, options=ServeOptions(worker=role)
        )
        try:
            await worker0.start()
            now = worker0.state.wall_clock()
            async with sibling(sibling_series(now, histograms=histograms)) as url:
                (tmp_path / "worker-1.url").write_text(url)
                async with aiohttp.ClientSession() as session:
                    for _ in range(3):
                        body = {"model": MODEL, "prompt": list(range(10, 40)), "max_tokens": 1}
                        async with session.post(worker0.url + "/v1/completions", json=body) as r:
                            assert r.status == 200, await r.text()
                    async with session.get(worker0.url + "/admin/series?minutes=1") as r:
                        assert r.status == 200, await r.text()
                        answer = await r.json()
        finally:
            await worker0.stop()
    requests = sum(row["requests"] for row in answer["intervals"])
    if histograms:
        assert answer["workers"] == [0, 1] and answer["workers_missing"] == []
        assert requests == 3 + 7
    else:
        assert answer["workers"] == [0] and answer["workers_missing"] == [1]
        assert requests == 3
