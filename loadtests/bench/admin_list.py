"""What a ``ListReplicas`` / ``GET /admin/replicas`` of many replicas holds kvlb's event loop (I/O: a
benchmark; prints a table and one line of JSON, or the JSON only with ``--json``).

A real :class:`~balancer.app.Balancer` serves gRPC and HTTP on 127.0.0.1 in this process, in front of
``--replicas`` static vLLM entries answered by one aiohttp application of a child process (a port each:
``/health``, ``/v1/models`` and a ``/metrics`` whose queue gauge is ``-3`` on every tenth replica, so
their ``scrape`` holds a refused figure) and a ZMQ PUB each (their event sources connect; nothing is
published). A client in a child process (this module with ``--client``) makes ``--calls`` calls of
each kind, one at a time with ``--pause-ms`` between them, after ``--warmup`` of each, and prints
when each began and ended (``time.perf_counter``: ``CLOCK_MONOTONIC``, the same clock in both
processes on Linux).

The balancer's loop is the default asyncio loop here (``kvlb serve`` runs uvloop unless
``--no-uvloop``) over a selector that notes when each of its waits ends and the next begins: the loop
is held from the end of one wait to the start of the next. Per call, reported as median and p99:
``hold_ms``, the longest single hold begun within the call's window (the handler and its answer's
encoding run in one), ``hold_cpu_ms``, the loop thread's CPU time in that hold (what the hold costs
without the time the machine's other processes took the core meanwhile), and ``busy_ms``, all holds
begun within it added (scrapes and probes answered meanwhile included); ``latency_ms`` as the client
saw it; and the answer's bytes.

With ``--workers N`` (2..8) the balancer of this process is worker 0 of ``kvlb serve --workers N``
(:class:`~balancer.serve_options.WorkerRole`, its own listening socket) and workers 1 … N-1 are real
``kvlb serve`` worker processes over the same replicas (``--worker-index``, a run directory of their
own; no gRPC port: worker 0's gathers over HTTP); the clients call worker 0, which gathers its
siblings' answers (:mod:`balancer.api.gathered`): what is measured is the answering worker's loop,
the merge included.

    python -m loadtests.bench.admin_list [--replicas 100] [--calls 200] [--warmup 20] [--workers 1] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

MODEL = "bench-model"
BAD_EVERY = 10
"""Every tenth replica's ``/metrics`` reports a queue of ``-3`` (refused: ``scrape.last_rejection``)."""


class TimedSelector(selectors.DefaultSelector):
    """The loop's selector, noting each stretch between two waits: ``(start, end, cpu)``, its
    ``time.perf_counter`` seconds and the loop thread's CPU seconds in it (the first ``limit``
    kept)."""

    def __init__(self, limit: int = 500_000) -> None:
        super().__init__()
        self.holds: list[tuple[float, float, float]] = []
        self._limit = limit
        self._woke = time.perf_counter()
        self._woke_cpu = time.thread_time()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        start, cpu = time.perf_counter(), time.thread_time()
        if len(self.holds) < self._limit:
            self.holds.append((self._woke, start, cpu - self._woke_cpu))
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        self._woke, self._woke_cpu = time.perf_counter(), time.thread_time()
        return ready


async def _fleet_app(count: int) -> tuple[web.AppRunner, list[str]]:
    """One aiohttp application on ``count`` ports of 127.0.0.1; their URLs."""
    good = _metrics("2.0")
    bad = _metrics("-3")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def scrape(request: web.Request) -> web.Response:
        port = request.transport.get_extra_info("sockname")[1] if request.transport else 0
        return web.Response(text=bad if port in bad_ports else good, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", scrape)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    urls: list[str] = []
    bad_ports: set[int] = set()
    for index in range(count):
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[-1][1]
        if index % BAD_EVERY == 0:
            bad_ports.add(port)
        urls.append(f"http://127.0.0.1:{port}")
    return runner, urls


def _metrics(waiting: str) -> str:
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 1.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} {waiting}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.25\n'
    )


async def serve_fleet(count: int) -> None:
    """The fleet's child (``--fleet N``): ``count`` fakes, their replica entries printed as one line
    of JSON, served until its standard input closes."""
    import zmq
    import zmq.asyncio

    zctx = zmq.asyncio.Context()
    pubs: list[zmq.asyncio.Socket] = []
    runner, urls = await _fleet_app(count)
    try:
        replicas = []
        for index, url in enumerate(urls):
            pub = zctx.socket(zmq.PUB)
            pubs.append(pub)
            port = pub.bind_to_random_port("tcp://127.0.0.1")
            entry = {"id": f"r{index:03d}", "url": url, "engine": "vllm", "block_size": 16}
            entry["events"] = f"tcp://127.0.0.1:{port}"
            replicas.append(entry)
        print(json.dumps(replicas), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        await runner.cleanup()
        for pub in pubs:
            pub.close(linger=0)
        zctx.term()


@contextlib.asynccontextmanager
async def running(count: int, interval_s: float = 1.0, workers: int = 1) -> AsyncIterator[Any]:
    """The fleet's fakes (in a child process: their work is not on the balancer's loop) and a
    started balancer over them (yielded), all stopped on exit; it scrapes every ``interval_s`` and
    probes every two. ``workers`` > 1: the balancer is worker 0 of that many, the others ``kvlb
    serve`` worker processes (:func:`_siblings`)."""
    from balancer.app import Balancer
    from balancer.config import Settings, from_mapping
    from balancer.serve_options import ServeOptions, WorkerRole
    from balancer.tokenizer.tokenizer import TokenIdTokenizer

    command = [sys.executable, "-m", "loadtests.bench.admin_list", "--fleet", str(count)]
    child = await asyncio.create_subprocess_exec(*command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    balancer: Balancer | None = None
    with contextlib.ExitStack() as stack:
        try:
            assert child.stdout is not None
            line = await asyncio.wait_for(child.stdout.readline(), timeout=120)
            if not line:
                raise RuntimeError(f"the fleet's child exited with {await child.wait()}")
            tree: dict[str, Any] = {
                "listen": {"host": "127.0.0.1", "port": 0, "grpc_port": 0},
                "pools": [{"model": MODEL, "replicas": json.loads(line)}],
                "health_interval_s": 2 * interval_s,
                "scrape_interval_s": interval_s,
            }
            settings = from_mapping(Settings, tree).validate()
            options = ServeOptions()
            if workers > 1:
                run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvlb-bench-workers-"))
                listener = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
                role = WorkerRole(0, workers, os.dup(listener.fileno()), run_dir)
                options = ServeOptions(worker=role)
            balancer = Balancer(settings, tokenizers={MODEL: TokenIdTokenizer()}, options=options)
            await balancer.start()
            if workers > 1:
                async with _siblings(tree, workers, run_dir):
                    yield balancer
            else:
                yield balancer
        finally:
            if balancer is not None:
                await balancer.stop()
            if child.stdin is not None:
                child.stdin.close()
            try:
                await asyncio.wait_for(child.wait(), timeout=10)
            except TimeoutError:
                child.kill()
                await child.wait()


@contextlib.asynccontextmanager
async def _siblings(tree: dict[str, Any], workers: int, run_dir: str) -> AsyncIterator[None]:
    """Workers 1 … ``workers - 1`` of ``kvlb serve --workers N`` (this process standing for their
    supervisor), each with a listening socket of its own, serving until exit (SIGTERM)."""
    config = os.path.join(run_dir, "bench-config.json")  # JSON is YAML
    # no gRPC port: one picked with SO_REUSEPORT may be worker 0's, which would share its calls
    listen = {**tree["listen"], "grpc_port": None}
    await asyncio.to_thread(Path(config).write_text, json.dumps({**tree, "listen": listen}), "utf-8")
    children: list[asyncio.subprocess.Process] = []
    listeners: list[socket.socket] = []
    try:
        for index in range(1, workers):
            listener = socket.create_server(("127.0.0.1", 0))
            listeners.append(listener)
            argv = [sys.executable, "-m", "balancer", "serve", "--config", config, "--log-level", "error"]
            argv += ["--workers", str(workers), "--worker-index", str(index), "--run-dir", run_dir]
            argv += ["--listen-fd", str(listener.fileno()), "--supervisor-pid", str(os.getpid())]
            children.append(
                await asyncio.create_subprocess_exec(
                    *argv, stdout=subprocess.PIPE, pass_fds=(listener.fileno(),)
                )
            )
        for sibling in children:
            assert sibling.stdout is not None
            line = await asyncio.wait_for(sibling.stdout.readline(), timeout=120)
            if b'"serving"' not in line:
                raise RuntimeError(f"a sibling worker did not start ({line[:200]!r})")
        yield
    finally:
        for sibling in children:
            if sibling.returncode is None:
                sibling.send_signal(signal.SIGTERM)
        for sibling in children:
            try:
                await asyncio.wait_for(sibling.wait(), timeout=30)
            except TimeoutError:
                sibling.kill()
                await sibling.wait()
        for listener in listeners:
            listener.close()


async def _settled(balancer: Any, count: int, timeout_s: float = 60.0) -> None:
    """Until every replica was probed, scraped twice and (every tenth) refused a figure."""
    from balancer.api.admin_replicas import replicas_answer

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views = replicas_answer(balancer.state)["replicas"]
        ready = len(views) == count and all(
            view["health"] is not None
            and view["health"]["probe_ok"]
            and view["scrape"] is not None
            and view["scrape"]["scrapes"] - view["scrape"]["errors"] >= 2
            for view in views
        )
        if ready:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the {count} replicas were not probed and scraped within {timeout_s} s")


async def _gathered(url: str, count: int, workers: int, timeout_s: float = 60.0) -> None:
    """Until ``GET /admin/replicas`` on ``url`` is every worker's and lists every replica probed."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.get(url + "/admin/replicas") as response:
                answer = await response.json()
            probed = sum(1 for view in answer["replicas"] if (view["health"] or {}).get("probe_ok"))
            if answer.get("workers") == list(range(workers)) and probed == count:
                return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"the {workers} workers did not all answer within {timeout_s} s")


def _client_command(kind: str, target: str, calls: int, warmup: int, pause_ms: float) -> list[str]:
    return [
        sys.executable,
        "-m",
        "loadtests.bench.admin_list",
        "--client",
        kind,
        "--target",
        target,
        "--calls",
        str(calls),
        "--warmup",
        str(warmup),
        "--pause-ms",
        str(pause_ms),
    ]


def client(kind: str, target: str, calls: int, warmup: int, pause_ms: float) -> int:
    """The child: ``warmup + calls`` calls, one at a time; prints ``{"windows": [[begin, end], ...],
    "bytes": n}`` for the measured ones."""
    import urllib.request

    import grpc

    from balancer._proto.kvlb.v1 import balancer_pb2 as pb
    from balancer._proto.kvlb.v1 import balancer_pb2_grpc as pb_grpc

    windows: list[tuple[float, float]] = []
    size = 0
    if kind == "grpc":
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.AdminStub(channel)  # type: ignore[no-untyped-call]
            for index in range(warmup + calls):
                begin = time.perf_counter()
                answer = stub.ListReplicas(pb.ListReplicasRequest(), timeout=30)
                end = time.perf_counter()
                size = answer.ByteSize()
                if index >= warmup:
                    windows.append((begin, end))
                time.sleep(pause_ms / 1000)
    else:
        for index in range(warmup + calls):
            begin = time.perf_counter()
            with urllib.request.urlopen(target + "/admin/replicas", timeout=30) as response:
                body = response.read()
            end = time.perf_counter()
            size = len(body)
            if index >= warmup:
                windows.append((begin, end))
            time.sleep(pause_ms / 1000)
    print(json.dumps({"windows": windows, "bytes": size}))
    return 0


def _per_call(
    holds: Sequence[tuple[float, float, float]], windows: Sequence[Sequence[float]]
) -> dict[str, Any]:
    """Per call: the longest hold begun within its window (wall and CPU), all of them added (wall),
    and its latency; a hold is counted whole when it begins within the window."""
    longest: list[float] = []
    longest_cpu: list[float] = []
    busy: list[float] = []
    latency: list[float] = []
    for begin, end in windows:
        within = [(stop - start, cpu) for start, stop, cpu in holds if begin <= start < end]
        top = max(within, default=(0.0, 0.0))
        longest.append(top[0] * 1000)
        longest_cpu.append(top[1] * 1000)
        busy.append(sum(wall for wall, _ in within) * 1000)
        latency.append((end - begin) * 1000)
    return {
        "calls": len(windows),
        "hold_ms": _summary(longest),
        "hold_cpu_ms": _summary(longest_cpu),
        "busy_ms": _summary(busy),
        "latency_ms": _summary(latency),
    }


def _summary(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0
    return {
        "p50": round(statistics.median(ordered), 3) if ordered else 0.0,
        "p99": round(p99, 3),
        "max": round(ordered[-1], 3) if ordered else 0.0,
    }


async def measure(
    replicas: int,
    calls: int,
    warmup: int,
    pause_ms: float,
    selector: TimedSelector,
    interval_s: float = 1.0,
    workers: int = 1,
) -> dict[str, Any]:
    """The report: per kind (``grpc``, ``http``), the per-call figures and the answer's bytes;
    ``workers`` > 1: worker 0's, gathering its siblings' (see the module docstring)."""
    async with running(replicas, interval_s, workers) as balancer:
        await _settled(balancer, replicas)
        if workers > 1:
            await _gathered(balancer.url, replicas, workers)
        report: dict[str, Any] = {
            "replicas": replicas,
            "workers": workers,
            "calls": calls,
            "warmup": warmup,
            "pause_ms": pause_ms,
            "loop": "asyncio (selector)",
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load": [round(value, 2) for value in os.getloadavg()],
        }
        targets = {"grpc": f"127.0.0.1:{balancer.grpc_port}", "http": balancer.url}
        for kind, target in targets.items():
            command = _client_command(kind, target, calls, warmup, pause_ms)
            child = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
            try:
                out, _ = await asyncio.wait_for(child.communicate(), timeout=600)
            finally:
                if child.returncode is None:
                    child.kill()
                    await child.wait()
            if child.returncode != 0:
                raise RuntimeError(f"the {kind} client exited with {child.returncode}")
            answer = json.loads(out)
            report[kind] = {**_per_call(selector.holds, answer["windows"]), "bytes": answer["bytes"]}
        return report


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"{report['replicas']} replicas, {report.get('workers', 1)} worker(s), {report['calls']} calls of "
        f"each after {report['warmup']} "
        f"warm-up, {report['pause_ms']} ms apart; {report['utc']}, load {report['load']}",
        f"{'call':<22}{'hold p50':>10}{'hold p99':>10}{'cpu p50':>10}{'cpu p99':>10}{'busy p50':>10}"
        f"{'busy p99':>10}{'lat p50':>10}{'lat p99':>10}{'bytes':>10}",
    ]
    for kind, name in (("grpc", "Admin/ListReplicas"), ("http", "GET /admin/replicas")):
        row = report[kind]
        lines.append(
            f"{name:<22}{row['hold_ms']['p50']:>10.3f}{row['hold_ms']['p99']:>10.3f}"
            f"{row['hold_cpu_ms']['p50']:>10.3f}{row['hold_cpu_ms']['p99']:>10.3f}"
            f"{row['busy_ms']['p50']:>10.3f}{row['busy_ms']['p99']:>10.3f}"
            f"{row['latency_ms']['p50']:>10.3f}{row['latency_ms']['p99']:>10.3f}{row['bytes']:>10}"
        )
    lines.append(
        "(ms; hold: the longest single hold of kvlb's loop begun within a call, cpu: the loop thread's"
        " CPU in it; busy: all holds added)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, default=100, help="static replicas (1..1000)")
    parser.add_argument("--calls", type=int, default=200, help="measured calls of each kind (1..100000)")
    parser.add_argument("--warmup", type=int, default=20, help="calls of each kind before (0..10000)")
    parser.add_argument("--pause-ms", type=float, default=20.0, help="between two calls (0..10000)")
    parser.add_argument("--workers", type=int, default=1, help="worker 0 of N answers, gathering (1..8)")
    parser.add_argument("--json", action="store_true", help="print the JSON report only")
    parser.add_argument(
        "--interval-s", type=float, default=1.0, help="scrape interval (0.05..10; probes: 2x)"
    )
    parser.add_argument("--client", choices=("grpc", "http"), help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--fleet", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not (1 <= args.replicas <= 1000 and 1 <= args.calls <= 100_000 and 0 <= args.warmup <= 10_000):
        parser.error("--replicas 1..1000, --calls 1..100000, --warmup 0..10000")
    if not (0 <= args.pause_ms <= 10_000 and 0.05 <= args.interval_s <= 10 and 1 <= args.workers <= 8):
        parser.error("--pause-ms 0..10000, --interval-s 0.05..10, --workers 1..8")
    if args.fleet:
        asyncio.run(serve_fleet(args.fleet))
        return 0
    if args.client:
        return client(args.client, args.target, args.calls, args.warmup, args.pause_ms)
    selector = TimedSelector()
    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selector)) as runner:
        measured = measure(
            args.replicas, args.calls, args.warmup, args.pause_ms, selector, args.interval_s, args.workers
        )
        report = runner.run(measured)
    from loadtests.bench.command import print_report

    return print_report(report, format_report, json_only=args.json)


if __name__ == "__main__":
    sys.exit(main())
