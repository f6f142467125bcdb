"""A client that stops reading its answer gives back what it holds within
``timeouts.client_write_stall_s`` (``balancer.api.client_writes``), over real sockets: a fake
replica on 127.0.0.1 streaming events as fast as kvlb takes them, a real balancer, and raw-socket
clients with a small ``SO_RCVBUF`` that send a request and then read nothing (or read slowly).

Before, such a client held its admission slot, its replica's stream and load, and the answer's
bytes until ``timeouts.total_s`` (600 s by default), and an event stream's connection after that
(with megabytes in the kernel's send queue) for as long as the client kept it open.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from kvlb_harness import MODEL, balancer_over, completion_replica, metric_value, sse_payloads
from unstalled import Unstalled

from balancer.config import Settings, from_mapping
from balancer.errors import ConfigError

STALL_S = 1.0
EVENT = b"data: " + json.dumps({"choices": [{"text": "x" * 2000, "index": 0}]}).encode() + b"\n\n"
MAX_STREAM_BYTES = 64 * 1024 * 1024
"""Most a fake replica's stream sends (far more than every buffer between it and a client)."""
MAX_STREAM_S = 30.0


@dataclass
class Streams:
    """What the fake replica saw of its streams."""

    started: int = 0
    ended_by_kvlb: list[float] = field(default_factory=list)
    """Monotonic times at which kvlb closed a stream before its end (the replica's write failed)."""


@asynccontextmanager
async def streaming_replica(answer_bytes: int = MAX_STREAM_BYTES) -> AsyncIterator[tuple[str, Streams]]:
    """A replica streaming ``EVENT`` as fast as kvlb reads it, ``answer_bytes`` of them (bounded by
    ``MAX_STREAM_S``) then ``[DONE]``; for a request whose ``max_tokens`` is 1, one event."""
    streams = Streams()

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        streams.started += 1
        limit = len(EVENT) if body.get("max_tokens") == 1 else answer_bytes
        sent = 0
        ended = time.monotonic() + MAX_STREAM_S
        try:
            while sent < limit and time.monotonic() < ended:
                await response.write(EVENT)
                sent += len(EVENT)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            streams.ended_by_kvlb.append(time.monotonic())
        except asyncio.CancelledError:
            streams.ended_by_kvlb.append(time.monotonic())
            raise
        return response

    async with completion_replica(complete) as url:
        yield url, streams


async def stalled_client(url: str, body: dict[str, object]) -> tuple[socket.socket, Unstalled]:
    """A raw socket with a 4 KiB receive buffer that sends ``body`` to ``/v1/completions`` and then
    reads nothing; returns it and a stopwatch started when its request was sent (the balancer and
    the replica run on this loop: a loaded machine's stall of it is not counted)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    data = json.dumps(body).encode()
    await loop.sock_sendall(
        sock,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data),
    )
    return sock, Unstalled()


async def drain_until_closed(sock: socket.socket, timeout_s: float = 5.0) -> int:
    """Read ``sock`` until its end or a reset; the bytes read. Fails if it stays open."""
    loop = asyncio.get_running_loop()
    total = 0
    try:
        async with asyncio.timeout(timeout_s):
            while data := await loop.sock_recv(sock, 1 << 20):
                total += len(data)
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(
            f"the connection is still open after {timeout_s} s ({total} bytes read)"
        ) from None
    return total


def unchunked(answer: bytes) -> bytes:
    """The body of a whole HTTP answer in ``Transfer-Encoding: chunked``."""
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(body)
        body += rest[:size]
        rest = rest[size + 2 :]


async def metrics_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as response:
        return await response.text()


async def wait_metric(
    session: aiohttp.ClientSession, url: str, name: str, value: float, timeout_s: float, **labels: str
) -> float:
    """Poll ``/metrics`` until ``name`` is ``value``; the seconds it took."""
    started = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while metric_value(await metrics_text(session, url), name, **labels) != value:  # noqa: ASYNC110 - polls another component
            await asyncio.sleep(0.05)
    return time.monotonic() - started


STREAM = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 4096, "stream": True}
SHORT = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1, "stream": True}


async def test_clients_that_stop_reading_a_stream_are_dropped_within_the_bound() -> None:
    """Two stalled streams take both slots; other clients meanwhile are refused a slot but get
    their ``/healthz`` at once; within the bound the stalled connections are reset (their kernel
    queues dropped, not delivered), every slot, byte and replica load is back, the replica's
    streams are closed, and the next request is served."""
    async with (
        streaming_replica() as (url, streams),
        balancer_over(
            url,
            timeouts={"total_s": 60.0, "client_write_stall_s": STALL_S},
            limits={"max_inflight": 2, "max_queued": 0},
        ) as (balancer, session),
    ):
        sockets = [await stalled_client(balancer.url, STREAM) for _ in range(2)]
        try:
            await wait_metric(session, balancer.url, "kvlb_http_inflight_requests", 2, 5.0)
            await asyncio.sleep(STALL_S / 2)  # the streams fill every buffer and wait
            # meanwhile: every slot is taken, and other clients are not held up
            started = Unstalled()  # the balancer's loop is this process's: its stall is not counted
            async with session.get(balancer.url + "/healthz") as response:
                assert response.status == 200
            assert started.seconds() < 0.5
            async with session.post(balancer.url + "/v1/completions", json=SHORT) as response:
                assert response.status == 429, await response.text()
            # the bound passes: both are dropped
            await wait_metric(
                session,
                balancer.url,
                "kvlb_http_client_write_stalls_total",
                2,
                5.0,
                face="http",
                limit="client_write_stall_s",
            )
            dropped_after = [sent.seconds() for _, sent in sockets]
            text = await metrics_text(session, balancer.url)
            assert metric_value(text, "kvlb_http_inflight_requests") == 0
            assert metric_value(text, "kvlb_replica_inflight_seqs", replica="r0") == 0
            assert metric_value(text, "kvlb_admission_body_bytes") == 0
            assert metric_value(text, "kvlb_http_requests_total", status="499") == 2
            # within the bound (1.25 times it: the check's period) plus the time to fill the buffers
            assert max(dropped_after) < STALL_S * 1.25 + 2.0, dropped_after
            for sock, _ in sockets:  # reset: the megabytes queued for it are not delivered
                assert await drain_until_closed(sock) < 1024 * 1024
            # the replica's streams were closed by kvlb, not left generating
            async with asyncio.timeout(5.0):
                while len(streams.ended_by_kvlb) < 2:  # noqa: ASYNC110 - another component's state
                    await asyncio.sleep(0.02)
            async with session.post(balancer.url + "/v1/completions", json=SHORT) as response:
                assert response.status == 200
                assert sse_payloads(await response.read())[-1] == "[DONE]"
        finally:
            for sock, _ in sockets:
                sock.close()


async def test_a_stream_not_read_by_its_deadline_loses_its_connection() -> None:
    """``timeouts.total_s`` below the bound: a write still waiting at the deadline is the client's
    fault, so its connection is aborted too (before, the stream ended with an error event that could
    not be written, and the connection stayed open while the client kept it)."""
    async with (
        streaming_replica() as (url, _),
        balancer_over(url, timeouts={"total_s": 1.0, "client_write_stall_s": 30.0}) as (balancer, session),
    ):
        sock, _ = await stalled_client(balancer.url, STREAM)
        try:
            await wait_metric(
                session,
                balancer.url,
                "kvlb_http_client_write_stalls_total",
                1,
                5.0,
                face="http",
                limit="total_s",
            )
            assert await drain_until_closed(sock) < 1024 * 1024
            text = await metrics_text(session, balancer.url)
            assert metric_value(text, "kvlb_http_inflight_requests") == 0
            assert metric_value(text, "kvlb_http_requests_total", status="499") == 1
        finally:
            sock.close()


async def test_a_non_streaming_answer_the_client_stops_reading_is_dropped_at_the_bound() -> None:
    """The same for an answer that is not a stream: relayed as it arrives (the byte budget is
    smaller than it), and buffered whole then written."""
    answer = json.dumps({"id": "c1", "object": "text_completion", "pad": "x" * (24 * 1024 * 1024)}).encode()

    async def large_json(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    async with completion_replica(large_json) as url:
        for budget in (16 * 1024 * 1024, 64 * 1024 * 1024):  # relayed as it arrives, then buffered
            async with balancer_over(
                url,
                timeouts={"total_s": 60.0, "client_write_stall_s": STALL_S},
                limits={"max_inflight_body_bytes": budget, "max_body_bytes": 1024 * 1024},
            ) as (balancer, session):
                sock, sent = await stalled_client(
                    balancer.url, {"model": MODEL, "prompt": [1, 2], "max_tokens": 1}
                )
                try:
                    await wait_metric(
                        session,
                        balancer.url,
                        "kvlb_http_client_write_stalls_total",
                        1,
                        10.0,
                        face="http",
                        limit="client_write_stall_s",
                    )
                    assert sent.seconds() < STALL_S * 1.25 + 3.0
                    assert await drain_until_closed(sock) < 1024 * 1024
                    text = await metrics_text(session, balancer.url)
                    assert metric_value(text, "kvlb_http_inflight_requests") == 0
                    assert metric_value(text, "kvlb_admission_body_bytes") == 0
                finally:
                    sock.close()


async def test_a_client_that_reads_slowly_but_steadily_is_not_cut() -> None:
    """A client that takes a few KiB every fifth of the bound, far slower than the replica answers
    (every buffer full, kvlb's writes waiting), keeps its stream for four times the bound, and then
    gets all of it."""
    answer_bytes = 8 * 1024 * 1024
    async with (
        streaming_replica(answer_bytes) as (url, streams),
        balancer_over(url, timeouts={"total_s": 60.0, "client_write_stall_s": STALL_S}) as (
            balancer,
            session,
        ),
    ):
        sock, _ = await stalled_client(balancer.url, STREAM)
        loop = asyncio.get_running_loop()
        try:
            received = bytearray()
            slow_until = time.monotonic() + 4 * STALL_S
            while time.monotonic() < slow_until:
                await asyncio.sleep(STALL_S / 5)
                received += await asyncio.wait_for(loop.sock_recv(sock, 4096), 1.0)
            text = await metrics_text(session, balancer.url)
            assert metric_value(text, "kvlb_http_client_write_stalls_total") == 0
            assert metric_value(text, "kvlb_http_inflight_requests") == 1
            async with asyncio.timeout(30.0):  # now it reads fast: the whole stream, to its end
                while not received.endswith(b"\r\n0\r\n\r\n"):
                    data = await loop.sock_recv(sock, 1 << 20)
                    assert data, "the connection ended before the stream"
                    received += data
            events = sse_payloads(unchunked(bytes(received)))
            assert events[-1] == "[DONE]"
            assert len(events) == -(-answer_bytes // len(EVENT)) + 1
            assert not streams.ended_by_kvlb
        finally:
            sock.close()


@pytest.mark.parametrize("stall_s", [0.0, -1.0])
def test_the_bound_must_be_positive(stall_s: float) -> None:
    with pytest.raises(ConfigError, match="client_write_stall_s"):
        from_mapping(Settings, {"timeouts": {"client_write_stall_s": stall_s}}).validate()
