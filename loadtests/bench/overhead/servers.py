"""The two helper servers of ``kvlb bench overhead`` (I/O), each run as its own process.

* ``upstream``: a minimal fast fake engine. ``POST /v1/chat/completions`` and ``/v1/completions``
  read the whole body (without parsing it) and answer at once with a small SSE stream: a role chunk,
  two content chunks, a usage chunk and ``data: [DONE]``, in two writes. ``GET /health`` answers 200.
  The measured difference between a request sent here directly and one sent through a proxy is then
  the proxy's own cost.
* ``forward``: the floor for any aiohttp proxy: read the body, POST it to the upstream over one pooled
  session, relay the response chunk by chunk. No parsing, no routing.

``python -m loadtests.bench.overhead.servers upstream [--ports N]`` (or ``forward --upstream URL``) binds
free ports on 127.0.0.1 (the upstream ``N``, one process answering on each: a router that keys workers
by URL sees ``N`` workers), prints ``{"bench_server": ..., "url": ..., "urls": [...]}`` and serves
until SIGTERM/SIGINT. :func:`start_servers` (parent side) starts both, plus ``kvlb serve`` in front of
the upstream's ``replicas`` URLs (its gRPC server on a free port too, for the gRPC kinds), and the
installed peer routers (:data:`PEER_PATHS`: sglang-router's
``cache_aware`` and ``round_robin``, started as :mod:`loadtests.peers` builds them) in front of the same
URLs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from loadtests.fleet import processes
from loadtests.fleet.child_process import Child, python_module, spawn
from loadtests.peers import PEER_ENV, RouterSpec, peer_available, peer_command
from replicas.sim.ports import free_port_run

MODEL = "bench"
"""The model name of kvlb's one pool in the benchmark."""
MAX_BODY_BYTES = 16 * 1024 * 1024
"""Largest request body either server accepts (an 8k-token chat body is about 50 KB)."""
HOP_BY_HOP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
PEER_PATHS: tuple[RouterSpec, ...] = (
    RouterSpec("sglang_cache_aware", "sglang", "cache_aware"),
    RouterSpec("sglang_round_robin", "sglang", "round_robin"),
)
"""The peer routers measured as paths when installed (sglang-router: text chats, no tokenizer)."""


def _sse(payload: object) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _stream_bytes() -> tuple[bytes, bytes]:
    """The fake answer as two writes: the first chunk, then the rest."""
    base = {"id": "bench-1", "object": "chat.completion.chunk", "created": 0, "model": "bench"}

    def chunk(delta: dict[str, str], finish: str | None = None) -> dict[str, object]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    first = _sse(chunk({"role": "assistant", "content": "ok"}))
    usage = {"prompt_tokens": 8192, "completion_tokens": 2, "total_tokens": 8194}
    usage_chunk = {**base, "choices": [], "usage": {**usage, "prompt_tokens_details": {"cached_tokens": 0}}}
    rest = _sse(chunk({"content": " done"}, "length")) + _sse(usage_chunk) + b"data: [DONE]\n\n"
    return first, rest


_FIRST, _REST = _stream_bytes()


async def _answer(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    await response.write(_FIRST)
    await response.write(_REST)
    await response.write_eof()
    return response


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def upstream_app() -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/v1/chat/completions", _answer)
    app.router.add_post("/v1/completions", _answer)
    app.router.add_get("/health", _health)
    return app


SESSION = web.AppKey("session", aiohttp.ClientSession)


def forward_app(upstream_url: str) -> web.Application:
    """A plain forwarding proxy to ``upstream_url`` (its session lives as long as the app)."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    base = upstream_url.rstrip("/")

    async def open_session(app: web.Application) -> None:
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024), auto_decompress=False
        )

    async def close_session(app: web.Application) -> None:
        await app[SESSION].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with app[SESSION].post(base + request.path, data=body, headers=headers) as upstream:
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
            response = web.StreamResponse(status=upstream.status, headers=out_headers)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_post("/v1/completions", forward)
    app.router.add_get("/health", _health)
    return app


async def serve(kind: str, upstream_url: str | None, ports: int = 1) -> None:
    """Serve ``kind`` on ``ports`` free ports until SIGTERM/SIGINT."""
    if kind == "forward":
        if not upstream_url:
            raise SystemExit("forward needs --upstream URL")
        app = forward_app(upstream_url)
    else:
        app = upstream_app()
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for _ in range(max(1, ports)):
        await web.TCPSite(runner, "127.0.0.1", 0).start()
    urls = [f"http://{address[0]}:{address[1]}" for address in runner.addresses]
    print(json.dumps({"bench_server": kind, "url": urls[0], "urls": urls}), flush=True)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    try:
        await stopped.wait()
    finally:
        await runner.cleanup()


# ------------------------------------------------------------------ parent side: starting them


@dataclass
class Servers:
    """The server processes and the URL of each path (``direct``, ``forward``, ``kvlb``, then the peers
    that run)."""

    upstream: Child
    forward: Child
    kvlb: Child
    workers: dict[str, Child] = field(default_factory=dict)
    """More ``kvlb serve`` processes, ``kvlb_w<n>`` → the one started with ``--workers n``."""
    grpc_ports: dict[str, int] = field(default_factory=dict)
    """Each kvlb path (``kvlb``, ``kvlb_w<n>``) → its ``listen.grpc_port``."""
    peers: dict[str, tuple[Child, str]] = field(default_factory=dict)
    """Peer path name → (its process, its base URL)."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Peer path name → why it is not measured (not installed)."""

    @property
    def modes(self) -> tuple[str, ...]:
        return ("direct", "forward", "kvlb", *self.workers, *self.peers)

    @property
    def kvlb_paths(self) -> tuple[str, ...]:
        """``kvlb`` and the ``kvlb_w<n>`` paths (every kind is measured on them)."""
        return ("kvlb", *self.workers)

    @property
    def urls(self) -> dict[str, str]:
        return {
            "direct": str(self.upstream.info["url"]),
            "forward": str(self.forward.info["url"]),
            "kvlb": str(self.kvlb.info["url"]),
            **{name: str(child.info["url"]) for name, child in self.workers.items()},
            **{name: url for name, (_, url) in self.peers.items()},
        }

    @property
    def grpc_addresses(self) -> dict[str, str]:
        """Each kvlb path → the ``host:port`` its gRPC server listens on."""
        return {path: f"127.0.0.1:{port}" for path, port in self.grpc_ports.items()}

    @property
    def pids(self) -> dict[str, int]:
        peers = {name: child.pid for name, (child, _) in self.peers.items()}
        workers = {name: child.pid for name, child in self.workers.items()}
        return {
            "direct": self.upstream.pid,
            "forward": self.forward.pid,
            "kvlb": self.kvlb.pid,
            **workers,
            **peers,
        }

    async def stop_peers(self) -> None:
        for child, _ in reversed(self.peers.values()):
            await child.stop()


def kvlb_config(upstream_urls: Sequence[str], replicas: int) -> dict[str, Any]:
    """``kvlb serve`` settings: one pool of ``replicas`` replicas on the fake upstream's URLs (in turn)."""
    entries = [
        {"id": f"up-{i}", "url": upstream_urls[i % len(upstream_urls)], "engine": "sglang", "block_size": 16}
        for i in range(replicas)
    ]
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": MODEL, "replicas": entries}],
        "policy": {"seed": 1},
        "scrape_interval_s": 0,
        "health_interval_s": 5.0,
        "log_level": "WARNING",
    }


async def start_servers(
    replicas: int,
    log_dir: Path,
    children: list[Child],
    peers: Sequence[RouterSpec] = PEER_PATHS,
    workers: Sequence[int] = (1,),
) -> Servers:
    """Start upstream, forward proxy and kvlb (``--workers workers[0]``; one more kvlb per other count
    of ``workers``, path ``kvlb_w<n>``), appended to ``children`` as they start, then the installed
    ``peers`` (call :meth:`Servers.stop_peers`; a peer that fails to start stops the others)."""
    module = __name__
    upstream = await spawn(
        "upstream",
        python_module(module, "upstream", "--ports", str(replicas)),
        log_dir / "upstream.stderr",
        ready_key="bench_server",
    )
    children.append(upstream)
    url = str(upstream.info["url"])
    upstream_urls = [str(u) for u in upstream.info["urls"]]
    forward = await spawn(
        "forward",
        python_module(module, "forward", "--upstream", url),
        log_dir / "forward.stderr",
        ready_key="bench_server",
    )
    children.append(forward)
    config = log_dir / "kvlb.yaml"
    config.write_text(yaml.safe_dump(kvlb_config(upstream_urls, replicas)))
    ports = {"kvlb": free_port_run("127.0.0.1", 1)}

    async def serve(name: str, count: int) -> Child:
        grpc = f"listen.grpc_port={ports[name]}"
        argv = python_module(
            "balancer", "serve", "--config", str(config), "--workers", str(count), "--set", grpc
        )
        return await spawn(name, argv, log_dir / f"{name}.stderr", ready_key="kvlb")

    kvlb = await serve("kvlb", workers[0])
    children.append(kvlb)
    servers = Servers(upstream, forward, kvlb, grpc_ports=ports)
    for count in workers[1:]:
        name = f"kvlb_w{count}"
        ports[name] = free_port_run("127.0.0.1", 1)
        child = await serve(name, count)
        children.append(child)
        servers.workers[name] = child
    try:
        for spec in peers:
            if not peer_available(spec):
                servers.skipped[spec.name] = f"{spec.name}: not installed (pip sglang-router)"
                continue
            servers.peers[spec.name] = await start_peer(spec, upstream_urls, log_dir)
    except BaseException:
        await servers.stop_peers()
        raise
    return servers


PEER_READY_TIMEOUT_S = 30.0


async def start_peer(spec: RouterSpec, upstream_urls: Sequence[str], log_dir: Path) -> tuple[Child, str]:
    """Start peer ``spec`` in front of ``upstream_urls`` (the hub closed: :data:`PEER_ENV`); bounded wait
    until it lists every worker."""
    port, metrics_port = free_port_run("127.0.0.1", 1), free_port_run("127.0.0.1", 1)
    listing = [{"url": u} for u in upstream_urls]
    argv = peer_command(spec, port=port, metrics_port=metrics_port, replicas=listing, model=MODEL)
    env = {**os.environ, **PEER_ENV}
    child = await spawn(spec.name, argv, log_dir / f"{spec.name}.log", ready_key=None, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session, asyncio.timeout(PEER_READY_TIMEOUT_S):
            while not await processes.router_ready(session, spec, url, len(upstream_urls)):
                if child.process.returncode is not None:
                    raise RuntimeError(f"{spec.name} exited with {child.process.returncode}")
                await asyncio.sleep(0.1)
    except (TimeoutError, RuntimeError) as exc:
        await child.stop()
        raise RuntimeError(f"{spec.name} not ready at {url}: {exc}\n{child.log_tail()}") from None
    except BaseException:
        await child.stop()
        raise
    return child, url


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.overhead.servers")
    parser.add_argument("kind", choices=("upstream", "forward"))
    parser.add_argument("--upstream", help="upstream base URL (forward only)")
    parser.add_argument("--ports", type=int, default=1, help="ports the upstream answers on (upstream only)")
    parser.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    args = parser.parse_args(argv)
    run = asyncio.run
    if not args.no_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            run = uvloop.run
    run(serve(args.kind, args.upstream, args.ports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
