"""In-process benchmark of ``GET /metrics`` on a running balancer of many replicas: each scrape's
time and the longest the event loop was held while it ran (what a request waits at most behind it).

A real :class:`balancer.app.Balancer` on 127.0.0.1 with one pool of ``--replicas`` replica entries,
all pointing at one emulated vLLM replica (:mod:`replicas.sim`; ``kv_events: false``, so no event
sources: every replica is registered, its counters at 0, and probed once at the start), its
start-up heap frozen as ``kvlb serve`` freezes it (``balancer.gc_tuning.settle_after_start``: else
a full collection of it, ~90 ms, lands in the first scrape), scraped over HTTP from the same event
loop. A loop-lag probe (a task sleeping 0.5 ms again and again)
records the longest gap between two of its turns during each scrape: the loop's longest hold (in
wall time, and in the loop thread's CPU time, which the machine's load does not stretch).
The first scrape after the start builds what the renderer keeps; the others reuse it.

Runs against whichever ``balancer`` is on ``PYTHONPATH`` (for two revisions side by side, copy this
file into the other tree). Figures: the first scrape (its time and the loop thread's CPU time
meanwhile, its longest hold in wall and CPU time, ms), then the median and maximum of each over
``--scrapes`` more.

    PYTHONPATH=$PWD python -m loadtests.bench.metrics_scrape --replicas 200 [--scrapes 10] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import zmq.asyncio

from balancer.app import Balancer
from balancer.config import Settings, from_mapping
from balancer.gc_tuning import settle_after_start
from balancer.tokenizer.tokenizer import TokenIdTokenizer
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

MODEL = "sim-test"
"""The model name of the emulator's ``cpu-test`` profile."""
PROBE_S = 0.0005
"""The loop-lag probe's sleep (s): a gap between its turns longer than this is the loop held."""
READY_TIMEOUT_S = 30.0


class LoopLag:
    """A task on the running loop that sleeps :data:`PROBE_S` in turn and keeps the longest gap
    between two turns since :meth:`reset` (s), in wall time and in the loop thread's CPU time
    (``time.thread_time``: what the loop ran between two turns, without the time the process waited
    for a core on a loaded machine)."""

    def __init__(self) -> None:
        self.longest_s = 0.0
        self.longest_cpu_s = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while True:
            await asyncio.sleep(PROBE_S)
            now, now_cpu = time.perf_counter(), time.thread_time()
            self.longest_s = max(self.longest_s, now - last)
            self.longest_cpu_s = max(self.longest_cpu_s, now_cpu - last_cpu)
            last, last_cpu = now, now_cpu

    def reset(self) -> None:
        self.longest_s = self.longest_cpu_s = 0.0

    @asynccontextmanager
    async def running(self) -> AsyncIterator[LoopLag]:
        self._task = asyncio.create_task(self._run())
        try:
            await asyncio.sleep(PROBE_S * 4)
            yield self
        finally:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def settings(url: str, replicas: int) -> Settings:
    """One pool of ``replicas`` entries at ``url`` (no KV events, probes far apart)."""
    tree: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {
                "model": MODEL,
                "kv_events": False,
                "replicas": [
                    {"id": f"replica-{i:03d}", "url": url, "engine": "vllm", "block_size": 16}
                    for i in range(replicas)
                ],
            }
        ],
        "health_interval_s": 600.0,
        "scrape_interval_s": 0,
    }
    built: Settings = from_mapping(Settings, tree).validate()
    return built


@asynccontextmanager
async def fleet(replicas: int) -> AsyncIterator[tuple[Balancer, aiohttp.ClientSession]]:
    """A ready balancer over ``replicas`` entries of one emulated vLLM replica, and a client session."""
    zctx = zmq.asyncio.Context()
    tokenizer = TokenIdTokenizer()
    replica = Replica(
        ReplicaConfig(name="r0", engine="vllm", profile=get_profile("cpu-test")), tokenizer, zctx
    )
    balancer: Balancer | None = None
    try:
        await replica.start()
        balancer = Balancer(settings(replica.url, replicas), tokenizers={MODEL: tokenizer})
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            async with asyncio.timeout(READY_TIMEOUT_S):
                while True:
                    async with session.get(balancer.url + "/readyz") as response:
                        if response.status == 200:
                            break
                    await asyncio.sleep(0.05)
            settle_after_start()  # as ``kvlb serve`` does once started: the start-up heap frozen
            try:
                yield balancer, session
            finally:
                gc.unfreeze()  # a test process goes on: its later garbage is collected as usual
    finally:
        if balancer is not None:
            await balancer.stop()
        await replica.stop()
        zctx.destroy(linger=0)


async def scrape(session: aiohttp.ClientSession, url: str, lag: LoopLag) -> dict[str, float]:
    """One ``GET /metrics``: its time and the loop thread's CPU time meanwhile, the loop's longest
    hold (wall and CPU, ms), and its bytes."""
    await asyncio.sleep(0.01)  # let the probe run a few turns first
    lag.reset()
    start, start_cpu = time.perf_counter(), time.thread_time()
    async with session.get(url + "/metrics") as response:
        body = await response.read()
        assert response.status == 200, response.status
    took, took_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    return {
        "scrape_ms": round(took * 1e3, 2),
        "scrape_cpu_ms": round(took_cpu * 1e3, 2),
        "hold_ms": round(lag.longest_s * 1e3, 2),
        "hold_cpu_ms": round(lag.longest_cpu_s * 1e3, 2),
        "bytes": len(body),
    }


async def measure(replicas: int, scrapes: int) -> dict[str, Any]:
    """The first scrape, then ``scrapes`` more (see the module docstring)."""
    async with fleet(replicas) as (balancer, session), LoopLag().running() as lag:
        first = await scrape(session, balancer.url, lag)
        rest = [await scrape(session, balancer.url, lag) for _ in range(scrapes)]
    out: dict[str, Any] = {"first": first, "bytes": rest[-1]["bytes"]}
    for figure in ("scrape_ms", "scrape_cpu_ms", "hold_ms", "hold_cpu_ms"):
        values = [row[figure] for row in rest]
        out[figure] = {"median": round(statistics.median(values), 2), "max": max(values)}
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, default=200, help="replica entries (1..2000)")
    parser.add_argument("--scrapes", type=int, default=10, help="scrapes after the first (1..1000)")
    parser.add_argument("--json", action="store_true", help="print the JSON only")
    args = parser.parse_args(argv)
    if not 1 <= args.replicas <= 2000 or not 1 <= args.scrapes <= 1000:
        parser.error("--replicas 1..2000, --scrapes 1..1000")
    result = {
        "started_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "load_average": list(os.getloadavg()),
        "command": " ".join(["python -m loadtests.bench.metrics_scrape", *sys.argv[1:]]),
        "replicas": args.replicas,
        **asyncio.run(measure(args.replicas, args.scrapes)),
    }
    print(json.dumps(result, indent=2))
    if not args.json:
        first = result["first"]
        print(
            f"first scrape {first['scrape_ms']} ms (CPU {first['scrape_cpu_ms']}), longest hold "
            f"{first['hold_ms']} ms (CPU {first['hold_cpu_ms']}); then (median / max): "
            + ", ".join(
                f"{figure} {result[figure]['median']} / {result[figure]['max']}"
                for figure in ("scrape_ms", "scrape_cpu_ms", "hold_ms", "hold_cpu_ms")
            )
            + f"; {result['bytes']:,} bytes"
        )
    return result


if __name__ == "__main__":
    main()
