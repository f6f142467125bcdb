"""Peak RSS of ``kvlb serve`` and the byte budget's gauge under concurrent large non-streaming answers
(I/O; ``docs/reliability.md``, "Memory").

``python -m loadtests.answer_budget`` from the repository root starts a replica on 127.0.0.1 (in this
process: an aiohttp server whose ``/v1/completions`` answers a JSON body of ``--answer-mb`` MB,
written in 256 KiB parts) and a fresh ``kvlb serve`` in front of it (so that ``VmHWM`` is that
run's peak) with ``limits.max_inflight_body_bytes`` of ``--budget-mib`` MiB, sends ``--answers``
completion requests at once, reads every answer whole, and prints, as one JSON line per run, the
peak RSS before and after (``VmHWM`` of ``/proc/<pid>/status``), the largest
``kvlb_admission_body_bytes`` sampled every 20 ms, what it is after the burst, the answers' statuses
and sizes, and ``kvlb_admission_answer_overflow_total``. ``--runs`` repeats it, one fresh kvlb a
run; run it in two trees, alternating, to compare them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from loadtests.bench.overhead.report import metric_value
from loadtests.faults.body_budget import proc_status_mb
from loadtests.faults.procs import MODEL, serve

MIB = 1024 * 1024
PART_BYTES = 256 * 1024
TIMEOUT_S = 120.0
"""Bound on one burst (and on waiting for kvlb to be ready)."""


async def _answer(request: web.Request) -> web.StreamResponse:
    """A JSON completion padded to the app's ``answer_bytes``, written in parts."""
    await request.read()
    size: int = request.app["answer_bytes"]
    head = b'{"id":"c1","object":"text_completion","choices":[{"text":"'
    tail = b'"}],"usage":{"prompt_tokens":4,"completion_tokens":1}}'
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    pad = size - len(head) - len(tail)
    response.content_length = size
    await response.prepare(request)
    await response.write(head)
    part = b"x" * PART_BYTES
    while pad > 0:
        await response.write(part[:pad])
        pad -= PART_BYTES
    await response.write_eof(tail)
    return response


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def one_run(answers: int, answer_bytes: int, budget_bytes: int) -> dict[str, Any]:
    app = web.Application()
    app["answer_bytes"] = answer_bytes
    app.router.add_post("/v1/completions", _answer)
    app.router.add_get("/health", _health)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    started_utc = time.strftime("%H:%M:%S", time.gmtime())
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        with tempfile.TemporaryDirectory(prefix="kvlb-answer-budget-") as tmp:
            config = {
                "listen": {"host": "127.0.0.1", "port": 0},
                "pools": [{"model": MODEL, "replicas": [{"id": "r0", "url": url, "engine": "sglang"}]}],
                "health_interval_s": 0.25,
                "scrape_interval_s": 0,
                "limits": {
                    "max_body_bytes": min(budget_bytes, 8 * MIB),
                    "max_inflight_body_bytes": budget_bytes,
                },
            }
            path = Path(tmp) / "kvlb.yaml"
            path.write_text(yaml.safe_dump(config))
            child = serve(Path(tmp), path)
            await child.start("serving")
            try:
                return await _burst(
                    child.pid, child.info["url"], answers, answer_bytes, budget_bytes, started_utc
                )
            finally:
                await child.stop()
    finally:
        await runner.cleanup()


async def _burst(
    pid: int, kvlb_url: str, answers: int, answer_bytes: int, budget_bytes: int, started_utc: str
) -> dict[str, Any]:
    body = json.dumps({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1}).encode()
    async with aiohttp.ClientSession() as session, asyncio.timeout(TIMEOUT_S):

        async def metrics() -> str:
            async with session.get(kvlb_url + "/metrics") as response:
                return await response.text()

        while True:  # ready: the replica is healthy
            async with session.get(kvlb_url + "/readyz") as response:
                if response.status == 200:
                    break
            await asyncio.sleep(0.05)
        before = proc_status_mb(pid, "VmHWM")
        peak_held = 0.0
        done = asyncio.Event()

        async def sample() -> None:
            nonlocal peak_held
            while not done.is_set():
                peak_held = max(peak_held, metric_value(await metrics(), "kvlb_admission_body_bytes"))
                await asyncio.sleep(0.02)

        async def post() -> tuple[int, int]:
            async with session.post(kvlb_url + "/v1/completions", data=body) as response:
                return response.status, len(await response.read())

        sampler = asyncio.create_task(sample())
        clock = time.monotonic()
        results = await asyncio.gather(*(post() for _ in range(answers)))
        burst_s = time.monotonic() - clock
        done.set()
        await sampler
        after = proc_status_mb(pid, "VmHWM")
        text = await metrics()
    statuses: dict[str, int] = {}
    for status, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {
        "started_utc": started_utc,
        "load_1m_after": round(os.getloadavg()[0], 2),
        "answers": answers,
        "answer_bytes": answer_bytes,
        "budget_bytes": budget_bytes,
        "peak_rss_before_mb": round(before, 1),
        "peak_rss_after_mb": round(after, 1),
        "peak_rise_mb": round(after - before, 1),
        "peak_held_bytes_sampled": int(peak_held),
        "held_bytes_after": int(metric_value(text, "kvlb_admission_body_bytes")),
        "answers_relayed": int(metric_value(text, "kvlb_admission_answer_overflow_total")),
        "whole_answers": sum(1 for status, size in results if status == 200 and size == answer_bytes),
        "burst_s": round(burst_s, 2),
        "statuses": statuses,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--answers", type=int, default=10, help="answers at once (default 10)")
    parser.add_argument("--answer-mb", type=float, default=20.0, help="each answer's size, MB (default 20)")
    parser.add_argument(
        "--budget-mib", type=float, default=16.0, help="max_inflight_body_bytes, MiB (default 16)"
    )
    parser.add_argument("--runs", type=int, default=1, help="runs, each with a fresh kvlb (default 1)")
    args = parser.parse_args(argv)
    for _ in range(args.runs):
        figures = asyncio.run(one_run(args.answers, int(args.answer_mb * 1e6), int(args.budget_mib * MIB)))
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
