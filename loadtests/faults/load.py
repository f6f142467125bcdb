"""Steady load for fault runs, and the classification of every request's outcome (I/O).

A fixed-rate open loop (one request every ``1 / rate`` seconds, at most ``max_outstanding`` at once):
half of the requests stream. Prompts are token ids of ``4k + 1`` tokens and ``max_tokens`` is 4, so
neither engine ever stores a partial block (TRT-LLM keys ``(prompt + output)[:-1]``) and the index can
be compared block for block with the engines. Prefixes come from a pool larger than the engines'
caches, so old blocks keep being evicted (and removed from the index) under load.

Outcomes (the fault suite's and the soak's invariants are stated on them):

* ``ok``: 200 and a whole answer (a JSON body, or a stream ending with ``[DONE]``);
* ``stream_error``: a stream that ended with an explicit ``data: {"error": ...}`` event;
* ``upstream_error``: a non-streaming 502/504 whose replica failed *after* answering began (kvlb
  does not retry once the replica sent a byte);
* ``refused``: 429/503 with ``Retry-After`` (admission or no healthy replica);
* ``lost``: anything else: a 502 for a request that failed before any byte (it should have been
  retried), a stream cut without ``[DONE]`` or an error event, a connection error, a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from balancer.errors import UpstreamError
from balancer.upstream.sse import SseEvents

MODEL = "sim-test"
MAX_TOKENS = 4
PROMPT_TOKENS = 17
PREFIXES = 64
REQUEST_TIMEOUT_S = 30.0


@dataclass
class Record:
    started: float
    outcome: str = "pending"
    status: int = 0
    latency_s: float = 0.0
    replica: str = ""
    detail: str = ""


@dataclass
class Load:
    url: str
    rate: float = 20.0
    max_outstanding: int = 64
    seed: int = 1
    stream_share: float = 0.5
    records: list[Record] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fault-load")

    async def stop(self) -> None:
        """Stop sending and wait for every request in flight (bounded by their own timeout)."""
        self._stop.set()
        if self._task is not None:
            await self._task

    async def long_streams(
        self, count: int, max_tokens: int = 64
    ) -> tuple[list[asyncio.Task[None]], list[Record]]:
        """Open ``count`` long streams (counted with the load) and return once each has started."""
        started = [asyncio.Event() for _ in range(count)]
        records = [Record(time.monotonic()) for _ in range(count)]
        self.records.extend(records)
        tasks = [asyncio.create_task(self._long(i, max_tokens, started[i], records[i])) for i in range(count)]
        async with asyncio.timeout(10):
            for event in started:
                await event.wait()
        return tasks, records

    async def _long(self, index: int, max_tokens: int, started: asyncio.Event, record: Record) -> None:
        body = {
            "model": MODEL,
            "prompt": [7, index, *range(100, 115)],
            "max_tokens": max_tokens,
            "stream": True,
        }
        chunks = bytearray()
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session,
                session.post(self.url + "/v1/completions", json=body) as response,
            ):
                record.status, record.replica = (
                    response.status,
                    response.headers.get("x-kvlb-replica", ""),
                )
                async for chunk in response.content.iter_any():
                    chunks += chunk
                    started.set()
                record.outcome, record.detail = classify(
                    response.status, response.headers, bytes(chunks), True
                )
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            record.outcome, record.detail = "lost", f"{exc.__class__.__name__}: {exc}"[:200]
        finally:
            started.set()
            record.latency_s = time.monotonic() - record.started

    def counts(self) -> Counter[str]:
        return Counter(r.outcome for r in self.records)

    def latencies_s(self, since: float = 0.0, until: float = float("inf")) -> list[float]:
        """Latencies of the successful requests started in ``[since, until)`` (monotonic)."""
        return sorted(r.latency_s for r in self.records if r.outcome == "ok" and since <= r.started < until)

    async def _run(self) -> None:
        rng = random.Random(self.seed)
        prefixes = [[rng.randrange(1000, 30000) for _ in range(12)] for _ in range(PREFIXES)]
        gate = asyncio.Semaphore(self.max_outstanding)
        tasks: set[asyncio.Task[None]] = set()
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            next_at = time.monotonic()
            while not self._stop.is_set():
                prompt = [
                    *rng.choice(prefixes),
                    *(rng.randrange(30000, 40000) for _ in range(PROMPT_TOKENS - 12)),
                ]
                stream = rng.random() < self.stream_share
                record = Record(time.monotonic())
                self.records.append(record)
                await gate.acquire()
                task = asyncio.create_task(self._one(session, gate, record, prompt, stream))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_at += 1.0 / self.rate
                delay_s = next_at - time.monotonic()
                if delay_s > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), delay_s)
                else:
                    next_at = time.monotonic()  # fell behind: do not burst to catch up
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(
        self,
        session: aiohttp.ClientSession,
        gate: asyncio.Semaphore,
        record: Record,
        prompt: list[int],
        stream: bool,
    ) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream}
        try:
            async with session.post(self.url + "/v1/completions", json=body) as response:
                record.status = response.status
                record.replica = response.headers.get("x-kvlb-replica", "")
                raw = await response.read()
                record.outcome, record.detail = classify(response.status, response.headers, raw, stream)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            record.outcome, record.detail = "lost", f"{exc.__class__.__name__}: {exc}"[:200]
        finally:
            record.latency_s = time.monotonic() - record.started
            gate.release()


def classify(
    status: int, headers: aiohttp.typedefs.LooseHeaders, raw: bytes, stream: bool
) -> tuple[str, str]:
    text = raw.decode("utf-8", "replace")
    if status == 200 and stream:
        try:
            events = [data.decode("utf-8", "replace") for data in _sse_payloads(raw)]
        except UpstreamError as exc:
            return "lost", str(exc)
        if events and events[-1] == "[DONE]":
            return "ok", ""
        if events and '"error"' in events[-1]:
            return "stream_error", events[-1][:200]
        return "lost", f"stream cut without [DONE] or an error event after {len(events)} events"
    if status == 200:
        try:
            return ("ok", "") if json.loads(raw).get("choices") else ("lost", text[:200])
        except ValueError:
            return "lost", f"200 with a broken body: {text[:200]}"
    message = _message(raw)
    if status in (429, 503) and "Retry-After" in headers:
        return "refused", f"{status}: {message}"
    if status in (502, 504) and "while answering" in message:
        return "upstream_error", message
    return "lost", f"{status}: {message}"


def _sse_payloads(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of a whole event-stream body (a last event may lack its blank line)."""
    events = SseEvents()
    return events.feed(raw) + events.close()


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
