"""Measure the emulator's own cost and accuracy from outside; prints one JSON object (I/O; a tool:
``python -m loadtests.emulator_measure``).

1. Starts ``--replicas`` emulated replicas split over ``--processes`` child processes
   (``python -m replicas.command --tokenizer none``: the prompts are token ids).
2. Idle cost: CPU seconds of the children (``/proc/<pid>/stat``) over ``--idle-s``, per replica.
3. Accuracy under load: open-loop Poisson arrivals at ``--rate`` req/s for ``--load-s`` seconds, spread
   round robin, streaming ``/v1/completions`` with token-id prompts that share prefixes (so both cache
   hits and misses occur). For each request the observed TTFT (send → first SSE event, at the client,
   read with :class:`balancer.upstream.sse.SseEvents`) is compared with the TTFT the replica modelled
   (``GET /admin/requests``).

Figures are provisional on a shared machine; the JSON records every parameter used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from balancer.errors import UpstreamError
from balancer.upstream.sse import SseEvents
from replicas.command import runner
from replicas.emulator import EmulatorSpec, ProcessEmulator, template_config
from replicas.sim.profiles import PROFILES
from replicas.sim.tokenizer import NO_TOKENIZER

MAX_IN_FLIGHT = 1024
"""Cap on concurrent requests from the load generator."""


@dataclass(slots=True)
class Sample:
    replica: str
    observed_s: float | None = None
    headers_s: float | None = None
    request_id: str | None = None
    error: str | None = None


@dataclass(slots=True)
class LoadResult:
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def cpu_per_replica(fleet: ProcessEmulator, seconds: float) -> float:
    """Percent of one core used per replica over ``seconds`` of wall time."""
    before = sum(cpu_seconds(pid) for pid in fleet.pids)
    await asyncio.sleep(seconds)
    used = sum(cpu_seconds(pid) for pid in fleet.pids) - before
    return 100.0 * used / seconds / len(fleet.replicas)


def make_prompt(rng: random.Random, prefixes: list[list[int]], length: int) -> list[int]:
    prefix = rng.choice(prefixes)
    return prefix + [rng.randrange(1000, 100_000) for _ in range(length - len(prefix))]


async def one_request(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, sample: Sample
) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    data = json.dumps(body).encode()  # serialised before the clock starts: client cost, not the replica's
    headers = {"Content-Type": "application/json"}
    started = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", data=data, headers=headers) as response:
            sample.headers_s = time.perf_counter() - started
            if response.status != 200:
                sample.error = f"HTTP {response.status}"
                return
            events = SseEvents()
            async for chunk in response.content.iter_any():
                for event in events.feed(chunk):
                    if event.startswith(b"{") and sample.observed_s is None:
                        sample.observed_s = time.perf_counter() - started
                        sample.request_id = json.loads(event)["id"]
    except (aiohttp.ClientError, TimeoutError, UpstreamError) as exc:
        sample.error = type(exc).__name__


async def run_load(replicas: list[dict[str, Any]], args: argparse.Namespace) -> LoadResult:
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(1000, 100_000) for _ in range(args.shared_tokens)] for _ in range(args.prefixes)
    ]
    result = LoadResult()
    tasks: set[asyncio.Task[None]] = set()
    limit = asyncio.Semaphore(MAX_IN_FLIGHT)
    connector = aiohttp.TCPConnector(limit=MAX_IN_FLIGHT)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def bounded(url: str, prompt: list[int], sample: Sample) -> None:
            async with limit:
                await one_request(session, url, prompt, args.max_tokens, sample)

        started = time.perf_counter()
        next_at, index = started, 0
        while next_at - started < args.load_s:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            replica = replicas[index % len(replicas)]
            sample = Sample(replica["name"])
            result.samples.append(sample)
            prompt = make_prompt(rng, prefixes, args.prompt_tokens)
            task = asyncio.create_task(bounded(replica["url"], prompt, sample))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
            next_at += rng.expovariate(args.rate)
        await asyncio.gather(*tasks)
        result.wall_s = time.perf_counter() - started
    return result


async def modelled_ttfts(replicas: list[dict[str, Any]]) -> dict[str, float]:
    modelled: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for replica in replicas:
            async with session.get(replica["url"] + "/admin/requests", params={"clear": "1"}) as response:
                for record in await response.json():
                    if record["modelled_ttft_s"] is not None:
                        modelled[record["id"]] = record["modelled_ttft_s"]
    return modelled


def quantiles_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {
        "p50": pick(0.5),
        "p90": pick(0.9),
        "p99": pick(0.99),
        "mean": round(1000 * statistics.fmean(values), 2),
    }


def accuracy(result: LoadResult, modelled: dict[str, float]) -> dict[str, Any]:
    pairs = [
        (s.observed_s, modelled[s.request_id])
        for s in result.samples
        if s.observed_s is not None and s.request_id in modelled
    ]
    relative = sorted(abs(obs - mod) / mod for obs, mod in pairs if mod > 0)
    excess = [obs - mod for obs, mod in pairs]
    errors = [s.error for s in result.samples if s.error]
    return {
        "requests": len(result.samples),
        "completed_with_ttft": len(pairs),
        "errors": len(errors),
        "achieved_rps": round(len(result.samples) / result.wall_s, 2) if result.wall_s else 0.0,
        "ttft_observed_ms": quantiles_ms([obs for obs, _ in pairs]),
        "ttft_modelled_ms": quantiles_ms([mod for _, mod in pairs]),
        "observed_minus_modelled_ms": quantiles_ms(excess),
        "time_to_response_headers_ms": quantiles_ms([s.headers_s for s in result.samples if s.headers_s]),
        "relative_error": {
            "p50": round(relative[len(relative) // 2], 4) if relative else None,
            "p90": round(relative[int(0.9 * len(relative))], 4) if relative else None,
            "mean": round(statistics.fmean(relative), 4) if relative else None,
        },
        "fraction_within_10pct": round(sum(r <= 0.10 for r in relative) / len(relative), 4)
        if relative
        else None,
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    template = template_config(profile=args.profile, time_scale=args.time_scale)
    passthrough = ["--profile", args.profile, "--time-scale", str(args.time_scale)]
    if args.no_uvloop:
        passthrough.append("--no-uvloop")
    spec = EmulatorSpec(
        replicas=args.replicas,
        engine=args.engine,
        template=template,
        tokenizer=NO_TOKENIZER,
        extra_args=tuple(passthrough),
    )
    fleet = ProcessEmulator(spec, args.processes)
    try:
        await fleet.start()
        await asyncio.sleep(args.settle_s)
        idle = await cpu_per_replica(fleet, args.idle_s)
        busy_before = sum(cpu_seconds(pid) for pid in fleet.pids)
        load = await run_load(fleet.replicas, args)
        busy = sum(cpu_seconds(pid) for pid in fleet.pids) - busy_before
        report = accuracy(load, await modelled_ttfts(fleet.replicas))
        report["replica_cpu_pct_per_replica"] = round(100.0 * busy / load.wall_s / len(fleet.replicas), 2)
    finally:
        await fleet.stop()
    return {
        "command": " ".join([sys.executable, "-m", "loadtests.emulator_measure", *sys.argv[1:]]),
        "replicas": args.replicas,
        "processes": fleet.processes,
        "engine": args.engine,
        "profile": args.profile,
        "time_scale": args.time_scale,
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "idle_s": args.idle_s,
        "idle_cpu_pct_per_replica": round(idle, 3),
        "load": {
            "rate_rps": args.rate,
            "duration_s": args.load_s,
            "prompt_tokens": args.prompt_tokens,
            "shared_prefix_tokens": args.shared_tokens,
            "prefixes": args.prefixes,
            "max_tokens": args.max_tokens,
            **report,
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtests.emulator_measure", description=__doc__)
    add = parser.add_argument
    add("--replicas", type=int, default=8)
    add("--processes", type=int, default=2)
    add("--engine", choices=("sglang", "trtllm", "mixed"), default="sglang")
    add("--profile", choices=sorted(PROFILES), default="h100-llama3-8b")
    add("--time-scale", type=float, default=1.0)
    add("--settle-s", type=float, default=2.0, help="wait after start-up before measuring")
    add("--idle-s", type=float, default=10.0)
    add("--rate", type=float, default=50.0, help="requests per second, over the whole fleet")
    add("--load-s", type=float, default=20.0)
    add("--prompt-tokens", type=int, default=1024)
    add("--shared-tokens", type=int, default=768, help="tokens of the shared prefix of every prompt")
    add("--prefixes", type=int, default=16, help="distinct shared prefixes")
    add("--max-tokens", type=int, default=16)
    add("--seed", type=int, default=0)
    add("--no-uvloop", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {}

    async def run() -> None:
        report.update(await measure(args))

    runner(not args.no_uvloop)(run())  # the load generator uses uvloop too, unless told not to
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
