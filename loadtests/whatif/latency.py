"""Does a what-if replay slow routing down? (I/O; ``python -m loadtests.whatif.latency``)

Starts an emulated fleet (``cpu-test`` profile: millisecond steps) and one ``kvlb serve``, fills the
pool's decision ring with ``--fill`` requests (shared prefixes, so the cost policy has matches to
weigh), then measures, one request at a time, the client-side latency of small completions
(``max_tokens`` 1) and of routing alone (``POST /admin/explain``: match and score, no replica), in
alternating phases: **idle** (nothing else runs) and **whatif** (a client keeps one
``POST /admin/whatif`` over the whole ring running back to back). Phases alternate ``--rounds``
times so that drift in the machine's load hits both alike. Prints JSON: p50/p90/p99 per phase, the
what-if replays completed and their mean duration.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.fleet.processes import EmulatorOptions, start_emulator, start_router
from loadtests.peers import parse_router


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _prompt(rng: random.Random) -> list[int]:
    prefix = 1000 * (1 + rng.randrange(16))
    return list(range(prefix, prefix + 64)) + [rng.randrange(30_000) for _ in range(16)]


async def _complete(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    async with session.post(url + "/v1/completions", json=body) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"completion answered {response.status}")
    return time.perf_counter() - started


async def _explain(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> float:
    """Routing alone: ``POST /admin/explain`` tokenizes (token ids here), matches and scores, and
    commits nothing; no replica is involved."""
    started = time.perf_counter()
    async with session.post(url + "/admin/explain", json={"model": model, "prompt": prompt}) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"explain answered {response.status}")
    return time.perf_counter() - started


async def _fill(session: aiohttp.ClientSession, url: str, model: str, count: int, rng: random.Random) -> None:
    queue = list(range(count))

    async def worker() -> None:
        while queue:
            queue.pop()
            await _complete(session, url, model, _prompt(rng))

    await asyncio.gather(*(worker() for _ in range(16)))


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="whatif-latency-"))
    options = EmulatorOptions(replicas=args.replicas, profile="cpu-test", processes=1)
    fleet = await start_emulator(options, logs)
    rng = random.Random(args.seed)
    sets = (f"console.decision_ring_size={args.fill}",)
    try:
        child, url = await start_router(parse_router("kvlb"), fleet, logs, seed=args.seed, kvlb_sets=sets)
        try:
            async with aiohttp.ClientSession() as session:
                await _fill(session, url, fleet.model, args.fill, rng)
                latencies: dict[str, list[float]] = {"idle": [], "whatif": []}
                routing: dict[str, list[float]] = {"idle": [], "whatif": []}
                replays: list[float] = []
                for _ in range(args.rounds):
                    for phase in ("idle", "whatif"):
                        stop = asyncio.Event()
                        background = None
                        if phase == "whatif":
                            background = asyncio.create_task(_replay_loop(session, url, stop, replays))
                            await asyncio.sleep(0.05)
                        try:
                            for _ in range(args.requests):
                                done = await _complete(session, url, fleet.model, _prompt(rng))
                                latencies[phase].append(done)
                                routed = await _explain(session, url, fleet.model, _prompt(rng))
                                routing[phase].append(routed)
                        finally:
                            stop.set()
                            if background is not None:
                                with contextlib.suppress(asyncio.CancelledError):
                                    await background
        finally:
            await child.stop()
    finally:
        await fleet.stop()
    return {
        "replicas": args.replicas,
        "ring_entries": args.fill,
        "requests_per_phase": args.requests * args.rounds,
        "completion_latency_ms": _figures(latencies),
        "explain_latency_ms": _figures(routing),
        "whatif_replays": len(replays),
        "whatif_mean_s": round(statistics.fmean(replays), 3) if replays else None,
        "logs": str(logs),
    }


def _figures(by_phase: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        phase: {
            "p50": round(1e3 * _percentile(values, 0.5), 3),
            "p90": round(1e3 * _percentile(values, 0.9), 3),
            "p99": round(1e3 * _percentile(values, 0.99), 3),
            "mean": round(1e3 * statistics.fmean(values), 3),
        }
        for phase, values in by_phase.items()
    }


async def _replay_loop(
    session: aiohttp.ClientSession, url: str, stop: asyncio.Event, took: list[float]
) -> None:
    body = {"weights": {"overlap_credit": 0.5}, "sample": 10}
    while not stop.is_set():
        async with session.post(url + "/admin/whatif", json=body) as response:
            answer = await response.json()
            if response.status != 200:
                raise RuntimeError(f"/admin/whatif answered {response.status}: {answer}")
            took.append(float(answer["elapsed_s"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--fill", type=int, default=10_000, help="decisions in the ring (default 10000)")
    parser.add_argument("--requests", type=int, default=200, help="requests per phase and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
