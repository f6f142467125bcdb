"""``kvlb bench flood``: one engine floods kvlb with KV events; what does the other pool feel? (I/O)

Reproduces the incident of issue #16: one SGLang engine published 3,000 batches × 1,000
``BlockStored`` in 0.1 s. The bench runs ``kvlb serve`` (``--workers``, default 1) with two pools in
front of the fake upstream of ``kvlb bench overhead``:

* ``flooded``: one replica whose ZMQ events come from this process (a PUB with no high-water mark,
  so every batch reaches kvlb: the worst case);
* ``other``: one replica without events, to which ``clients`` clients send token-id completions
  back to back while a prober GETs ``/healthz`` every ``health_period_s``.

First a warm-up of the same load, until the other pool's decision ring
(``console.decision_ring_size`` decisions, 10,000 by default) is full or ``warmup_s`` passed: the
console keeps every committed decision up to that bound, so an empty server grows by tens of MB in
its first seconds of load whether or not anything floods it; the RSS the flood is compared with is
that of the server in its steady state. Then two phases of the same load, one after the other:
``baseline`` (no flood) and ``flood`` (the flood published ``flood_delay_s`` into the phase; the
phase lasts until kvlb took every batch off its queues, at least ``phase_s``, at most
``flood_timeout_s``). Reported: per phase the other pool's request p50/p99 and ``/healthz`` p50/p99
and the ratios flood ÷ baseline (targets ≤ 2), kvlb's RSS (summed over its processes: supervisor and
workers) before the warm-up (``rss_idle_mb``), before the baseline phase, at its peak and
``settle_s`` after the flood, the flood's own figures (publish time, batches, events, overflows,
resyncs and messages shed from ``/metrics``, read after the engine's next batch: a flood dropped with
the SUB is counted as shed when that batch's seq shows how many went), and the Redis leases lost
(``kvlb_redis_lease_events_total{event="lost"}``; ``null`` in the embedded mode it runs by default:
there are no leases to lose; ``--redis`` runs kvlb in fleet mode with a ``redis-server`` of its
own).

Prints the JSON report (``--json``) or a table then the JSON. ``--smoke`` is a tiny run for CI (a
test runs it and asserts no timing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml
import zmq

from loadtests.bench.command import print_report
from loadtests.bench.overhead.report import metric_value
from loadtests.bench.redis_bench import _wait_up, start_redis
from loadtests.fleet.child_process import Child, python_module, spawn, stop_all
from loadtests.stats import percentile
from replicas.wire.sglang import KvEventEncoder

TARGETS = {"p99_ratio_max": 2.0, "leases_lost": 0, "rss_settled_ratio_max": 1.2}
"""The issue's targets: p99s ≤ 2× the run without the flood, no lease lost, RSS within 20%."""
BLOCK_SIZE = 16
PROMPT_TOKENS = 512


@dataclass(frozen=True, slots=True)
class FloodShape:
    """Sizes of one run."""

    batches: int = 3000
    """Batches the flooding engine publishes."""
    events_per_batch: int = 1000
    """``BlockStored`` events per batch (one block each, chained)."""
    distinct_payloads: int = 16
    """Distinct batch payloads, published in turn (encoding 3,000 unique batches takes minutes)."""
    clients: int = 4
    """Clients sending back-to-back requests to the other pool."""
    health_period_s: float = 0.02
    """Pause between two ``/healthz`` probes (seconds)."""
    phase_s: float = 10.0
    """Shortest phase (seconds)."""
    warmup_s: float = 40.0
    """Longest warm-up (seconds): the load runs until the other pool's decision ring is full."""
    flood_delay_s: float = 1.0
    """When, into the flood phase, the flood starts (seconds)."""
    flood_timeout_s: float = 120.0
    """Longest flood phase (seconds): the queues must be empty by then."""
    settle_s: float = 30.0
    """RSS is read this long after the flood phase (seconds)."""
    workers: int = 1
    """``kvlb serve --workers``."""
    redis: bool = False
    """Fleet mode: kvlb with its own ``redis-server`` (then leases can be lost)."""


SMOKE = FloodShape(
    batches=60, events_per_batch=100, distinct_payloads=2, clients=2, phase_s=1.5, warmup_s=0.5,
    flood_delay_s=0.3,
    flood_timeout_s=30.0, settle_s=0.5,
)  # fmt: skip


def encode_payloads(shape: FloodShape) -> list[bytes]:
    """``distinct_payloads`` msgpack batches of ``events_per_batch`` chained one-block stores."""
    encoder = KvEventEncoder()
    payloads = []
    for index in range(shape.distinct_payloads):
        events = []
        parent = None
        base = (index + 1) * 10_000_000
        for i in range(shape.events_per_batch):
            tokens = [(base + i * BLOCK_SIZE + t) % 100_000 for t in range(BLOCK_SIZE)]
            block_hash = base + i
            events.append(encoder.block_stored([block_hash], parent, tokens, BLOCK_SIZE))
            parent = block_hash
        payloads.append(encoder.batch(time.time(), events, 0))
    return payloads


def kvlb_config(upstream_urls: list[str], events_port: int, redis_url: str | None = None) -> dict[str, Any]:
    return {
        **({"redis": {"url": redis_url}} if redis_url else {}),
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {
                "model": "flooded",
                "replicas": [
                    {
                        "id": "flood-0",
                        "url": upstream_urls[0],
                        "engine": "sglang",
                        "block_size": BLOCK_SIZE,
                        "events": f"tcp://127.0.0.1:{events_port}",
                    }
                ],
            },
            {
                "model": "other",
                "replicas": [
                    {"id": "other-0", "url": upstream_urls[-1], "engine": "sglang", "block_size": BLOCK_SIZE}
                ],
            },
        ],
        "scrape_interval_s": 0,
        "health_interval_s": 0.5,
        "log_level": "WARNING",
    }


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its children (kvlb's supervisor and workers), from ``/proc``."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rpartition(")")[2].split()
            if int(entry.name) != pid and int(stat[1]) != pid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


class Load:
    """The other pool's clients and the ``/healthz`` prober, recording (start time, latency)."""

    def __init__(self, url: str, shape: FloodShape) -> None:
        self.url = url
        self.shape = shape
        self.requests: list[tuple[float, float]] = []
        self.health: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self._stop = asyncio.Event()

    async def run(self, session: aiohttp.ClientSession) -> None:
        async with asyncio.TaskGroup() as group:
            for index in range(self.shape.clients):
                group.create_task(self._client(session, index))
            group.create_task(self._prober(session))

    def stop(self) -> None:
        self._stop.set()

    async def _client(self, session: aiohttp.ClientSession, index: int) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            prompt = [(index * 7919 + count * 31 + t) % 50_000 for t in range(PROMPT_TOKENS)]
            body = {"model": "other", "prompt": prompt, "max_tokens": 2, "stream": True}
            started = time.perf_counter()
            try:
                async with session.post(self.url + "/v1/completions", json=body) as response:
                    data = await response.read()
                    if response.status != 200:
                        self.errors.append(f"{response.status}: {data[:200]!r}")
            except aiohttp.ClientError as exc:
                self.errors.append(repr(exc))
            self.requests.append((started, time.perf_counter() - started))

    async def _prober(self, session: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                async with session.get(self.url + "/healthz") as response:
                    await response.read()
                    if response.status != 200:
                        self.errors.append(f"healthz {response.status}")
            except aiohttp.ClientError as exc:
                self.errors.append(f"healthz {exc!r}")
            self.health.append((started, time.perf_counter() - started))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.shape.health_period_s)


def latency_ms(samples: list[tuple[float, float]], since: float = 0.0) -> dict[str, Any]:
    values = [latency for started, latency in samples if started >= since]
    p50, p99 = percentile(values, 50), percentile(values, 99)
    return {
        "count": len(values),
        "p50_ms": None if p50 is None else round(p50 * 1000, 2),
        "p99_ms": None if p99 is None else round(p99 * 1000, 2),
        "max_ms": round(max(values) * 1000, 2) if values else None,
    }


async def run_phase(
    session: aiohttp.ClientSession,
    url: str,
    shape: FloodShape,
    pid: int,
    flood: Any | None,
) -> dict[str, Any]:
    """One phase of load; with ``flood`` (a coroutine function), the flood starts ``flood_delay_s``
    in and the phase lasts until the queues are empty again (bounded)."""
    load = Load(url, shape)
    runner = asyncio.create_task(load.run(session))
    started = time.perf_counter()
    rss_peak = rss_start = await asyncio.to_thread(tree_rss_bytes, pid)

    async def sample_rss() -> None:
        """RSS every 0.1 s in both phases, read in a thread: a walk of ``/proc`` takes 15-20 ms on
        this machine, and on this loop it delayed the clients it times (in the flood phase only)."""
        nonlocal rss_peak
        while True:
            rss_peak = max(rss_peak, await asyncio.to_thread(tree_rss_bytes, pid))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample_rss())
    flood_info: dict[str, Any] = {}
    try:
        if flood is None:
            await asyncio.sleep(shape.phase_s)
        else:
            await asyncio.sleep(shape.flood_delay_s)
            flood_started = time.perf_counter()
            flood_info = await flood()
            deadline = flood_started + shape.flood_timeout_s
            done_at = None
            while time.perf_counter() < deadline:
                if done_at is None and await _flood_taken(session, url, shape.workers):
                    done_at = time.perf_counter()
                if done_at is not None and time.perf_counter() - started >= shape.phase_s:
                    break
                await asyncio.sleep(0.1)
            flood_info["taken_s"] = None if done_at is None else round(done_at - flood_started, 2)
    finally:
        load.stop()
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        await runner
    rss_peak = max(rss_peak, await asyncio.to_thread(tree_rss_bytes, pid))
    since = started + (shape.flood_delay_s if flood is not None else 0.0)
    return {
        "requests": latency_ms(load.requests, since),
        "healthz": latency_ms(load.health, since),
        "errors": len(load.errors),
        "first_errors": load.errors[:3],
        "rss_start_mb": round(rss_start / 2**20, 1),
        "rss_peak_mb": round(rss_peak / 2**20, 1),
        "wall_s": round(time.perf_counter() - started, 2),
        **({"flood": flood_info} if flood is not None else {}),
    }


async def _flood_taken(session: aiohttp.ClientSession, url: str, workers: int) -> bool:
    """Every worker's flood queue is empty (asked ``4 × workers`` times on fresh connections, so
    each worker very likely answers at least once)."""
    for _ in range(max(1, 4 * workers) if workers > 1 else 1):
        async with aiohttp.ClientSession() as fresh, fresh.get(url + "/admin/replicas") as response:
            views = (await response.json())["replicas"]
        flood = next(v for v in views if v["id"] == "flood-0")
        if (flood["events"] or {}).get("queued_batches", 0):
            return False
    return True


async def measure(shape: FloodShape, log_dir: Path | None = None) -> dict[str, Any]:
    payloads = await asyncio.to_thread(encode_payloads, shape)
    # A plain (blocking) socket driven from worker threads: publishing 437 MiB must not stall this
    # process's event loop, which times the other pool's requests.
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # no high-water mark: every batch reaches kvlb (the worst case)
    pub.setsockopt(zmq.LINGER, 0)
    events_port = pub.bind_to_random_port("tcp://127.0.0.1")
    children: list[Child] = []
    with contextlib.ExitStack() as stack:
        folder = log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvlb-flood-")))
        try:
            module = "loadtests.bench.overhead.servers"
            upstream = await spawn(
                "upstream",
                python_module(module, "upstream", "--ports", "2"),
                folder / "upstream.stderr",
                ready_key="bench_server",
            )
            children.append(upstream)
            config = folder / "kvlb.yaml"
            urls = [str(u) for u in upstream.info["urls"]]
            redis_url = None
            if shape.redis:
                redis_process, redis_url = start_redis()
                stack.callback(redis_process.wait)
                stack.callback(redis_process.kill)
                await _wait_up(redis_url)
            config.write_text(yaml.safe_dump(kvlb_config(urls, events_port, redis_url)))
            argv = python_module(
                "balancer", "serve", "--config", str(config), "--workers", str(shape.workers)
            )
            kvlb = await spawn("kvlb", argv, folder / "kvlb.stderr", ready_key="kvlb")
            children.append(kvlb)
            url = str(kvlb.info["url"])
            seq = 0

            def publish_all(first_seq: int) -> float:
                started = time.perf_counter()
                for index in range(shape.batches):
                    payload = payloads[index % len(payloads)]
                    pub.send_multipart([b"", (first_seq + index).to_bytes(8, "big"), payload], copy=False)
                return time.perf_counter() - started

            async def flood() -> dict[str, Any]:
                nonlocal seq
                publish_s = await asyncio.to_thread(publish_all, seq)
                seq += shape.batches
                return {
                    "batches": shape.batches,
                    "events": shape.batches * shape.events_per_batch,
                    "bytes": sum(len(payloads[i % len(payloads)]) for i in range(shape.batches)),
                    "publish_s": round(publish_s, 3),
                }

            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                await _wait_ready(session, url)
                # one batch first, so the subscription is up before the phases (ZMQ joins lazily)
                await _warm_subscription(session, url, pub, payloads[0], shape.workers, shape.redis)
                seq = 1
                rss_idle = await asyncio.to_thread(tree_rss_bytes, kvlb.pid)
                warmup = await warm_up(session, url, shape)
                baseline = await run_phase(session, url, shape, kvlb.pid, None)
                flooded = await run_phase(session, url, shape, kvlb.pid, flood)
                await asyncio.sleep(shape.settle_s)
                rss_settled = await asyncio.to_thread(tree_rss_bytes, kvlb.pid)
                # The engine's next batch after the flood: a flood dropped with the SUB is counted
                # as shed only when the stream's next seq shows how many went.
                after_flood = await _next_batch_taken(url, pub, payloads[0], seq, shape.workers, shape.redis)
                async with session.get(url + "/metrics") as response:
                    metrics = await response.text()
        finally:
            await stop_all(children)
            pub.close(linger=0)
            ctx.term()
    fleet = "kvlb_redis_lease_events_total{" in metrics
    leases = metric_value(metrics, "kvlb_redis_lease_events_total", event="lost") if fleet else None
    ratios = {
        "requests_p99": _ratio(flooded["requests"]["p99_ms"], baseline["requests"]["p99_ms"]),
        "healthz_p99": _ratio(flooded["healthz"]["p99_ms"], baseline["healthz"]["p99_ms"]),
        "rss_settled_vs_baseline": _ratio(rss_settled / 2**20, baseline["rss_start_mb"]),
        "rss_settled_vs_idle": _ratio(rss_settled, rss_idle),
    }
    return {
        "shape": asdict(shape),
        "targets": TARGETS,
        "machine": {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]},
        "rss_idle_mb": round(rss_idle / 2**20, 1),
        "warmup": warmup,
        "baseline": baseline,
        "flood": flooded,
        "rss_settled_mb": round(rss_settled / 2**20, 1),
        "decision_ring_entries": metric_value(metrics, "kvlb_console_ring_entries", pool="other"),
        "ratios": ratios,
        "leases_lost": leases,
        "after_flood_batch_taken": after_flood,
        "kvlb_events": {
            "queue_overflows": metric_value(metrics, "kvlb_events_queue_overflow_total"),
            "resyncs": metric_value(metrics, "kvlb_events_resyncs_total"),
            "stored_blocks_applied": metric_value(
                metrics, "kvlb_events_applied_total", type="stored", status="applied"
            ),
            "seq_gaps": metric_value(metrics, "kvlb_events_seq_gaps_total"),
            "shed_messages": metric_value(metrics, "kvlb_events_shed_total"),
        },
    }


async def warm_up(session: aiohttp.ClientSession, url: str, shape: FloodShape) -> dict[str, Any]:
    """The phases' load until the other pool's decision ring evicted its first decision (it is full)
    or ``warmup_s`` passed; returns its wall time, requests and whether the ring filled."""
    load = Load(url, shape)
    runner = asyncio.create_task(load.run(session))
    started = time.perf_counter()
    full = False
    try:
        while not full and time.perf_counter() - started < shape.warmup_s:
            await asyncio.sleep(0.5)
            async with session.get(url + "/metrics") as response:
                full = (
                    metric_value(await response.text(), "kvlb_console_ring_evicted_total", pool="other") > 0
                )
    finally:
        load.stop()
        await runner
    return {
        "wall_s": round(time.perf_counter() - started, 2),
        "requests": len(load.requests),
        "errors": len(load.errors),
        "ring_full": full,
    }


async def _wait_ready(session: aiohttp.ClientSession, url: str) -> None:
    async with asyncio.timeout(60):
        while True:
            async with session.get(url + "/readyz") as response:
                if response.status == 200:
                    return
            await asyncio.sleep(0.05)


async def _warm_subscription(
    session: aiohttp.ClientSession,
    url: str,
    pub: zmq.Socket[bytes],
    payload: bytes,
    workers: int,
    fleet: bool,
) -> None:
    """Publish batch 0 until every worker shows the replica's first message (bounded). In fleet mode
    only the worker holding the replica's lease subscribes: one answer showing it is enough."""
    frames = [b"", (0).to_bytes(8, "big"), payload]
    async with asyncio.timeout(30):
        while True:
            await asyncio.to_thread(pub.send_multipart, frames)
            await asyncio.sleep(0.2)
            seen = 0
            for _ in range(4 * workers):
                async with aiohttp.ClientSession() as fresh, fresh.get(url + "/admin/replicas") as response:
                    views = (await response.json())["replicas"]
                flood = next(v for v in views if v["id"] == "flood-0")
                sources = (flood["events"] or {}).get("sources", [])
                seen += bool(sources and sources[0]["messages"] > 0)
            if seen == 4 * workers or (fleet and seen):
                return


async def _next_batch_taken(
    url: str, pub: zmq.Socket[bytes], payload: bytes, seq: int, workers: int, fleet: bool
) -> bool:
    """Publish batch ``seq`` (the one after the flood) and wait (bounded: 10 s) until every worker's
    source (in fleet mode: the lease holder's) took it in order; ``False`` if none did in time. Each
    look at ``/admin/replicas`` is a new connection, so the kernel's port sharing reaches every worker
    (four looks per worker)."""
    await asyncio.to_thread(pub.send_multipart, [b"", seq.to_bytes(8, "big"), payload])
    looks = 4 * workers if workers > 1 else 1
    deadline = time.perf_counter() + 10.0
    while time.perf_counter() < deadline:
        await asyncio.sleep(0.2)
        taken = 0
        for _ in range(looks):
            async with aiohttp.ClientSession() as fresh, fresh.get(url + "/admin/replicas") as response:
                views = (await response.json())["replicas"]
            flood = next(v for v in views if v["id"] == "flood-0")
            sources = (flood["events"] or {}).get("sources", [])
            taken += bool(sources and (sources[0]["last_seq"] or -1) >= seq)
        if taken == looks or (fleet and taken):
            return True
    return False


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def format_report(report: dict[str, Any]) -> str:
    shape, base, flood = report["shape"], report["baseline"], report["flood"]
    info = flood.get("flood", {})
    lines = [
        f"kvlb bench flood: {shape['batches']:,} batches × {shape['events_per_batch']:,} BlockStored "
        f"published in {info.get('publish_s')} s ({info.get('bytes', 0) / 2**20:,.0f} MiB), kvlb --workers "
        f"{shape['workers']}, taken off the queues {info.get('taken_s')} s after the start",
        f"{'other pool, during the phase':<34}{'baseline':>12}{'flood':>12}{'ratio':>8}{'target':>8}",
    ]
    for label, key, ratio in (
        ("request p50, ms", ("requests", "p50_ms"), None),
        ("request p99, ms", ("requests", "p99_ms"), "requests_p99"),
        ("/healthz p50, ms", ("healthz", "p50_ms"), None),
        ("/healthz p99, ms", ("healthz", "p99_ms"), "healthz_p99"),
    ):
        a, b = base[key[0]][key[1]], flood[key[0]][key[1]]
        r = report["ratios"].get(ratio) if ratio else None
        target = f"≤ {TARGETS['p99_ratio_max']}" if ratio else ""
        lines.append(f"{label:<34}{a!s:>12}{b!s:>12}{r if r is not None else '':>8}{target:>8}")
    lines.append(f"{'errors':<34}{base['errors']:>12}{flood['errors']:>12}")
    warmup = report["warmup"]
    lines.append(
        f"RSS MB: idle {report['rss_idle_mb']}, after the warm-up ({warmup['requests']:,} requests in "
        f"{warmup['wall_s']} s, decision ring full: {warmup['ring_full']}) {base['rss_start_mb']}, "
        f"flood peak {flood['rss_peak_mb']}, {shape['settle_s']:.0f} s after {report['rss_settled_mb']} "
        f"(× {report['ratios']['rss_settled_vs_baseline']}, target ≤ {TARGETS['rss_settled_ratio_max']}; "
        f"× {report['ratios']['rss_settled_vs_idle']} the idle server)"
    )
    events = report["kvlb_events"]
    lines.append(
        f"kvlb: {events['stored_blocks_applied']:,.0f} blocks applied, {events['queue_overflows']:.0f} queue "
        f"overflows, {events['shed_messages']:,.0f} messages shed undecoded, "
        f"{events['resyncs']:.0f} resyncs, "
        f"{events['seq_gaps']:.0f} gaps; leases lost: "
        f"{report['leases_lost']}" + (" (embedded: none held)" if report["leases_lost"] is None else "")
    )
    return "\n".join(lines)


def add_parser(kinds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``kvlb bench flood`` (called by :mod:`loadtests.bench.command`)."""
    parser = kinds.add_parser(
        "flood", help="one engine floods kvlb with events: the other pool's p99 and RSS"
    )
    parser.add_argument("--json", action="store_true", help="print the JSON report only")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (seconds), for CI")
    parser.add_argument("--workers", type=int, default=1, help="kvlb serve --workers (default 1)")
    parser.add_argument("--redis", action="store_true", help="fleet mode, with its own redis-server")
    parser.add_argument(
        "--settle-s", type=float, default=None, help="RSS read this long after the flood (30)"
    )
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    shape = replace(SMOKE if args.smoke else FloodShape(), workers=args.workers, redis=args.redis)
    if args.settle_s is not None:
        shape = replace(shape, settle_s=args.settle_s)
    return print_report(asyncio.run(measure(shape)), format_report, json_only=args.json)
