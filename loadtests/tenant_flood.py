"""One tenant floods, another is measured: what the per-tenant admission caps buy (``python -m
loadtests.tenant_flood``).

A slow fake replica (every completion answered after ``--slow-ms``, a child process) stands behind a
real ``kvlb serve`` (another child process), all on 127.0.0.1. Tenant A (header ``x-kvlb-tenant:
a``) floods with ``--flooders`` clients, each sending one request after another (a refused one tries
again after 50 ms); tenant B (``b``) sends with ``--b-clients`` clients, one request after another
with 50 ms between, for ``--seconds``. Each run is one mode:

* ``off``: the per-tenant caps unset (they are then the global ones: no isolation, only the turns);
* ``on``: ``limits.max_inflight_per_tenant`` and ``limits.max_queued_per_tenant`` at half the global
  ``max_inflight`` and ``max_queued``.

``kvlb serve`` runs with ``--workers`` (default 1; with N workers the per-tenant slot cap holds for
them all together, at most N - 1 over, while the queue caps are per worker). Runs alternate as
``--runs`` says (default ``off,on,on,off,off,on``), each with a fresh ``kvlb serve``. Printed: a
JSON document (every run: B's successes, refusals, latency p50/p99 of its successes; A's answers by
status) and a table.
Percentiles are nearest-rank (:func:`balancer.service.series.percentile`).
Bounded: each run lasts ``--seconds`` (at most 60), each client sends at most 10,000 requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from balancer.service.series import percentile
from loadtests.fleet.child_process import Child, python_module, spawn

MODEL = "tenant-flood"
HEADER = "x-kvlb-tenant"
MAX_REQUESTS_PER_CLIENT = 10_000
START_TIMEOUT_S = 60.0


@dataclass
class Run:
    mode: str
    started_utc: str
    load_1m: float
    b_latencies_s: list[float] = field(default_factory=list)
    b_statuses: Counter[int] = field(default_factory=Counter)
    a_statuses: Counter[int] = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        latencies = sorted(self.b_latencies_s)
        return {
            "mode": self.mode,
            "started_utc": self.started_utc,
            "load_1m": self.load_1m,
            "b_ok": self.b_statuses.get(200, 0),
            "b_refused": sum(n for status, n in self.b_statuses.items() if status != 200),
            "b_statuses": {str(k): v for k, v in sorted(self.b_statuses.items())},
            "b_p50_ms": _ms(percentile(latencies, 0.50)),
            "b_p99_ms": _ms(percentile(latencies, 0.99)),
            "a_statuses": {str(k): v for k, v in sorted(self.a_statuses.items())},
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


async def serve_slow_replica(slow_s: float) -> None:
    """The child process: a replica on 127.0.0.1 that answers each completion after ``slow_s``
    seconds; prints its URL, serves until SIGTERM."""

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(slow_s)
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
            }
        )

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        stopping = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
        print(json.dumps({"url": f"http://127.0.0.1:{runner.addresses[0][1]}"}), flush=True)
        await stopping.wait()
    finally:
        await runner.cleanup()


async def start_replica(slow_ms: float, tmp: Path) -> Child:
    """This module as the slow replica's child process (its URL in ``info["url"]``)."""
    argv = python_module("loadtests.tenant_flood", "--serve-replica", "--slow-ms", str(slow_ms))
    return await spawn("replica", argv, tmp / "replica.log", ready_key="url", timeout_s=START_TIMEOUT_S)


def config(replica_url: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    limits: dict[str, Any] = {
        "max_inflight": args.max_inflight,
        "max_queued": args.max_queued,
        "queue_timeout_s": args.queue_timeout_s,
    }
    if mode == "on":
        limits["max_inflight_per_tenant"] = max(1, args.max_inflight // 2)
        limits["max_queued_per_tenant"] = args.max_queued // 2
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {
                "model": MODEL,
                "kv_events": False,
                "replicas": [{"id": "slow", "url": replica_url, "engine": "sglang", "block_size": 4}],
            }
        ],
        "limits": limits,
        "scrape_interval_s": 0,
        "health_interval_s": 0.5,
        "log_level": "WARNING",
    }


async def send(session: aiohttp.ClientSession, url: str, tenant: str, first: int) -> int:
    body = json.dumps({"model": MODEL, "prompt": [first % 50_000, 2, 3, 4], "max_tokens": 1})
    headers = {HEADER: tenant, "content-type": "application/json"}
    try:
        async with session.post(url + "/v1/completions", data=body, headers=headers) as response:
            await response.read()
            return response.status
    except aiohttp.ClientError:
        return 0


async def one_run(mode: str, replica_url: str, args: argparse.Namespace, tmp: Path) -> Run:
    path = tmp / f"kvlb-{mode}.yaml"
    path.write_text(yaml.safe_dump(config(replica_url, mode, args)))
    run = Run(mode, time.strftime("%H:%M:%S", time.gmtime()), os.getloadavg()[0])
    argv = python_module("balancer", "serve", "--config", str(path), "--workers", str(args.workers))
    serve = await spawn(
        "kvlb", argv, tmp / f"kvlb-{mode}.log", ready_key="serving", timeout_s=START_TIMEOUT_S
    )
    url = str(serve.info["url"])
    try:
        timeout = aiohttp.ClientTimeout(total=30)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            async with asyncio.timeout(START_TIMEOUT_S):
                while True:
                    async with session.get(url + "/readyz") as response:
                        if response.status == 200:
                            break
                    await asyncio.sleep(0.05)
            flooding = asyncio.Event()
            measuring = asyncio.Event()

            async def flooder(index: int) -> None:
                for sent in range(MAX_REQUESTS_PER_CLIENT):
                    if flooding.is_set():
                        return
                    status = await send(session, url, "a", 1000 * index + sent)
                    run.a_statuses[status] += 1
                    if status != 200:
                        await asyncio.sleep(0.05)

            async def client_b(index: int) -> None:
                for sent in range(MAX_REQUESTS_PER_CLIENT):
                    if measuring.is_set():
                        return
                    started = time.perf_counter()
                    status = await send(session, url, "b", 500_000 + 1000 * index + sent)
                    run.b_statuses[status] += 1
                    if status == 200:
                        run.b_latencies_s.append(time.perf_counter() - started)
                    await asyncio.sleep(0.05)

            flooders = [asyncio.create_task(flooder(i)) for i in range(args.flooders)]
            await asyncio.sleep(0.5)  # the flood fills every place first
            clients = [asyncio.create_task(client_b(i)) for i in range(args.b_clients)]
            await asyncio.sleep(args.seconds)
            measuring.set()
            await asyncio.gather(*clients)
            flooding.set()
            await asyncio.gather(*flooders)
    finally:
        await serve.stop()
    return run


def table(runs: list[dict[str, Any]]) -> str:
    head = (
        f"{'mode':<5} {'utc':<9} {'load':>5} {'B ok':>5} {'B refused':>9} {'B p50 ms':>9} {'B p99 ms':>9}"
        "  A by status"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        lines.append(
            f"{r['mode']:<5} {r['started_utc']:<9} {r['load_1m']:>5.2f} {r['b_ok']:>5} {r['b_refused']:>9} "
            f"{r['b_p50_ms']!s:>9} {r['b_p99_ms']!s:>9}  {r['a_statuses']}"
        )
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        replica = await start_replica(args.slow_ms, Path(tmp))
        try:
            for mode in args.runs.split(","):
                if mode not in ("on", "off"):
                    raise SystemExit(f"--runs: on or off, got {mode!r}")
                runs.append((await one_run(mode, str(replica.info["url"]), args, Path(tmp))).summary())
        finally:
            await replica.stop()
    settings = {k: v for k, v in vars(args).items()}
    print(json.dumps({"settings": settings, "runs": runs}, indent=1))
    print(table(runs))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", default="off,on,on,off,off,on")
    parser.add_argument("--seconds", type=float, default=8.0, help="B's measured time per run (≤ 60)")
    parser.add_argument("--flooders", type=int, default=64)
    parser.add_argument("--b-clients", type=int, default=2)
    parser.add_argument("--slow-ms", type=float, default=200.0)
    parser.add_argument("--max-inflight", type=int, default=16)
    parser.add_argument("--max-queued", type=int, default=32)
    parser.add_argument("--queue-timeout-s", type=float, default=2.0)
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="kvlb serve --workers (the per-tenant slot cap holds for all together)",
    )
    parser.add_argument("--serve-replica", action="store_true", help="(internal) be the slow replica")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 60 or not 1 <= args.flooders <= 512 or not 1 <= args.b_clients <= 64:
        parser.error("--seconds in (0, 60], --flooders in 1..512, --b-clients in 1..64")
    return args


if __name__ == "__main__":
    options = parse()
    asyncio.run(serve_slow_replica(options.slow_ms / 1000) if options.serve_replica else main(options))
