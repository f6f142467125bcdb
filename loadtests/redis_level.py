"""``python -m loadtests.redis_level``: Redis's memory under a real ``kvlb serve`` churn, run to its
level (I/O: starts its own ``redis-server`` on a free 127.0.0.1 port, an emulated fleet and two
``kvlb serve`` processes, and stops them all by pid).

docs/reliability.md's open point (the stream's byte bound, h-streambytes) measured the level on
``RedisIndex`` alone; this is the same question asked of the real thing. Two ``kvlb serve`` processes
(fleet mode, one key space, each with its mirror tailing the stream, snapshots every
``--snapshot-interval-s``, ingestion leases shared out between them) front ``--replicas`` emulated
SGLang engines (``kvlb emulate`` children, a KV pool of ``--kv-capacity-tokens`` so their caches
churn: every request stores new blocks and evicts old ones). ``--clients`` clients send token-id
completions of ``--prompt-tokens`` random ids (so each stream entry is about 4 B a token plus about
20 B a block), alternating between the two balancers, for ``--duration-s``; the stream is bounded by
``--stream-max-bytes`` (and ``--stream-maxlen``), small so the level comes within a few minutes.

Every ``--sample-s`` it reads Redis's ``INFO memory`` (``used_memory``), ``DBSIZE``, ``XLEN``,
``MEMORY USAGE`` of the stream and of its sizes list, the bytes of the retained entries' fields (what
the bound counts, read with ``XRANGE``), both balancers' RSS (process tree, ``/proc``) and, from their
``/metrics``: mirror rebuilds (``kvlb_redis_mirror_resyncs_total``), partial mirrors
(``kvlb_redis_mirror_partial``), skipped entries, entries trimmed for bytes, snapshots written and
loaded, leases lost, Redis errors. *Flat* means the last ``--flat-samples`` samples of
``used_memory`` lie within ``--flat-pct`` % of their median. Prints a table, then the JSON report.
``--smoke`` is a tiny run for the test (:data:`SMOKE`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import yaml

from loadtests.bench.flood import tree_rss_bytes
from loadtests.bench.overhead.report import metric_value
from loadtests.bench.redis_bench import _wait_up, start_redis
from loadtests.fleet.child_process import Child, spawn, stop_all
from loadtests.fleet.processes import EmulatorOptions, kvlb_config, start_emulator

MIB = 1 << 20
START_TIMEOUT_S = 90.0
HTTP_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class LevelShape:
    """One run's sizes."""

    duration_s: float = 300.0
    """How long the clients send (seconds)."""
    sample_s: float = 5.0
    """Pause between two samples (seconds)."""
    stream_max_bytes: int = 2 * MIB
    """``redis.stream_max_bytes`` of both balancers (bytes, at least 1 MiB); 0 leaves the setting out
    (what a tree before h-streambytes runs, which has no such setting)."""
    stream_maxlen: int = 10_000
    """``redis.stream_maxlen`` of both balancers (entries)."""
    snapshot_interval_s: float = 10.0
    """``redis.snapshot_interval_s`` (seconds)."""
    prompt_tokens: int = 1024
    """Random token ids per completion (the size of a stream entry: about 4 B a token)."""
    clients: int = 4
    """Clients sending back to back, alternating between the balancers."""
    replicas: int = 2
    """Emulated SGLang engines."""
    kv_capacity_tokens: int = 16_384
    """Each engine's KV pool (tokens): small, so the caches churn."""
    time_scale: float = 20.0
    """The emulator's speed-up."""
    flat_samples: int = 12
    """Samples the flatness is judged on (the last ones)."""
    flat_pct: float = 5.0
    """Largest spread of those samples around their median (%) that counts as flat."""
    seed: int = 7
    """Seed of the clients' token ids."""


SMOKE = LevelShape(duration_s=8.0, sample_s=1.0, stream_max_bytes=MIB, prompt_tokens=4096, clients=3,
                   flat_samples=3, flat_pct=100.0, snapshot_interval_s=1.0)  # fmt: skip
"""The test's run: 1 MiB of stream holds about 35 entries of 4,096 tokens, passed within seconds."""


def balancer_config(template: dict[str, Any], redis_url: str, shape: LevelShape) -> dict[str, Any]:
    """One balancer's settings: the load test's pool plus fleet mode on ``redis_url``."""
    return {
        **template,
        "redis": {
            "url": redis_url,
            **({"stream_max_bytes": shape.stream_max_bytes} if shape.stream_max_bytes else {}),
            "stream_maxlen": shape.stream_maxlen,
            "snapshot_interval_s": shape.snapshot_interval_s,
        },
        "scrape_interval_s": 0,
        "log_level": "WARNING",
    }


class Clients:
    """Back-to-back token-id completions of fresh random prompts, counting answers by status."""

    def __init__(self, urls: Sequence[str], model: str, shape: LevelShape) -> None:
        self.urls = list(urls)
        self.model = model
        self.shape = shape
        self.statuses: dict[str, int] = {}
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self, session: aiohttp.ClientSession) -> None:
        async with asyncio.TaskGroup() as group:
            for index in range(self.shape.clients):
                group.create_task(self._client(session, index))

    async def _client(self, session: aiohttp.ClientSession, index: int) -> None:
        rng = random.Random(self.shape.seed * 1000 + index)
        count = 0
        while not self._stop.is_set():
            url = self.urls[(index + count) % len(self.urls)]
            count += 1
            prompt = [rng.randrange(1, 50_000) for _ in range(self.shape.prompt_tokens)]
            body = {"model": self.model, "prompt": prompt, "max_tokens": 1}
            try:
                async with session.post(url + "/v1/completions", json=body) as response:
                    await response.read()
                    key = str(response.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                key = type(exc).__name__
            self.statuses[key] = self.statuses.get(key, 0) + 1


async def stream_keys(client: Any) -> tuple[str, str]:
    """The key space's stream and sizes list (found by name: one key space in this run)."""
    async for key in client.scan_iter(match="*:events", count=1000):
        name = key.decode() if isinstance(key, bytes) else str(key)
        return name, name[: -len("events")] + "evbytes"
    return "", ""


async def sample_redis(client: Any, stream: str, sizes: str) -> dict[str, Any]:
    info = await client.info("memory")
    entries: list[tuple[bytes, dict[bytes, bytes]]] = await client.xrange(stream) if stream else []
    field_bytes = sum(len(k) + len(v) for _id, fields in entries for k, v in fields.items())
    counters = await client.hgetall(stream[: -len("events")] + "ctr") if stream else {}
    return {
        "used_memory_mb": round(int(info["used_memory"]) / 1e6, 3),
        "dbsize": await client.dbsize(),
        "xlen": len(entries),
        "stream_mb": round((await client.memory_usage(stream, samples=0) or 0) / 1e6, 3) if stream else 0.0,
        "sizes_list_mb": round((await client.memory_usage(sizes, samples=0) or 0) / 1e6, 3)
        if stream
        else 0.0,
        "fields_mb": round(field_bytes / 1e6, 3),
        "entry_bytes": round(field_bytes / len(entries)) if entries else 0,
        "stream_entries": int(counters.get(b"stream_entries", 0)),
        "byte_trims": int(counters.get(b"stream_byte_trims", 0)),
    }


MIRROR_FIGURES = {
    "resyncs": ("kvlb_redis_mirror_resyncs_total", {}),
    "partial": ("kvlb_redis_mirror_partial", {}),
    "skipped": ("kvlb_redis_mirror_skipped_entries_total", {}),
    "applied": ("kvlb_redis_mirror_entries_total", {}),
    "byte_trimmed": ("kvlb_redis_stream_byte_trimmed_entries_total", {}),
    "snapshots_written": ("kvlb_redis_snapshots_total", {"op": "write"}),
    "snapshots_loaded": ("kvlb_redis_snapshots_total", {"op": "load"}),
    "leases_lost": ("kvlb_redis_lease_events_total", {"event": "lost"}),
    "redis_errors": ("kvlb_redis_errors_total", {}),
}
"""What each balancer's ``/metrics`` says of its mirror and the stream: name → (metric, labels)."""


async def sample_balancer(session: aiohttp.ClientSession, url: str, child: Child) -> dict[str, Any]:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    figures: dict[str, Any] = {
        name: int(metric_value(text, metric, **labels)) for name, (metric, labels) in MIRROR_FIGURES.items()
    }
    figures["rss_mb"] = round(await asyncio.to_thread(tree_rss_bytes, child.pid) / 1e6, 1)
    return figures


def flatness(values: Sequence[float], shape: LevelShape) -> dict[str, Any]:
    """Whether the last ``flat_samples`` values lie within ``flat_pct`` % of their median."""
    tail = list(values[-shape.flat_samples :])
    if len(tail) < shape.flat_samples:
        return {"flat": False, "median": None, "spread_pct": None, "samples": len(tail)}
    median = statistics.median(tail)
    spread = max(abs(v - median) for v in tail) / median * 100 if median else 0.0
    return {
        "flat": spread <= shape.flat_pct,
        "median": median,
        "spread_pct": round(spread, 2),
        "samples": len(tail),
    }


async def run(shape: LevelShape, logs: Path) -> dict[str, Any]:
    started_utc = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_start = os.getloadavg()
    redis_process, redis_url = start_redis()
    children: list[Child] = []
    fleet = None
    client = aioredis.Redis.from_url(redis_url)
    try:
        await _wait_up(redis_url)
        fleet = await start_emulator(
            EmulatorOptions(
                replicas=shape.replicas, processes=1, kv_capacity_tokens=shape.kv_capacity_tokens,
                time_scale=shape.time_scale,
            ),
            logs,
        )  # fmt: skip
        config = balancer_config(kvlb_config(fleet, "cost", shape.seed), redis_url, shape)
        urls = []
        for index in range(2):
            path = logs / f"kvlb-{index}.yaml"
            path.write_text(yaml.safe_dump(config))
            argv = [sys.executable, "-m", "balancer", "serve", "--config", str(path), "--workers", "1"]
            child = await spawn(
                f"kvlb-{index}",
                argv,
                logs / f"kvlb-{index}.log",
                ready_key="serving",
                timeout_s=START_TIMEOUT_S,
            )
            children.append(child)
            urls.append(str(child.info["url"]))
        timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            clients = Clients(urls, fleet.model, shape)
            load = asyncio.create_task(clients.run(session))
            samples: list[dict[str, Any]] = []
            began = time.monotonic()
            stream = sizes = ""
            try:
                while (elapsed := time.monotonic() - began) < shape.duration_s:
                    await asyncio.sleep(min(shape.sample_s, max(0.0, shape.duration_s - elapsed)))
                    if not stream:
                        stream, sizes = await stream_keys(client)
                    sample: dict[str, Any] = {"t_s": round(time.monotonic() - began, 1)}
                    sample.update(await sample_redis(client, stream, sizes))
                    for index, (url, child) in enumerate(zip(urls, children, strict=True)):
                        for name, value in (await sample_balancer(session, url, child)).items():
                            sample[f"b{index}_{name}"] = value
                    samples.append(sample)
            finally:
                clients.stop()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait_for(load, HTTP_TIMEOUT_S)
        return report(shape, samples, clients.statuses, started_utc, load_start)
    finally:
        await client.aclose()
        await stop_all(children)
        if fleet is not None:
            await fleet.stop()
        redis_process.kill()
        redis_process.wait()


def report(
    shape: LevelShape,
    samples: list[dict[str, Any]],
    statuses: dict[str, int],
    started_utc: str,
    load_start: tuple[float, float, float],
) -> dict[str, Any]:
    last = samples[-1] if samples else {}
    level = flatness([s["used_memory_mb"] for s in samples], shape)
    stream_level = flatness([s["stream_mb"] for s in samples], shape)
    bound_mb = (shape.stream_max_bytes or 64 * MIB) / 1e6
    mirrors = {
        f"b{index}": {
            name: max((s[f"b{index}_{name}"] for s in samples), default=0) for name in MIRROR_FIGURES
        }
        for index in range(2)
    }
    return {
        "started": started_utc,
        "load_at_start": [round(x, 2) for x in load_start],
        "load_at_end": [round(x, 2) for x in os.getloadavg()],
        "command": " ".join(sys.argv),
        "shape": asdict(shape),
        "requests": statuses,
        "used_memory": level,
        "stream_memory": stream_level,
        "stream_mb_max": max((s["stream_mb"] for s in samples), default=0.0),
        "fields_mb_max": max((s["fields_mb"] for s in samples), default=0.0),
        "bound_mb": round(bound_mb, 3),
        "stream_over_bound": round(last.get("stream_mb", 0.0) / bound_mb, 3),
        "stream_plus_sizes_over_bound": round(
            (last.get("stream_mb", 0.0) + last.get("sizes_list_mb", 0.0)) / bound_mb, 3
        ),
        "stream_over_fields": round(last["stream_mb"] / last["fields_mb"], 3)
        if last.get("fields_mb")
        else None,
        "entry_bytes": last.get("entry_bytes", 0),
        "mirrors": mirrors,
        "samples": samples,
    }


COLUMNS = (
    "t_s", "used_memory_mb", "dbsize", "xlen", "stream_mb", "sizes_list_mb", "fields_mb", "entry_bytes",
    "byte_trims", "b0_rss_mb", "b1_rss_mb", "b0_resyncs", "b1_resyncs", "b0_partial", "b1_partial",
    "b0_snapshots_written", "b1_snapshots_written",
)  # fmt: skip


def table(result: dict[str, Any]) -> str:
    lines = [" ".join(f"{c:>12}" for c in COLUMNS)]
    for sample in result["samples"]:
        lines.append(" ".join(f"{sample.get(c, ''):>12}" for c in COLUMNS))
    lines.append(
        f"used_memory {result['used_memory']}; stream {result['stream_memory']}; stream / bound"
        f" {result['stream_over_bound']}, stream / fields {result['stream_over_fields']}, entry"
        f" {result['entry_bytes']} B; requests {result['requests']}; mirrors {result['mirrors']}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.redis_level", description=__doc__.split("\n\n")[0]
    )
    defaults = LevelShape()
    for name, value in asdict(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    parser.add_argument("--smoke", action="store_true", help="a tiny run (the test's)")
    parser.add_argument("--json", action="store_true", help="the JSON report only")
    parser.add_argument(
        "--logs", type=Path, default=None, help="folder for the children's logs (default: temporary)"
    )
    args = parser.parse_args(argv)
    given = {name: getattr(args, name) for name in asdict(defaults)}
    shape = SMOKE if args.smoke else replace(defaults, **given)
    with tempfile.TemporaryDirectory(prefix="kvlb-level-") as folder:
        logs = args.logs or Path(folder)
        logs.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run(shape, logs))
    if not args.json:
        print(table(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
