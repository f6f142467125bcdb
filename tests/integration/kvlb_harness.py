"""Shared set-up of the HTTP integration tests: emulated replicas and a balancer on 127.0.0.1.

The replicas are the real emulator (:mod:`replicas.sim`) running on the test's event loop; the
balancer is the real :class:`balancer.app.Balancer`. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import zmq.asyncio
from aiohttp import web
from multidict import CIMultiDict
from settings_tree import settings_from

from balancer.app import Balancer
from balancer.config import Settings, from_mapping
from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.tokenizer import TokenIdTokenizer, Tokenizer
from loadtests.bench.overhead.report import metric_value as metric_value  # the tests import it from here
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

MODEL = "sim-test"
"""The model name of the emulator's ``cpu-test`` profile."""
READY_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Answer:
    status: int
    headers: CIMultiDict[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Harness:
    replicas: list[Replica]
    balancer: Balancer
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.balancer.url

    def replica(self, name: str) -> Replica:
        return next(r for r in self.replicas if r.config.name == name)

    async def kill(self, name: str) -> None:
        """Stop one replica for good (its sockets close; the balancer is not told)."""
        replica = self.replica(name)
        self.replicas.remove(replica)
        await replica.stop()

    async def warm(self, prompt: list[int]) -> str:
        """Send ``prompt`` once and wait until its holder's events reach the index; returns the holder."""
        answer = await self.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert answer.status == 200, answer.body
        holder = answer.headers["x-kvlb-replica"]
        full_blocks = len(prompt) // self.replica(holder).config.block_size

        async def indexed() -> bool:
            return int((await self.replica_view(holder))["index"]["blocks"]) >= full_blocks

        await wait_for(f"{full_blocks} blocks of {holder} in the index", indexed)
        return holder

    async def post(self, path: str, body: Any, headers: Mapping[str, str] | None = None) -> Answer:
        """POST ``body`` (bytes as is, anything else as JSON) and read the whole answer."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(self.url + path, data=data, headers=headers) as response:
            return Answer(response.status, response.headers.copy(), await response.read())

    async def admin(self, method: str, path: str, body: Any = None, token: str | None = None) -> Any:
        token = token or self.balancer.settings.auth.admin_token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.session.request(method, self.url + path, json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    async def replica_view(self, replica: str) -> dict[str, Any]:
        views = (await self.admin("GET", "/admin/replicas"))["replicas"]
        view: dict[str, Any] = next(v for v in views if v["id"] == replica)
        return view


def replica_entry(replica: Replica) -> dict[str, Any]:
    info = replica.describe()
    entry: dict[str, Any] = {
        "id": replica.config.name,
        "url": replica.url,
        "engine": replica.config.engine,
        "block_size": replica.config.block_size,
    }
    if "replay" in info:  # a ZMQ publisher (SGLang, vLLM)
        entry["events"] = info["events"][0]
        entry["replay"] = info["replay"][0]
    return entry


def settings_for(
    replicas: list[Replica], pool: Mapping[str, Any] | None = None, **overrides: Any
) -> Settings:
    """Settings for one pool over ``replicas`` (``pool``: more keys of its entry, e.g. ``kv_events``);
    ``overrides`` are dotted names (``limits__max_inflight``)."""
    tree: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": MODEL, "replicas": [replica_entry(r) for r in replicas], **(pool or {})}],
        "policy": {"seed": 7},
        "health_interval_s": 0.2,
        "scrape_interval_s": 0.5,
    }
    return settings_from(tree, overrides)


@asynccontextmanager
async def running(
    tokenizer: Tokenizer,
    count: int = 2,
    *,
    engines: tuple[str, ...] = ("sglang",),
    time_scale: float = 1.0,
    pool: Mapping[str, Any] | None = None,
    page_size: int | None = None,
    **overrides: Any,
) -> AsyncIterator[Harness]:
    """``count`` emulated replicas (engines cycled; ``page_size``: their block size, default each
    engine's) and a ready balancer in front of them."""
    zctx = zmq.asyncio.Context()
    replicas: list[Replica] = []
    balancer: Balancer | None = None
    try:
        for index in range(count):
            engine: Any = engines[index % len(engines)]
            config = ReplicaConfig(
                name=f"r{index}",
                engine=engine,
                profile=get_profile("cpu-test"),
                time_scale=time_scale,
                page_size=page_size,
            )
            replica = Replica(config, tokenizer, zctx)
            await replica.start()
            replicas.append(replica)
        balancer = Balancer(settings_for(replicas, pool, **overrides), tokenizers={MODEL: tokenizer})
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            harness = Harness(replicas, balancer, session)
            await wait_ready(session, balancer.url)
            yield harness
    finally:
        if balancer is not None:
            await balancer.stop()
        for replica in reversed(replicas):
            await replica.stop()
        zctx.destroy(linger=0)


@asynccontextmanager
async def stalling_stream_replica(first: bytes) -> AsyncIterator[str]:
    """A replica on 127.0.0.1 (its URL yielded) whose ``/v1/completions`` answers an event stream
    with ``first``, then sends nothing more for 30 s (the end is cut by the cleanup); its ``/health``
    answers ok."""

    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(first)
        await asyncio.sleep(30.0)  # silent from here on (cancelled at cleanup)
        await response.write_eof()
        return response

    async with completion_replica(complete) as url:
        yield url


@asynccontextmanager
async def completion_replica(
    complete: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """A fake replica on 127.0.0.1 (its URL yielded): ``complete`` answers ``/v1/completions``, and
    ``/health`` answers ok."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def balancer_over(url: str, **overrides: Any) -> AsyncIterator[tuple[Balancer, aiohttp.ClientSession]]:
    """A ready balancer (token-id prompts, no scraping) with one SGLang replica ``r0`` at ``url``, and
    a client session; ``overrides`` are top-level settings sections."""
    tree: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {"model": MODEL, "replicas": [{"id": "r0", "url": url, "engine": "sglang", "block_size": 4}]}
        ],
        "health_interval_s": 0.2,
        "scrape_interval_s": 0,
        **overrides,
    }
    balancer = Balancer(from_mapping(Settings, tree).validate(), tokenizers={MODEL: TokenIdTokenizer()})
    try:
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)
            yield balancer, session
    finally:
        await balancer.stop()


async def read_answer(
    reader: asyncio.StreamReader, timeout_s: float = 5.0
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP answer read off a raw socket: its status, headers (lower-case names) and
    ``Content-Length`` body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(reader.readexactly(length), timeout_s) if length else b""
    return status, headers, body


async def wait_for(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    """Poll ``check`` every 20 ms until it is true; fail naming ``what`` after ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            while not await check():  # noqa: ASYNC110 - polls state in another component
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}") from None


async def metric(h: Harness, name: str, **labels: str) -> float:
    """One sample of the balancer's ``/metrics`` (0 when absent)."""
    async with h.session.get(h.url + "/metrics") as response:
        return metric_value(await response.text(), name, **labels)


async def tokenizing(h: Harness) -> bool:
    """A request holds bytes for the tokenizer's threads (``kvlb_admission_tokenizing_bytes``)."""
    return await metric(h, "kvlb_admission_tokenizing_bytes") > 0


async def nothing_held(h: Harness) -> bool:
    """Every byte of the budget is back: no body, ids or tokenizing hold."""
    return (
        await metric(h, "kvlb_admission_body_bytes") == 0
        and await metric(h, "kvlb_admission_tokenizing_bytes") == 0
    )


async def wait_ready(session: aiohttp.ClientSession, url: str) -> None:
    async with asyncio.timeout(READY_TIMEOUT_S):
        while True:
            async with session.get(url + "/readyz") as response:
                if response.status == 200:
                    return
            await asyncio.sleep(0.02)


def sse_payloads(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``[DONE]`` kept as a string)."""
    out: list[Any] = []
    for event in raw.decode().split("\n\n"):
        for line in event.splitlines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


@functools.cache
def shared_deepseek() -> Tokenizer:
    """The default tokenizer, loaded once per test session (it takes about a second)."""
    return default_tokenizer()
