"""``kvlb bench overhead``: the latency kvlb adds to a request and the CPU it spends per request (I/O).

Three paths (five with sglang-router) to one minimal fast fake engine
(:mod:`loadtests.bench.overhead.servers`), measured side by side in one run, interleaved so that a
noisy shared machine slows them alike, in three phases:

* ``sequential``: one request at a time, each path taking a block of requests back to back, the paths
  rotating block by block (one request per path in turn would make every path idle through the
  slowest path's latency, and on a VM an idle process runs its next request several times slower);
* ``spaced``: one request at a time after an idle gap (``spaced_gap_ms``), the paths rotating request by
  request: low-rate traffic, where every process starts each request cold;
* ``concurrent``: bursts of ``concurrency`` clients, one path at a time, the paths rotating by burst.

The paths:

* ``direct``: client → fake upstream;
* ``forward``: client → a plain aiohttp forwarding proxy → upstream (the floor of any aiohttp proxy);
* ``kvlb``: client → ``kvlb serve`` (one pool of ``replicas`` replicas, all on the fake upstream, the
  default cost policy, the default DeepSeek-V3 tokenizer) → upstream;
* ``sglang_cache_aware`` and ``sglang_round_robin``: client → sglang-router with that ``--policy`` (its
  defaults otherwise; it does not tokenize: its cache tree holds the request text) → the same
  ``replicas`` upstream URLs, for the chat kinds only (its ``/v1/completions`` rejects token ids).
  Measured only when ``sglang-router`` is installed; the report lists the peers it skipped, and
  ``peer_ratios`` sets kvlb's CPU per request against ``sglang_cache_aware``'s.

Every server is its own process; the client runs here. Six prompt kinds are measured, built in
:mod:`loadtests.bench.overhead.workload`:

* ``chat_shared`` (the headline): ``prompt_tokens``-token chats, one of ``prompts`` shared system
  prompts and a user message new in every request, as chat traffic is: kvlb renders and tokenizes
  them, the system prompt from its segment cache;
* ``chat``: the ``prompts`` chats repeated whole (every segment a cache hit after the warm-up);
* ``chat_cold``: system prompt and user message unique per request (no cache hit);
* ``tokens``: the ``chat`` prompts as token ids to ``/v1/completions`` (kvlb's cost without the
  tokenizer), repeated whole: the best case of kvlb's token-id memo;
* ``tokens_shared``: the ``chat_shared`` prompts as token ids (a shared system prompt's ids, then a
  new user message's), as clients that tokenize for themselves send chat traffic.
* ``grpc_tokens``: the ``tokens`` prompts sent to the kvlb paths over gRPC (``Generate`` with
  ``prompt_token_ids``, :mod:`loadtests.bench.overhead.clients`) and to the others as the same HTTP
  bodies: kvlb's cost when it writes the replica's JSON body itself (repeated whole: the memo finds
  every run of their packed ids after the warm-up).

The warm-up sends every distinct prompt at least three times (kvlb's token-id memo holds a prompt
whole from its third sight); the unique kinds never send a body twice to a path (each phase and
round takes bodies no earlier one took). Reported per kind and phase: latency
p50/p90/p99 per path, the added latency of each proxy (its percentile minus the direct path's), req/s,
each proxy process's CPU per request from ``/proc`` (so the rate one fully busy core routes), and the
route-decision time from kvlb's own ``kvlb_route_decision_seconds`` histogram, and the runs of its
token-id memo found, decoded and evicted (``kvlb_tokenizer_token_id_memo_*_total``), and the whole
bodies its body memo found, did not find and evicted (``kvlb_http_body_memo_*_total``: the repeated
kinds' bodies are found from their second sight, so they measure the memo, not a parse). The tokenizer's
time is measured here, on a tokenizer with its segment cache off (every sample a full encode; for
``chat_cold`` also in the ``sequential`` and ``spaced`` phases' own turns, on the same bodies) and for
``chat_shared`` prompts on kvlb's inline path (``encode_chat_if_cached``) once their system prompts
are cached; so is the event loop's longest stall
while four threads tokenize new prompts at once (``tokenize_threads``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.tokenizer import HfTokenizer, TokenizeLimits, Tokenizer
from loadtests.bench.command import print_report
from loadtests.bench.overhead.clients import REQUEST_TIMEOUT_S, BenchError, GrpcClient, Send, send
from loadtests.bench.overhead.machine import idle_penalty
from loadtests.bench.overhead.report import (
    MODES,
    TARGETS,
    added,
    cpu_figures,
    decision_figures,
    format_report,
    histogram_delta,
    latency_figures,
    metric_value,
    own_ratios,
    parse_histogram,
    peer_ratios,
    workers_ratios,
)
from loadtests.bench.overhead.servers import Servers, start_servers
from loadtests.bench.overhead.workload import (
    GRPC_KINDS,
    KIND_DESCRIPTIONS,
    KINDS,
    SMOKE,
    OverheadShape,
    Prompts,
    build_prompts,
)
from loadtests.fleet.child_process import Child, stop_all, tree_cpu_seconds
from loadtests.stats import percentile

__all__ = [
    "KINDS",
    "SMOKE",
    "BenchError",
    "OverheadShape",
    "Prompts",
    "add_parser",
    "bench_tokenizers",
    "build_prompts",
    "measure",
    "run_command",
    "shape_from_args",
]

READY_TIMEOUT_S = 30.0
DECISION_METRIC = "kvlb_route_decision_seconds"
MEMO_COUNTERS = tuple(
    f"kvlb_tokenizer_token_id_memo_{name}_total" for name in ("hits", "misses", "evictions")
)
"""kvlb's token-id memo counters (runs of prompt text found, decoded, forgotten), reported per kind."""
BODY_MEMO_COUNTERS = tuple(f"kvlb_http_body_memo_{name}_total" for name in ("hits", "misses", "evictions"))
"""kvlb's body memo counters (whole HTTP bodies found, not found, forgotten), reported per kind."""


# ------------------------------------------------------------------------------------ processes


async def wait_ready(session: aiohttp.ClientSession, url: str) -> None:
    """Poll ``/readyz`` until 200 (bounded by :data:`READY_TIMEOUT_S`)."""
    async with asyncio.timeout(READY_TIMEOUT_S):
        while True:
            async with session.get(url + "/readyz") as response:
                if response.status == 200:
                    return
            await asyncio.sleep(0.05)


async def scrape_metrics(session: aiohttp.ClientSession, kvlb_url: str) -> str:
    async with session.get(kvlb_url + "/metrics") as response:
        return await response.text()


# ------------------------------------------------------------------------------------- measuring


def _rotated(items: Sequence[str], by: int) -> list[str]:
    shift = by % len(items)
    return [*items[shift:], *items[:shift]]


def kind_modes(servers: Servers, path: str) -> tuple[str, ...]:
    """The paths measured for requests to ``path``: the peers take chats only (sglang-router's
    ``/v1/completions`` rejects token-id prompts with 422)."""
    return servers.modes if path == "/v1/chat/completions" else (*MODES, *servers.workers)


def kind_senders(
    session: aiohttp.ClientSession, servers: Servers, kind: str, path: str, grpc: dict[str, GrpcClient]
) -> dict[str, Send]:
    """How each path of ``kind`` is sent to, in :func:`kind_modes` order: HTTP to ``path``, but over
    gRPC (``grpc``, by kvlb path) to the kvlb paths of a gRPC kind."""
    urls = servers.urls
    senders: dict[str, Send] = {}
    for mode in kind_modes(servers, path):
        client = grpc.get(mode) if kind in GRPC_KINDS else None
        senders[mode] = (
            client.send if client is not None else functools.partial(send, session, urls[mode] + path)
        )
    return senders


LOCAL_MODE = "tokenizer"
"""The pseudo-path of ``chat_cold``'s sequential and spaced phases: the bench process tokenizes the same
body, in the same turn and after the same idle time as the paths' requests (its CPU only)."""

Local = Callable[[bytes], float]
"""Work done here in a path's turn: given the body, the CPU seconds it took."""


def tokenizer_cpu(tokenizer: Tokenizer) -> Local:
    """CPU seconds ``tokenizer`` takes to tokenize a chat body's messages (decoding the body not counted)."""

    def timed(body: bytes) -> float:
        messages = json.loads(body)["messages"]
        started = time.process_time()
        tokenizer.encode_chat(messages)
        return time.process_time() - started

    return timed


class _Turns:
    """One phase's requests, one at a time: latencies per path, each proxy's CPU over the phase, and
    the CPU of the :data:`LOCAL_MODE` pseudo-path when there is one."""

    def __init__(self, senders: dict[str, Send], servers: Servers, local: Local | None) -> None:
        self.senders, self.servers, self.local = senders, servers, local
        self.modes = tuple(senders)
        self.turns = (*self.modes, LOCAL_MODE) if local is not None else self.modes
        self.latencies: dict[str, list[float]] = {mode: [] for mode in self.modes}
        self.local_cpu_s = 0.0
        self.cpu_before: dict[str, float] = {}
        self.started = 0.0

    def start(self) -> None:
        """Start the phase's CPU and wall clocks (after its warm-up)."""
        pids = self.servers.pids
        self.cpu_before = {proxy: tree_cpu_seconds(pids[proxy]) for proxy in self.modes[1:]}
        self.started = time.perf_counter()

    async def take(self, mode: str, body: bytes, counted: bool = True) -> None:
        """One turn of ``mode``: a request (its latency kept when ``counted``) or the local work."""
        if mode == LOCAL_MODE:
            assert self.local is not None
            self.local_cpu_s += self.local(body)
            return
        latency_s = await self.senders[mode](body)
        if counted:
            self.latencies[mode].append(latency_s)

    def figures(self, requests: int) -> dict[str, Any]:
        wall_s = time.perf_counter() - self.started
        by_mode = {mode: latency_figures(self.latencies[mode]) for mode in self.modes}
        pids = self.servers.pids
        cpu = {
            proxy: cpu_figures(requests, tree_cpu_seconds(pids[proxy]) - self.cpu_before[proxy], wall_s)
            for proxy in self.modes[1:]
        }
        if self.local is not None:
            cpu[LOCAL_MODE] = cpu_figures(requests, self.local_cpu_s, wall_s)
        return {"latency": by_mode, "added": added(by_mode), "cpu": cpu}


async def sequential(turns: _Turns, shape: OverheadShape, bodies: Sequence[bytes]) -> dict[str, Any]:
    """One request at a time: after a warm-up interleaved request by request, each path takes
    :attr:`~OverheadShape.sequential_block` requests back to back, the paths rotating block by block
    (every path sends the same bodies); latencies and each proxy's CPU per request."""
    for index in range(shape.warmup):
        for mode in _rotated(turns.modes, index):
            await turns.take(mode, bodies[index % len(bodies)], counted=False)
    turns.start()
    first, block = shape.warmup, shape.sequential_block
    for block_index, offset in enumerate(range(0, shape.sequential_rounds, block)):
        taken = range(first + offset, first + min(offset + block, shape.sequential_rounds))
        for mode in _rotated(turns.turns, block_index):
            for index in taken:
                await turns.take(mode, bodies[index % len(bodies)])
    return turns.figures(shape.sequential_rounds)


async def spaced(turns: _Turns, shape: OverheadShape, bodies: Sequence[bytes]) -> dict[str, Any]:
    """One request at a time, each after :attr:`~OverheadShape.spaced_gap_ms` of idle time (low-rate
    traffic: every process starts its request cold), the paths interleaved request by request."""
    gap_s = shape.spaced_gap_ms / 1000
    turns.start()
    for round_index in range(shape.spaced_rounds):
        body = bodies[(shape.spaced_start + round_index) % len(bodies)]
        for mode in _rotated(turns.turns, round_index):
            await asyncio.sleep(gap_s)
            await turns.take(mode, body)
    figures = turns.figures(shape.spaced_rounds)
    return {"gap_ms": shape.spaced_gap_ms, **figures}


async def burst(
    post: Send,
    bodies: Sequence[bytes],
    start: int,
    requests: int,
    concurrency: int,
) -> list[float]:
    """``requests`` requests from ``concurrency`` clients that each keep one in flight; they send
    ``bodies[start:start + requests]`` (cyclically)."""
    latencies: list[float] = []
    taken = 0

    async def client() -> None:
        nonlocal taken
        while taken < requests:
            body = bodies[(start + taken) % len(bodies)]
            taken += 1
            latencies.append(await post(body))

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(client())
    return latencies


async def concurrent(
    senders: dict[str, Send], servers: Servers, shape: OverheadShape, bodies: Sequence[bytes]
) -> dict[str, Any]:
    """Bursts of ``concurrency`` clients, one path at a time, paths rotating between rounds."""
    pids, modes = servers.pids, tuple(senders)
    for mode in modes:  # warm-up: open ``concurrency`` connections on every hop
        start = shape.concurrent_warmup_start
        await burst(senders[mode], bodies, start, shape.concurrency, shape.concurrency)
    latencies: dict[str, list[float]] = {mode: [] for mode in modes}
    wall_s = dict.fromkeys(modes, 0.0)
    cpu_s = dict.fromkeys(modes, 0.0)
    for round_index in range(shape.concurrent_rounds):
        for mode in _rotated(modes, round_index):
            cpu_before = tree_cpu_seconds(pids[mode])
            started = time.perf_counter()
            start = shape.burst_start(round_index)
            latencies[mode] += await burst(
                senders[mode], bodies, start, shape.burst_requests, shape.concurrency
            )
            wall_s[mode] += time.perf_counter() - started
            cpu_s[mode] += tree_cpu_seconds(pids[mode]) - cpu_before
    by_mode = {mode: latency_figures(latencies[mode]) for mode in modes}
    return {
        "latency": by_mode,
        "added": added(by_mode),
        "req_per_s": {mode: round(len(latencies[mode]) / wall_s[mode], 1) for mode in modes},
        "cpu": {
            proxy: cpu_figures(len(latencies[proxy]), cpu_s[proxy], wall_s[proxy]) for proxy in modes[1:]
        },
    }


async def measure_kind(
    session: aiohttp.ClientSession,
    servers: Servers,
    shape: OverheadShape,
    prompts: Prompts,
    kind: str,
    grpc: dict[str, GrpcClient],
    local: Local | None = None,
) -> dict[str, Any]:
    """Every phase of ``kind``; ``local`` (``chat_cold``: the tokenizer) takes its turn beside the paths
    in the one-at-a-time phases."""
    path, bodies = prompts.bodies(kind)
    senders = kind_senders(session, servers, kind, path, grpc)
    kvlb_url = servers.urls["kvlb"]
    before = await scrape_metrics(session, kvlb_url)
    result: dict[str, Any] = {"description": KIND_DESCRIPTIONS[kind]}
    result["sequential"] = await sequential(_Turns(senders, servers, local), shape, bodies)
    result["spaced"] = await spaced(_Turns(senders, servers, local), shape, bodies)
    result["concurrent"] = await concurrent(senders, servers, shape, bodies)
    after = await scrape_metrics(session, kvlb_url)
    decisions = (parse_histogram(text, DECISION_METRIC) for text in (after, before))
    result["route_decision"] = decision_figures(histogram_delta(*decisions))
    memo = {name: metric_value(after, name) - metric_value(before, name) for name in MEMO_COUNTERS}
    result["token_id_memo"] = {name.split("_")[-2]: round(value) for name, value in memo.items()}
    bodies_found = {
        name: metric_value(after, name) - metric_value(before, name) for name in BODY_MEMO_COUNTERS
    }
    result["body_memo"] = {name.split("_")[-2]: round(value) for name, value in bodies_found.items()}
    return result


TOKENIZE_SHARED_INLINE = (
    "wall time in the bench process to tokenize one chat_shared prompt (a new user message each "
    "sample, the system prompts cached) as kvlb's request path does on its event loop: "
    "encode_chat_if_cached with INLINE_TOKENIZE_CHARS; 'refused' samples also ran encode_chat"
)

IDLE_PROBE_SAMPLES = 40
"""Samples of the machine's idle penalty (:func:`~loadtests.bench.overhead.machine.idle_penalty`)."""

LAG_THREADS = 4
LAG_ROUNDS = 10
LAG_TICK_S = 0.001


async def tokenize_in_threads(
    tokenizer: Tokenizer, chats: Sequence[Any], threads: int = LAG_THREADS, rounds: int = LAG_ROUNDS
) -> dict[str, Any]:
    """``rounds`` times, ``threads`` chats tokenized at once through ``asyncio.to_thread`` (as kvlb
    does with long prompts) while a task ticks every :data:`LAG_TICK_S` on this loop: the longest
    the loop stalled in each round (a tokenizer holding the GIL stalls it for whole encodes) and the
    chats tokenized per second."""
    lags: list[float] = []
    stalls, rates = [], []

    async def ticker(stop: asyncio.Event) -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(LAG_TICK_S)
            now = time.perf_counter()
            lags.append(now - last - LAG_TICK_S)
            last = now

    for round_index in range(rounds):
        lags.clear()
        stop = asyncio.Event()
        ticks = asyncio.create_task(ticker(stop))
        batch = [chats[(round_index * threads + i) % len(chats)] for i in range(threads)]
        started = time.perf_counter()
        await asyncio.gather(*(asyncio.to_thread(tokenizer.encode_chat, chat) for chat in batch))
        elapsed = time.perf_counter() - started
        stop.set()
        await ticks
        stalls.append(max(lags, default=0.0))
        rates.append(threads / elapsed)
    return {
        "threads": threads,
        "rounds": rounds,
        "max_loop_lag_ms_p50": _ms(percentile(stalls, 50)),
        "max_loop_lag_ms_max": _ms(max(stalls)),
        "chats_per_s_p50": round(percentile(rates, 50) or 0.0, 1),
    }


def bench_tokenizers() -> tuple[HfTokenizer, HfTokenizer]:
    """The default tokenizer twice: with its segment cache off (the from-scratch timings, every
    sample a full encode) and on (the ``chat_shared`` timings, as kvlb tokenizes). Blocking."""
    return default_tokenizer(TokenizeLimits(segment_cache_tokens=0)), default_tokenizer()


async def measure(shape: OverheadShape, log_dir: Path | None = None) -> dict[str, Any]:
    """Start the servers, measure every kind, stop everything; the JSON-ready report."""
    cold, warm = await asyncio.to_thread(bench_tokenizers)
    prompts = await asyncio.to_thread(build_prompts, shape, cold, warm)
    threads = await tokenize_in_threads(cold, [json.loads(body)["messages"] for body in prompts.chat])
    penalty = await asyncio.to_thread(idle_penalty, shape.spaced_gap_ms, IDLE_PROBE_SAMPLES)
    children: list[Child] = []
    servers: Servers | None = None
    grpc: dict[str, GrpcClient] = {}
    with contextlib.ExitStack() as stack:
        folder = log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvlb-bench-")))
        try:
            servers = await start_servers(shape.replicas, folder, children, workers=shape.workers)
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=shape.concurrency + 4)
            async with aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            ) as session:
                for path in servers.kvlb_paths:
                    await wait_ready(session, servers.urls[path])
                if GRPC_KINDS & set(shape.kinds):
                    grpc_bodies = [
                        b for kind in GRPC_KINDS & set(shape.kinds) for b in prompts.bodies(kind)[1]
                    ]
                    for path, address in servers.grpc_addresses.items():
                        grpc[path] = GrpcClient(address, grpc_bodies, shape.concurrency)
                local = {"chat_cold": tokenizer_cpu(cold)}
                runs = {
                    kind: await measure_kind(session, servers, shape, prompts, kind, grpc, local.get(kind))
                    for kind in shape.kinds
                }
        finally:
            for client in grpc.values():
                await client.close()
            if servers is not None:
                await servers.stop_peers()
            await stop_all(children)
    assert servers is not None  # started, or the run raised
    counts = prompts.token_counts
    return {
        "shape": {**asdict(shape), "kinds": list(shape.kinds), "workers": list(shape.workers)},
        "targets": TARGETS,
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "idle_penalty": penalty,
        },
        "prompt_tokens": {"mean": sum(counts) / len(counts), "min": min(counts), "max": max(counts)},
        "tokenize_ms": {
            "p50_ms": _ms(percentile(prompts.tokenize_s, 50)),
            "p99_ms": _ms(percentile(prompts.tokenize_s, 99)),
        },
        "tokenize_shared_inline_ms": {
            "description": TOKENIZE_SHARED_INLINE,
            "samples": len(prompts.tokenize_shared_s),
            "refused": prompts.tokenize_shared_fallbacks,
            "p50_ms": _ms(percentile(prompts.tokenize_shared_s, 50)),
            "p99_ms": _ms(percentile(prompts.tokenize_shared_s, 99)),
        },
        "tokenize_cpu_ms": {"p50_ms": _ms(percentile(prompts.tokenize_cpu_s, 50))},
        "tokenize_threads": threads,
        "runs": runs,
        "peers": {"measured": list(servers.peers), "skipped": servers.skipped},
        "peer_ratios": peer_ratios(runs),
        "own_ratios": own_ratios(runs, _ms(percentile(prompts.tokenize_cpu_s, 50))),
        "workers_ratios": workers_ratios(runs, shape.workers),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


# ------------------------------------------------------------------------------------------- CLI


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, dict[str, Any]]], dict[str, Any]]:
    with contextlib.suppress(ImportError):
        import uvloop

        return uvloop.run
    return asyncio.run


def add_parser(kinds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``kvlb bench overhead`` (called by :mod:`loadtests.bench.command`)."""
    parser = kinds.add_parser(
        "overhead",
        help="latency kvlb adds vs. the replica directly and a plain aiohttp proxy; req/s per process",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON report only")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (seconds), for CI")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated, of {','.join(KINDS)} (default all)"
    )
    parser.add_argument("--concurrency", type=int, default=None, help="clients of the concurrent phase (32)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt size in tokens (8192)")
    parser.add_argument(
        "--workers", default=None, help="kvlb serve --workers counts side by side, e.g. 1,2 (default 1,2)"
    )
    parser.set_defaults(handler=run_command)


def shape_from_args(args: argparse.Namespace) -> OverheadShape:
    shape = SMOKE if args.smoke else OverheadShape()
    changes: dict[str, Any] = {"kinds": tuple(k.strip() for k in args.kinds.split(",") if k.strip())}
    if args.concurrency is not None:
        changes["concurrency"] = args.concurrency
    if args.prompt_tokens is not None:
        changes["prompt_tokens"] = args.prompt_tokens
    if args.workers is not None:
        changes["workers"] = tuple(int(n) for n in args.workers.split(",") if n.strip())
    return OverheadShape(**{**asdict(shape), **changes})


def run_command(args: argparse.Namespace) -> int:
    try:
        shape = shape_from_args(args)
    except ValueError as exc:  # an unknown --kinds name, a --workers that is no count or below 1
        print(f"kvlb bench overhead: {exc}", file=sys.stderr)
        return 2
    return print_report(_event_loop_runner()(measure(shape)), format_report, json_only=args.json)
