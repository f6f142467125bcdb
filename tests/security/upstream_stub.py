"""A recording stand-in for a replica, and a trap server that counts connections (test helpers, I/O).

:class:`RecordingReplica` answers ``/health`` and the OpenAI completion endpoints (JSON, or a short
SSE stream when the body asks for one) and keeps every request's headers and body, so a test can see
exactly what the balancer forwarded. :class:`Trap` is a TCP listener nothing should ever reach: it
counts the connections it receives. :func:`balancer_over` runs a real :class:`Balancer` in front of
recording replicas.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from kvlb_harness import wait_ready
from settings_tree import settings_from

from balancer.app import Balancer
from balancer.config import Settings
from balancer.tokenizer.tokenizer import TokenIdTokenizer

MODEL = "stub-model"


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    """Lower-case names (the last value of a repeated header)."""
    body: bytes
    raw: list[tuple[str, str]]
    """Every header line as received (lower-case names)."""


@dataclass
class RecordingReplica:
    name: str
    seen: list[Seen] = field(default_factory=list)
    runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        raw = [
            (name.decode("latin-1").lower(), value.decode("latin-1")) for name, value in request.raw_headers
        ]
        self.seen.append(Seen(request.path, dict(raw), body, raw))
        payload = {"id": "c1", "object": "text_completion", "choices": [{"text": "hi", "index": 0}]}
        if json.loads(body).get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response(payload)


class Trap:
    """A listener on 127.0.0.1 that counts (and drops) every connection it gets."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._on_connect, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def stub_settings(replicas: list[RecordingReplica], **overrides: Any) -> Settings:
    tree: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {
                "model": MODEL,
                "replicas": [
                    {"id": r.name, "url": r.url, "engine": "sglang", "block_size": 4} for r in replicas
                ],
            }
        ],
        "policy": {"seed": 1},
        "health_interval_s": 0.2,
        "scrape_interval_s": 0,
    }
    return settings_from(tree, overrides)


@dataclass
class StubRun:
    replicas: list[RecordingReplica]
    balancer: Balancer
    session: aiohttp.ClientSession


@asynccontextmanager
async def balancer_over(count: int = 1, **overrides: Any) -> AsyncIterator[StubRun]:
    """``count`` recording replicas behind a ready balancer (token-id prompts only)."""
    replicas = [RecordingReplica(f"stub-{i}") for i in range(count)]
    balancer: Balancer | None = None
    try:
        for replica in replicas:
            await replica.start()
        settings = stub_settings(replicas, **overrides)
        balancer = Balancer(settings, tokenizers={MODEL: TokenIdTokenizer()})
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)
            yield StubRun(replicas, balancer, session)
    finally:
        if balancer is not None:
            await balancer.stop()
        for replica in replicas:
            await replica.stop()
