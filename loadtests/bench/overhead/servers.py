"""The two helper servers of ``kvlb bench overhead`` (I/O), each run as its own process.

* ``upstream``: a minimal fast fake engine. ``POST /v1/chat/completions`` and ``/v1/completions``
  read the whole body (without parsing it) and answer at once with a small SSE stream: a role chunk,
  two content chunks, a usage chunk and ``data: [DONE]``, in two writes. ``GET /health`` answers 200.
  The measured difference between a request sent here directly and one sent through a proxy is then
  the proxy's own cost.
* ``forward``: the floor for any aiohttp proxy: read the body, POST it to the upstream over one pooled
  session, relay the response chunk by chunk. No parsing, no routing.

``python -m loadtests.bench.overhead.servers upstream`` (or ``forward --upstream URL``) binds a free
port on 127.0.0.1, prints ``{"bench_server": ..., "url": ...}`` and serves until SIGTERM/SIGINT.
:func:`start_servers` (parent side) starts both, plus ``kvlb serve`` in front of the upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from loadtests.child_process import Child, spawn

MODEL = "bench"
"""The model name of kvlb's one pool in the benchmark."""
MAX_BODY_BYTES = 16 * 1024 * 1024
"""Largest request body either server accepts (an 8k-token chat body is about 50 KB)."""
HOP_BY_HOP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


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


async def serve(kind: str, upstream_url: str | None) -> None:
    """Serve ``kind`` on a free port until SIGTERM/SIGINT."""
    if kind == "forward":
        if not upstream_url:
            raise SystemExit("forward needs --upstream URL")
        app = forward_app(upstream_url)
    else:
        app = upstream_app()
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(json.dumps({"bench_server": kind, "url": f"http://{host}:{port}"}), flush=True)
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
    """The three server processes and the URL of each path."""

    upstream: Child
    forward: Child
    kvlb: Child

    @property
    def urls(self) -> dict[str, str]:
        return {
            "direct": str(self.upstream.info["url"]),
            "forward": str(self.forward.info["url"]),
            "kvlb": str(self.kvlb.info["url"]),
        }

    @property
    def pids(self) -> dict[str, int]:
        return {"direct": self.upstream.pid, "forward": self.forward.pid, "kvlb": self.kvlb.pid}


def kvlb_config(upstream_url: str, replicas: int) -> dict[str, Any]:
    """``kvlb serve`` settings: one pool whose replicas all point at the fake upstream."""
    entries = [
        {"id": f"up-{i}", "url": upstream_url, "engine": "sglang", "block_size": 16} for i in range(replicas)
    ]
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": MODEL, "replicas": entries}],
        "policy": {"seed": 1},
        "scrape_interval_s": 0,
        "health_interval_s": 5.0,
        "log_level": "WARNING",
    }


async def start_servers(replicas: int, log_dir: Path, children: list[Child]) -> Servers:
    """Start upstream, forward proxy and kvlb (appended to ``children`` as they start)."""
    module = __name__
    upstream = await spawn("upstream", module, ["upstream"], log_dir=log_dir, ready_key="bench_server")
    children.append(upstream)
    url = str(upstream.info["url"])
    forward = await spawn(
        "forward", module, ["forward", "--upstream", url], log_dir=log_dir, ready_key="bench_server"
    )
    children.append(forward)
    config = log_dir / "kvlb.yaml"
    config.write_text(yaml.safe_dump(kvlb_config(url, replicas)))
    kvlb = await spawn(
        "kvlb", "balancer", ["serve", "--config", str(config)], log_dir=log_dir, ready_key="kvlb"
    )
    children.append(kvlb)
    return Servers(upstream, forward, kvlb)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.overhead.servers")
    parser.add_argument("kind", choices=("upstream", "forward"))
    parser.add_argument("--upstream", help="upstream base URL (forward only)")
    parser.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    args = parser.parse_args(argv)
    run = asyncio.run
    if not args.no_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            run = uvloop.run
    run(serve(args.kind, args.upstream))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
