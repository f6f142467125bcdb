"""The noisy tenant of ``python -m loadtests.tenant_rate``: one client process per run, sending one of
the tenant isolation walk's scenarios (docs/reliability.md, "Tenant isolation") to ``kvlb serve``.

Each scenario is ``loops`` client loops for ``seconds``, in this process (so that the quiet tenant's
client loop, in another process, is not the one delayed), each loop sending one request after another
without a pause, refused or not:

* ``flood``: small completions (10 token ids, ``max_tokens: 8``) as tenant ``noisy``;
* ``default``: the same without a tenant header (the default tenant);
* ``made-up``: the same as a new made-up tenant on every request;
* ``values``: the same as one of 10,000 tenant values of 128 characters, in turn;
* ``token-ids``: 6,000 random token ids a prompt (they miss every cache), ``max_tokens: 8``;
* ``hot-prefix``: a text completion of one shared 1,000-word prefix and a few words of its own;
* ``huge``: chats of 560,000 characters (tokenized in kvlb's threads; past an engine's context:
  the walk ran them with ``max_prompt_tokens: 262144``, and the engine answered 400);
* ``over-chars``: chats of 6,000,000 characters (over the tokenizer's 4 M characters: 400);
* ``bursts``: 100 small completions at once, each loop cutting its burst after 50 ms (``cut``),
  then the next burst;
* ``streams``: streams of 2,000 tokens on raw sockets, half the loops reading 64 B every 0.5 s,
  half never reading, each stream held until the end (``unread`` when no status line was read).

Printed on stdout: ``{"noisy": "started"}`` once the loops start, then ``{"statuses": {...}}``
(answers by status, ``0`` for a client error) when they end. Bounded: ``seconds`` ≤ 60 (the caller
checks), each loop at most :data:`MAX_REQUESTS_PER_LOOP` requests, each request 10 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp

HEADER = "x-kvlb-tenant"
MODEL = "tenant-rate"
MAX_REQUESTS_PER_LOOP = 100_000
REQUEST_TIMEOUT_S = 10.0

NOISES = (
    "flood",
    "default",
    "made-up",
    "values",
    "token-ids",
    "hot-prefix",
    "huge",
    "over-chars",
    "bursts",
    "streams",
)
TEXT_NOISES = frozenset({"hot-prefix", "huge", "over-chars"})
"""The scenarios whose prompts are text: the engines need a tokenizer for them."""
WALK_LOOPS = {
    "flood": 200,
    "default": 200,
    "made-up": 64,
    "values": 64,
    "token-ids": 32,
    "hot-prefix": 64,
    "huge": 8,
    "over-chars": 8,
    "bursts": 1,
    "streams": 100,
}
"""The loops each scenario ran with in the walk (``--loops`` unset)."""
WALK_LIMITS: dict[str, dict[str, Any]] = {"huge": {"max_prompt_tokens": 262_144}}
"""Limits a scenario ran with in the walk besides the common ones."""

VALUES = 10_000
VALUE_CHARS = 128
TOKEN_IDS = 6_000
PREFIX_WORDS = 1_000
HUGE_CHARS = 560_000
OVER_CHARS = 6_000_000
BURST = 100
BURST_CUT_S = 0.05
STREAM_TOKENS = 2_000
STREAM_READ_BYTES = 64
STREAM_READ_EVERY_S = 0.5


def small_body(first: int, tokens: int = 10) -> bytes:
    """A small completion of ``tokens`` token ids from ``first``, ``max_tokens: 8``."""
    return json.dumps(
        {"model": MODEL, "prompt": [(first + i) % 30_000 + 1 for i in range(tokens)], "max_tokens": 8}
    ).encode()


def _words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(count))


def _chat(text: str) -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    ).encode()


def _long_text(rng: random.Random, chars: int) -> str:
    words = _words(rng, 4_000).split()
    text = " ".join(rng.choice(words) for _ in range(chars // 5 + 1))
    return text[:chars]


class Scenario:
    """How one scenario's loops make their requests (bodies and headers), built once per process."""

    def __init__(self, noise: str, seed: int = 0) -> None:
        if noise not in NOISES:
            raise ValueError(f"noise: one of {', '.join(NOISES)}, got {noise!r}")
        self.noise = noise
        self.rng = random.Random(seed)
        rng = self.rng
        self.values = (
            [f"v{i:05d}-" + "x" * (VALUE_CHARS - 7) for i in range(VALUES)] if noise == "values" else []
        )
        self.prefix = _words(rng, PREFIX_WORDS) if noise == "hot-prefix" else ""
        chars = HUGE_CHARS if noise == "huge" else OVER_CHARS if noise == "over-chars" else 0
        self.text = _long_text(rng, chars) if chars else ""

    def headers(self, loop: int, sent: int) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        noise = self.noise
        if noise == "made-up":
            headers[HEADER] = f"made-up-{loop}-{sent}"
        elif noise == "values":
            headers[HEADER] = self.values[(loop * 7919 + sent) % VALUES]
        elif noise != "default":
            headers[HEADER] = "noisy"
        return headers

    def body(self, loop: int, sent: int) -> bytes:
        noise = self.noise
        if noise == "token-ids":
            ids = [self.rng.randrange(1, 100_000) for _ in range(TOKEN_IDS)]
            return json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 8}).encode()
        if noise == "hot-prefix":
            tail = f" loop {loop} request {sent} {self.rng.randrange(10**9)}"
            return json.dumps({"model": MODEL, "prompt": self.prefix + tail, "max_tokens": 8}).encode()
        if noise in ("huge", "over-chars"):  # a head of its own: no cache of kvlb's or the engine's
            return _chat(f"{loop}-{sent}-{self.rng.randrange(10**9)} " + self.text)
        if noise == "streams":
            ids = [(loop * 131 + sent * 17 + i) % 30_000 + 1 for i in range(16)]
            return json.dumps(
                {
                    "model": MODEL,
                    "prompt": ids,
                    "max_tokens": STREAM_TOKENS,
                    "stream": True,
                    "ignore_eos": True,
                }
            ).encode()
        return small_body(loop * 7 + sent)


async def noisy(url: str, loops: int, seconds: float, noise: str) -> None:
    """The noisy tenant's process: ``loops`` loops of ``noise`` for ``seconds``; prints its answers."""
    scenario = Scenario(noise)
    statuses: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(loop: int, sent: int) -> None:
            try:
                async with session.post(
                    url + "/v1/completions"
                    if scenario.noise not in ("huge", "over-chars")
                    else url + "/v1/chat/completions",
                    data=scenario.body(loop, sent),
                    headers=scenario.headers(loop, sent),
                ) as response:
                    await response.read()
                    statuses[str(response.status)] += 1
            except (aiohttp.ClientError, TimeoutError):
                statuses["0"] += 1

        async def requests(loop: int) -> None:
            for sent in range(MAX_REQUESTS_PER_LOOP):
                if time.monotonic() >= deadline:
                    return
                await one(loop, sent)

        async def bursts(loop: int) -> None:
            for sent in range(0, MAX_REQUESTS_PER_LOOP, BURST):
                if time.monotonic() >= deadline:
                    return
                tasks = [asyncio.create_task(one(loop, sent + i)) for i in range(BURST)]
                _, pending = await asyncio.wait(tasks, timeout=BURST_CUT_S)
                for task in pending:
                    task.cancel()
                statuses["cut"] += len(pending)
                await asyncio.gather(*pending, return_exceptions=True)

        async def streams(loop: int) -> None:
            for sent in range(MAX_REQUESTS_PER_LOOP):
                if time.monotonic() >= deadline:
                    return
                statuses[await stream(url, scenario.body(loop, sent), scenario.headers(loop, sent),
                                      reads=loop % 2 == 0, deadline=deadline)] += 1  # fmt: skip

        run: Callable[[int], Any] = {"bursts": bursts, "streams": streams}.get(noise, requests)
        print(json.dumps({"noisy": "started"}), flush=True)
        await asyncio.gather(*(run(i) for i in range(loops)))
    print(json.dumps({"statuses": dict(sorted(statuses.items()))}), flush=True)


async def stream(url: str, body: bytes, headers: dict[str, str], reads: bool, deadline: float) -> str:
    """One stream on a raw socket, held until ``deadline``: read ``STREAM_READ_BYTES`` every
    ``STREAM_READ_EVERY_S`` (``reads``) or never; its status, ``unread`` or ``0`` (no answer)."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname, parts.port, limit=STREAM_READ_BYTES), REQUEST_TIMEOUT_S
        )
    except (OSError, TimeoutError):
        return "0"
    status = "unread"
    try:
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Length: {len(body)}\r\n"
            f"{head}\r\n".encode()
            + body
        )
        await writer.drain()
        while (left := deadline - time.monotonic()) > 0:
            if not reads:
                await asyncio.sleep(left)
                break
            chunk = await asyncio.wait_for(reader.read(STREAM_READ_BYTES), min(left, REQUEST_TIMEOUT_S))
            if not chunk:
                break
            if status == "unread" and chunk.startswith(b"HTTP/1.1 "):
                status = chunk[9:12].decode("latin-1")
            await asyncio.sleep(min(STREAM_READ_EVERY_S, max(0.0, deadline - time.monotonic())))
    except (OSError, TimeoutError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return status
