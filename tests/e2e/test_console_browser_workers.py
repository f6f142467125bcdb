"""The web console's plots with ``kvlb serve --workers 2``, in headless Chromium: the TTFT line is
the service's.

Chats on fresh connections (the kernel hands each to either worker) until both workers have routed
some; then, at the start of one 1 s interval, six short chats to worker 0's private port and three
long ones (a prompt of 250 words never sent before: 8 prefill steps or more) to worker 1's, so that
in that interval worker 1's own TTFT p50 is a long chat's and the service's a short one's. The
console is opened and its TTFT plot read back: each point (``data-ts``, ``data-value``) is the
gathered ``/admin/series`` answer's p50, that is the p50 of the sum of the two workers' own TTFT
histograms (each asked on its private port), and in that interval it is below the highest
worker's (the figure before 2026-12-01). The plots' caption says the figures come from 2 workers.
Skipped as ``test_console_browser.py`` is.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from serve_harness import MODEL, stop
from test_console_browser import (
    TOKEN,
    admin,
    by_css,
    chat,
    chromium,
    errors_in_log,
    one,
    pytestmark,
    start_fleet,
    wait_for,
)
from test_serve_workers_console import routed_by_worker, worker_args

from balancer.api.admin import SIBLING_HEADER
from balancer.service.log_histogram import LogHistogram

__all__ = ["pytestmark"]

MAX_CHATS = 80
WORDS = [
    "river",
    "stone",
    "window",
    "garden",
    "paper",
    "silver",
    "market",
    "engine",
    "forest",
    "cloud",
    "lantern",
    "harbor",
    "pencil",
]
BURSTS = 3
"""Tries at a burst that lands in one interval (a slow machine may spread one over two)."""


def long_chat(rng: random.Random) -> dict[str, Any]:
    """A chat of 250 random words: a prompt no replica holds, many prefill steps."""
    words = " ".join(rng.choice(WORDS) for _ in range(250))
    return {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 2}


async def burst(private: list[str], rng: random.Random) -> int:
    """At the start of an interval: six short chats to worker 0, then three long ones to worker 1
    at once; the chats answered 200."""
    await asyncio.sleep(1.0 - time.time() % 1.0 + 0.02)
    ok = 0
    async with aiohttp.ClientSession() as session:
        for i in range(6):
            async with session.post(private[0] + "/v1/chat/completions", json=chat("acme", i % 2)) as r:
                await r.read()
                ok += r.status == 200

        async def slow() -> int:
            async with session.post(private[1] + "/v1/chat/completions", json=long_chat(rng)) as r:
                await r.read()
                return int(r.status == 200)

        ok += sum(await asyncio.gather(slow(), slow(), slow()))
    return ok


def plotted_p50(driver: Any, url: str) -> dict[str, Any]:
    """Log in, wait for the TTFT plot's p50 points and the caption naming the workers; return them."""
    driver.get(url + "/ui")
    wait_for(driver, "the login box", lambda d: one(d, "#login").is_displayed())
    one(driver, "#token").send_keys(TOKEN)
    one(driver, "#login-button").click()
    wait_for(driver, "the console", lambda d: one(d, "#console").is_displayed())
    caption = wait_for(
        driver,
        "the plots' caption",
        lambda d: one(d, "#plots-updated").text if "workers" in one(d, "#plots-updated").text else False,
    )
    points = wait_for(
        driver,
        "the TTFT p50 points",
        lambda d: (
            {
                float(c.get_attribute("data-ts")): float(c.get_attribute("data-value"))
                for c in by_css(d, "#plot-ttft circle.s0")
            }
            or False
        ),
    )
    return {"caption": caption, "points": points, "errors": errors_in_log(driver)}


def private_urls(serve_pids: list[int]) -> list[str]:
    """The workers' private URLs, by index."""
    workers = {int(worker_args(pid)["--worker-index"]): pid for pid in serve_pids}
    run_dir = Path(worker_args(workers[0])["--run-dir"])
    return [(run_dir / f"worker-{index}.url").read_text().strip() for index in sorted(workers)]


async def own_histograms(private_urls: list[str]) -> list[dict[float, LogHistogram]]:
    """Each worker's own TTFT histograms per interval, asked on its private port as a sibling."""
    own = []
    async with aiohttp.ClientSession() as session:
        for private in private_urls:
            headers = {SIBLING_HEADER: "1", "Authorization": f"Bearer {TOKEN}"}
            async with session.get(
                private + "/admin/series?minutes=5&ttft_histograms=1", headers=headers
            ) as r:
                assert r.status == 200, await r.text()
                answer = await r.json()
            own.append(
                {row["ts"]: LogHistogram.from_json(row["ttft_histogram"]) for row in answer["intervals"]}
            )
    return own


async def test_the_ttft_plot_is_the_service_s_with_two_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SE_OFFLINE", "true")
    children, url = await start_fleet(tmp_path, workers=2)
    try:
        async with asyncio.timeout(60):
            async with aiohttp.ClientSession() as session:
                while (await session.get(url + "/readyz")).status != 200:  # noqa: ASYNC110 - another process
                    await asyncio.sleep(0.1)
            sent = 0
            for i in range(MAX_CHATS):
                fresh = aiohttp.TCPConnector(force_close=True)  # a new connection: either worker
                async with (
                    aiohttp.ClientSession(connector=fresh) as session,
                    session.post(url + "/v1/chat/completions", json=chat("acme", i)) as response,
                ):
                    await response.read()
                    sent += response.status == 200
                if sent >= 20 and len(await routed_by_worker(url)) == 2:
                    break
            assert len(await routed_by_worker(url)) == 2
            private = private_urls(children[-1].info["worker_pids"])
            rng = random.Random(11)
            for _ in range(BURSTS):
                sent += await burst(private, rng)
                await asyncio.sleep(1.1)  # the burst's interval closes: nothing changes there any more
                own = await own_histograms(private)
                if told_apart(own):
                    break
        with chromium(tmp_path) as driver:
            seen = await asyncio.to_thread(plotted_p50, driver, url)
        async with aiohttp.ClientSession() as session:
            gathered = await admin(session, url, "/admin/series?minutes=5")
    finally:
        for child in reversed(children):
            await stop(child)

    assert "from 2 workers" in seen["caption"] and seen["errors"] == [], seen
    answered = {
        row["ts"]: row["ttft_p50_s"] for row in gathered["intervals"] if row["ttft_p50_s"] is not None
    }
    assert seen["points"] == answered  # the plot draws the gathered answer
    for ts, p50 in seen["points"].items():  # which is the sum of the workers' histograms
        summed = LogHistogram()
        for part in own:
            if ts in part:
                summed.merge(part[ts])
        want = summed.quantile(0.5)
        assert want is not None and p50 == float(f"{want:.6g}"), (ts, p50, want)
    assert sum(row["ttft_count"] for row in gathered["intervals"]) == sent
    apart = told_apart(own)
    assert apart, "no burst landed in one interval"
    for ts, highest in apart.items():  # the service's p50 is below the slow worker's own
        assert seen["points"][ts] < highest, (ts, seen["points"][ts], highest)


def told_apart(own: list[dict[float, LogHistogram]]) -> dict[float, float]:
    """The intervals where the p50 of the workers' summed histograms is below the highest worker's
    own p50 (what the plot showed before 2026-12-01), with that highest p50."""
    apart = {}
    for ts in set(own[0]) & set(own[1]):
        parts = [own[0][ts], own[1][ts]]
        if not all(part.total for part in parts):
            continue
        summed = LogHistogram()
        for part in parts:
            summed.merge(part)
        highest = max(part.quantile(0.5) or 0.0 for part in parts)
        union = summed.quantile(0.5)
        if union is not None and union < highest:
            apart[ts] = float(f"{highest:.6g}")
    return apart
