"""Instructions per request of one proxy process of ``kvlb bench overhead``, counted by callgrind.

Not part of ``kvlb bench``: a probe that sees through a shared machine's noise. Seconds of CPU per
request move by 20–50% with the load of other jobs; the instructions a process executes for the
same requests do not (``valgrind --tool=callgrind`` counts them exactly, whatever the load). It
starts the bench's fake upstream (``loadtests/bench/overhead/servers.py``, 4 ports) as it is, and one
measured path under ``valgrind --tool=callgrind --instr-atstart=no``: ``kvlb`` (``kvlb serve
--workers 1`` with the bench's settings; it re-executes itself on jemalloc, so children are traced),
``forward`` (the plain aiohttp forwarding proxy) or ``sglang_cache_aware`` (sglang-router). It sends
``--warmup`` requests one at a time (uncounted: connections, caches, every distinct prompt seen five
times by default), switches instrumentation on (``callgrind_control -i on``), sends ``--requests``
more one at a time, dumps the counts (``callgrind_control -d``) and prints the process's instructions
(all threads) over those requests ÷ ``--requests``. The bodies are the bench's own
(:func:`~loadtests.bench.overhead.workload.build_prompts`, seed 0): ``tokens`` repeats the 32
prompts' token ids; ``chat_shared`` takes a new body per request (one of 32 shared system prompts,
a new user message), in the bench's order.

With ``--concurrency N`` the warm-up and the counted requests are sent by ``N`` clients that each
keep one request in flight, as the bench's concurrent phase does (32 there): the count then includes
what concurrency adds to a request (young collections of the garbage collector, walked while other
requests' objects are alive; the loop's timers), which one request at a time never shows. Under
valgrind the process's threads run one at a time, so what the count cannot show is what concurrency
does to the time each instruction takes (caches, wakeups). ``--separate-threads`` writes one dump per
thread and adds each thread's instructions per request to the JSON (``thread_instructions_per_request``,
callgrind's thread numbers, 1 the main thread's).

Valgrind runs kvlb some 50–100× slower than it runs live (a request takes 150–250 ms instead of
1–3 ms), and kvlb's clocks do not slow down with it: at the bench's settings a routed request's
speculative blocks (``limits.speculative_ttl_s``, 2 s) would expire between two sights of a prompt
that live traffic sends again within milliseconds (the expiry's passes counted where live runs have
none), and the health probes (every 5 s) would run every 25 requests instead of every 2,000. So
kvlb's timer periods are multiplied by ``--time-scale`` (default 100: the speculative entries' life,
the health probes' period, the connect and probe timeout, the idle upstream connections' life, the
last at most 3,600 s). The count
includes whatever the process did in the window besides the requests (its timers, the garbage
collector), so it moves by about a percent from run to run; the hashing seed is fixed
(``PYTHONHASHSEED=0``) for every path::

    PYTHONPATH=$PWD python -m loadtests.bench.request_cost --path kvlb --kind chat_shared \\
        [--warmup 160] [--requests 200] [--concurrency 32] [--separate-threads] [--out DIR]
    callgrind_annotate --inclusive=yes DIR/cg.<pid>.1 | head -60   # the C functions' shares

Needs ``valgrind`` and ``callgrind_control`` on ``PATH``; the probe runs for minutes (valgrind runs
Python some 50× slower). Servers bind 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.tokenizer import TokenizeLimits
from loadtests.bench.overhead.clients import send
from loadtests.bench.overhead.servers import MODEL, PEER_PATHS, kvlb_config
from loadtests.bench.overhead.workload import OverheadShape, build_prompts
from loadtests.fleet import processes
from loadtests.fleet.child_process import Child, python_module, spawn, stop_all
from loadtests.peers import PEER_ENV, peer_command
from replicas.sim.ports import free_port_run

PATHS = ("kvlb", "forward", "sglang_cache_aware")
KINDS = ("tokens", "chat_shared", "chat")
READY_TIMEOUT_S = 600.0
"""How long a server under valgrind may take to start (kvlb loads its tokenizer first)."""
CONTROL_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 600.0
"""One request's bound: at ``--concurrency`` 32 a request under valgrind waits for 31 others."""
MAX_CONCURRENCY = 100
"""Most ``--concurrency`` clients: aiohttp's default pool of connections per session."""
SPECULATIVE_TTL_S = 2.0
"""``limits.speculative_ttl_s``'s default, scaled by ``--time-scale``."""
CONNECT_S = 2.0
"""``timeouts.connect_s``'s default (also the health probes' timeout), scaled by ``--time-scale``."""
IDLE_TTL_S = 15.0
"""``upstream.idle_ttl_s``'s default, scaled by ``--time-scale`` (at most 3,600)."""
_TOTALS = re.compile(rb"^(?:totals|summary):\s+([\d ]+)$", re.MULTILINE)
_EVENTS = re.compile(rb"^events:\s+([\w ]+)$", re.MULTILINE)


def valgrind_argv(
    out_dir: Path, argv: list[str], cache_sim: bool = False, separate_threads: bool = False
) -> list[str]:
    """``argv`` under callgrind, instrumentation off until switched on, output ``out_dir/cg.<pid>``
    (with ``cache_sim``, the simulated caches' misses counted too; with ``separate_threads``, one
    dump per thread, ``cg.<pid>.1-<thread>``)."""
    return [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--trace-children=yes",
        *(["--cache-sim=yes"] if cache_sim else []),
        *(["--separate-threads=yes"] if separate_threads else []),
        f"--callgrind-out-file={out_dir}/cg.%p",
        *argv,
    ]


def control(*args: str) -> None:
    """``callgrind_control args`` (bounded); raises when it fails."""
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=CONTROL_TIMEOUT_S)


def _file_events(path: Path) -> dict[str, int]:
    data = path.read_bytes()
    names, totals = _EVENTS.search(data), _TOTALS.search(data)
    if names is None or totals is None:
        raise RuntimeError(f"no totals in {path}")
    return dict(zip(names.group(1).decode().split(), map(int, totals.group(1).split()), strict=False))


def dumped_events(out_dir: Path, pid: int) -> dict[str, int]:
    """Each event's total in the first dump of process ``pid`` (``cg.<pid>.1``): ``Ir``, the
    instructions, and with ``--cache-sim`` the simulated misses (``D1mr``, ``DLmr``, ...). With
    ``--separate-threads`` the threads' dumps (``cg.<pid>.1-<thread>``) summed."""
    whole = out_dir / f"cg.{pid}.1"
    if whole.exists():
        return _file_events(whole)
    totals: dict[str, int] = {}
    for events in dumped_thread_events(out_dir, pid).values():
        for name, value in events.items():
            totals[name] = totals.get(name, 0) + value
    if not totals:
        raise RuntimeError(f"no totals in {whole}")
    return totals


def dumped_thread_events(out_dir: Path, pid: int) -> dict[int, dict[str, int]]:
    """Each thread's events in the first dump of process ``pid`` with ``--separate-threads``
    (``cg.<pid>.1-<thread>``, callgrind's thread numbers from 1, the main thread's); empty without."""
    prefix = f"cg.{pid}.1-"
    threads = {}
    for path in out_dir.glob(prefix + "*"):
        suffix = path.name[len(prefix) :]
        if suffix.isdigit():
            threads[int(suffix)] = _file_events(path)
    return dict(sorted(threads.items()))


async def wait_routable(url: str, replicas: int) -> None:
    """Poll kvlb's ``/admin/replicas`` until ``replicas`` are routable (bounded by
    :data:`READY_TIMEOUT_S`): under valgrind the first health probes take a while."""
    async with aiohttp.ClientSession() as session, asyncio.timeout(READY_TIMEOUT_S):
        while True:
            async with session.get(url + "/admin/replicas") as response:
                views = (await response.json())["replicas"] if response.status == 200 else []
            if len(views) == replicas and all(view["routable"] for view in views):
                return
            await asyncio.sleep(0.5)


def scaled_config(config: dict[str, Any], scale: float) -> dict[str, Any]:
    """The bench's ``kvlb serve`` settings with its clocks' periods × ``scale`` (see the module
    docstring): the speculative entries' life, the health probes' period, the idle connections'
    life, the connect and health probe timeout."""
    limits = config.setdefault("limits", {})
    limits["speculative_ttl_s"] = SPECULATIVE_TTL_S * scale
    config["health_interval_s"] = float(config["health_interval_s"]) * scale
    # the probes' (and the upstream connections') timeout: a first probe timed out under valgrind
    # would leave the replicas out until the next one, a scaled period later
    config.setdefault("timeouts", {})["connect_s"] = CONNECT_S * scale
    config.setdefault("upstream", {})["idle_ttl_s"] = min(3600.0, IDLE_TTL_S * scale)
    return config


async def start_measured(
    path: str,
    upstream_urls: list[str],
    out_dir: Path,
    children: list[Child],
    scale: float,
    cache_sim: bool,
    separate_threads: bool = False,
) -> Child:
    """Start ``path`` under callgrind in front of ``upstream_urls``; appended to ``children``."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    if path == "forward":
        argv = python_module("loadtests.bench.overhead.servers", "forward", "--upstream", upstream_urls[0])
        child = await spawn(
            path,
            valgrind_argv(out_dir, argv, cache_sim, separate_threads),
            out_dir / "forward.stderr",
            ready_key="bench_server",
            timeout_s=READY_TIMEOUT_S,
            env=env,
        )
        children.append(child)
        return child
    if path == "kvlb":
        config = out_dir / "kvlb.yaml"
        settings = scaled_config(kvlb_config(upstream_urls, len(upstream_urls)), scale)
        config.write_text(yaml.safe_dump(settings))
        grpc = f"listen.grpc_port={free_port_run('127.0.0.1', 1)}"
        argv = python_module("balancer", "serve", "--config", str(config), "--workers", "1", "--set", grpc)
        child = await spawn(
            path,
            valgrind_argv(out_dir, argv, cache_sim, separate_threads),
            out_dir / "kvlb.stderr",
            ready_key="kvlb",
            timeout_s=READY_TIMEOUT_S,
            env=env,
        )
        children.append(child)
        await wait_routable(str(child.info["url"]), len(upstream_urls))
        return child
    spec = next(s for s in PEER_PATHS if s.name == path)
    port, metrics_port = free_port_run("127.0.0.1", 1), free_port_run("127.0.0.1", 1)
    listing = [{"url": u} for u in upstream_urls]
    argv = peer_command(spec, port=port, metrics_port=metrics_port, replicas=listing, model=MODEL)
    child = await spawn(
        path,
        valgrind_argv(out_dir, argv, cache_sim, separate_threads),
        out_dir / f"{path}.log",
        ready_key=None,
        env={**env, **PEER_ENV},
    )
    children.append(child)
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session, asyncio.timeout(READY_TIMEOUT_S):
        while not await processes.router_ready(session, spec, url, len(upstream_urls)):
            if child.process.returncode is not None:
                raise RuntimeError(f"{path} exited with {child.process.returncode}\n{child.log_tail()}")
            await asyncio.sleep(0.5)
    child.info["url"] = url
    return child


async def clients(
    session: aiohttp.ClientSession, url: str, bodies: Sequence[bytes], indices: range, concurrency: int
) -> None:
    """Send ``bodies[i % len(bodies)]`` for each ``i`` of ``indices``, in order, from ``concurrency``
    clients that each keep one request in flight (as the bench's concurrent phase does)."""
    taken = iter(indices)

    async def client() -> None:
        for index in taken:
            await send(session, url, bodies[index % len(bodies)])

    await asyncio.gather(*(client() for _ in range(min(concurrency, len(indices)) or 1)))


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    shape = OverheadShape(prompt_tokens=args.prompt_tokens, prompts=args.prompts)
    cold = await asyncio.to_thread(default_tokenizer, TokenizeLimits(segment_cache_tokens=0))
    prompts = await asyncio.to_thread(build_prompts, shape, cold)
    url_path, bodies = prompts.bodies(args.kind)
    needed = args.warmup + args.requests
    if args.kind == "chat_shared" and needed > len(bodies):
        raise SystemExit(f"chat_shared has {len(bodies)} new bodies; --warmup + --requests is {needed}")
    out_dir = Path(args.out)
    children: list[Child] = []
    try:
        upstream = await spawn(
            "upstream",
            python_module("loadtests.bench.overhead.servers", "upstream", "--ports", str(shape.replicas)),
            out_dir / "upstream.stderr",
            ready_key="bench_server",
        )
        children.append(upstream)
        upstream_urls = [str(u) for u in upstream.info["urls"]]
        tracing = (args.time_scale, args.cache_sim, args.separate_threads)
        measured = await start_measured(args.path, upstream_urls, out_dir, children, *tracing)
        url = str(measured.info["url"]) + url_path
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await clients(session, url, bodies, range(args.warmup), args.concurrency)
            await asyncio.to_thread(control, "-i", "on", str(measured.pid))
            started = time.monotonic()
            await clients(session, url, bodies, range(args.warmup, needed), args.concurrency)
            elapsed_s = time.monotonic() - started
            await asyncio.to_thread(control, "-d", str(measured.pid))
            await asyncio.to_thread(control, "-i", "off", str(measured.pid))
        events = dumped_events(out_dir, measured.pid)
    finally:
        await stop_all(children)
    threads = dumped_thread_events(out_dir, measured.pid)
    return {
        "path": args.path,
        "kind": args.kind,
        "requests": args.requests,
        "warmup": args.warmup,
        "concurrency": args.concurrency,
        "instructions": events["Ir"],
        "instructions_per_request": round(events["Ir"] / args.requests),
        "per_request": {name: round(value / args.requests) for name, value in events.items()},
        "thread_instructions_per_request": {
            str(thread): round(events["Ir"] / args.requests) for thread, events in threads.items()
        },
        "window_s": round(elapsed_s, 1),
        "time_scale": args.time_scale,
        "dump": str(out_dir / f"cg.{measured.pid}.1"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.request_cost", description=__doc__)
    parser.add_argument("--path", choices=PATHS, default="kvlb")
    parser.add_argument("--kind", choices=KINDS, default="tokens")
    parser.add_argument("--warmup", type=int, default=160, help="uncounted requests first (default 160)")
    parser.add_argument("--requests", type=int, default=200, help="counted requests (default 200)")
    parser.add_argument("--prompts", type=int, default=32, help="distinct prompts (default 32)")
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument(
        "--time-scale",
        type=float,
        default=100.0,
        help="kvlb's timer periods × this (default 100: valgrind's slowdown; see the docstring)",
    )
    parser.add_argument(
        "--cache-sim", action="store_true", help="count the simulated caches' misses too (slower)"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="clients keeping one request in flight each, warm-up and counted (default 1: one at a time)",
    )
    parser.add_argument(
        "--separate-threads",
        action="store_true",
        help="one callgrind dump per thread; the JSON adds each thread's instructions per request",
    )
    parser.add_argument("--out", help="directory for the callgrind files (default: a new temp dir)")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.warmup < 0 or not 1 <= args.requests + args.warmup <= 10_000:
        parser.error("--requests must be >= 1 and --warmup >= 0, at most 10,000 together")
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        parser.error(f"--concurrency must be in [1, {MAX_CONCURRENCY}]")
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not on PATH")
    args.out = args.out or tempfile.mkdtemp(prefix="request_cost_")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(json.dumps(asyncio.run(measure(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
