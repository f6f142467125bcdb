"""kvlb's own upstream client against real servers on 127.0.0.1: connection reuse (accepted
connections counted), a replica that closes an idle keep-alive connection, the three body framings
from a raw server, the client's disconnect reaching the replica, the pool's bound, https with a
self-signed certificate, and the same under uvloop."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from balancer.config.settings import TimeoutConfig, UpstreamConfig
from balancer.errors import UpstreamError
from balancer.upstream.client import RetryableUpstream, UpstreamClient
from balancer.upstream.connections import HIGH_WATER_BYTES

TIMEOUTS = TimeoutConfig(connect_s=2.0, first_byte_s=5.0, idle_s=5.0)


@dataclass
class RawServer:
    """A TCP server that reads one request head and body per turn and answers with ``reply``."""

    reply: Callable[[int, bytes], Awaitable[bytes | None]]
    accepted: int = 0
    requests: list[bytes] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    received: asyncio.Event = field(default_factory=asyncio.Event)
    close_after_reply: bool = False
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                self.received.set()
                answer = await self.reply(len(self.requests), body)
                if answer is None:  # keep the connection open, say nothing, watch for its end
                    await reader.read()
                    self.disconnected.set()
                    return
                writer.write(answer)
                await writer.drain()
                if self.close_after_reply:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.disconnected.set()
        finally:
            writer.close()


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[RawServer], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(spec: RawServer) -> str:
        server = await asyncio.start_server(spec.handle, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


Start = Callable[[RawServer], Awaitable[str]]


async def read_all(client: UpstreamClient, url: str, body: bytes = b"{}") -> tuple[int, bytes, bool]:
    stream = await client.open(url, "/v1/completions", body, {"content-type": "application/json"})
    data = b"".join([chunk async for chunk in stream.chunks()])
    finished = stream.finished
    stream.release()
    return stream.status, data, finished


async def test_a_second_request_reuses_the_connection(
    raw_server: Start,
) -> None:
    async def reply(n: int, body: bytes) -> bytes:
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\n"
            + f"{{n:{n}}}".encode()
        )

    spec = RawServer(reply)
    url = await raw_server(spec)
    client = UpstreamClient(TIMEOUTS)
    try:
        for n in (1, 2, 3):
            assert await read_all(client, url) == (200, f"{{n:{n}}}".encode(), True)
        assert spec.accepted == 1
        head = spec.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
        assert head[0] == b"POST /v1/completions HTTP/1.1"
        assert sorted(line.split(b":")[0].lower() for line in head[1:]) == [
            b"content-length",
            b"content-type",
            b"host",
        ]
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("answer", "reused"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world", True),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
            True,
        ),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello world", False),
    ],
    ids=["content-length", "chunked", "close-delimited"],
)
async def test_every_framing_from_a_real_server(raw_server: Start, answer: bytes, reused: bool) -> None:
    async def reply(n: int, body: bytes) -> bytes:
        return answer

    spec = RawServer(reply, close_after_reply=not reused)
    url = await raw_server(spec)
    client = UpstreamClient(TIMEOUTS)
    try:
        for _ in range(2):
            assert await read_all(client, url) == (200, b"hello world", True)
        assert spec.accepted == (1 if reused else 2)
    finally:
        await client.aclose()


async def test_an_answer_with_both_lengths_is_framed_by_chunks_and_its_connection_closed(
    raw_server: Start,
) -> None:
    """RFC 9112, 6.3: a replica answering with ``Transfer-Encoding`` and ``Content-Length`` (which
    keeps the connection open, as a smuggler would) gets its next request on a new connection."""

    async def reply(n: int, body: bytes) -> bytes:
        return (
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        )

    spec = RawServer(reply)
    url = await raw_server(spec)
    client = UpstreamClient(TIMEOUTS)
    try:
        for _ in range(2):
            assert await read_all(client, url) == (200, b"hello world", True)
        assert spec.accepted == 2
    finally:
        await client.aclose()


async def test_an_idle_connection_the_replica_closed_is_not_a_client_error(
    raw_server: Start,
) -> None:
    """The replica closes a keep-alive connection after its answer: the next request (which may
    find it in the pool before its close is seen) is sent on a fresh connection and succeeds."""

    async def reply(n: int, body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    spec = RawServer(reply, close_after_reply=True)
    url = await raw_server(spec)
    client = UpstreamClient(TIMEOUTS)
    try:
        assert await read_all(client, url) == (200, b"ok", True)
        assert await read_all(client, url) == (200, b"ok", True)  # no wait: the race, when it happens
        await asyncio.sleep(0.05)
        assert await read_all(client, url) == (200, b"ok", True)
        assert spec.accepted == 3
        assert client.counters.protocol_errors == {"header_overflow": 0, "malformed": 0, "truncated": 0}
    finally:
        await client.aclose()


async def test_a_stale_pooled_connection_is_retried_once_on_a_fresh_one(
    raw_server: Start,
) -> None:
    """The replica reads the next request on a kept-alive connection and closes it unanswered
    (its idle timeout racing the request): the client resends it on a new connection."""
    served = 0

    async def reply(n: int, body: bytes) -> bytes | None:
        nonlocal served
        served += 1
        if served == 2:
            for writer in spec.writers:
                writer.close()
            return b""
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    spec = RawServer(reply)
    url = await raw_server(spec)
    client = UpstreamClient(TIMEOUTS)
    try:
        assert await read_all(client, url) == (200, b"ok", True)
        assert await read_all(client, url) == (200, b"ok", True)
        assert spec.accepted == 2 and client.counters.stale_retries == 1
    finally:
        await client.aclose()


async def test_a_fresh_connection_closed_before_the_answer_is_retryable(
    raw_server: Start,
) -> None:
    async def reply(n: int, body: bytes) -> bytes:
        return b""

    url = await raw_server(RawServer(reply, close_after_reply=True))
    client = UpstreamClient(TIMEOUTS)
    try:
        with pytest.raises(RetryableUpstream, match="truncated") as info:
            await client.open(url, "/v1/completions", b"{}", {})
        assert info.value.reason == "connect"
    finally:
        await client.aclose()


async def test_a_malformed_answer_is_retryable_and_counted(
    raw_server: Start,
) -> None:
    async def reply(n: int, body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n"

    url = await raw_server(RawServer(reply))
    client = UpstreamClient(TIMEOUTS)
    try:
        with pytest.raises(RetryableUpstream, match=r"malformed"):
            await client.open(url, "/v1/completions", b"{}", {})
        assert client.counters.protocol_errors["malformed"] == 1
    finally:
        await client.aclose()


async def test_the_configured_header_bound_refuses_a_longer_answer(raw_server: Start) -> None:
    async def reply(n: int, body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nA: 1\r\nB: 2\r\nC: 3\r\nContent-Length: 0\r\n\r\n"

    url = await raw_server(RawServer(reply))
    client = UpstreamClient(TIMEOUTS, UpstreamConfig(max_headers=3))
    try:
        with pytest.raises(RetryableUpstream, match=r"header_overflow"):
            await client.open(url, "/v1/completions", b"{}", {})
        assert client.counters.protocol_errors["header_overflow"] == 1
    finally:
        await client.aclose()
    roomy = UpstreamClient(TIMEOUTS, UpstreamConfig(max_headers=4))
    try:
        assert await read_all(roomy, url) == (200, b"", True)
    finally:
        await roomy.aclose()


async def test_a_cut_body_breaks_the_stream(raw_server: Start) -> None:
    async def reply(n: int, body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this"

    url = await raw_server(RawServer(reply, close_after_reply=True))
    client = UpstreamClient(TIMEOUTS)
    try:
        stream = await client.open(url, "/v1/completions", b"{}", {})
        chunks = stream.chunks()
        assert await anext(chunks) == b"only this"
        with pytest.raises(UpstreamError, match="replica stream broke"):
            await anext(chunks)
        assert not stream.finished
        stream.close()
        assert client.counters.protocol_errors["truncated"] == 1
    finally:
        await client.aclose()


async def test_close_reaches_the_replica(raw_server: Start) -> None:
    """A client that goes away closes the upstream connection: the replica sees its end."""

    async def reply(n: int, body: bytes) -> bytes | None:
        if n == 1:
            return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n"
        return None

    spec = RawServer(reply)
    url = await raw_server(spec)
    client = UpstreamClient(TIMEOUTS)
    try:
        stream = await client.open(url, "/v1/completions", b"{}", {})
        chunks = stream.chunks()
        assert await anext(chunks) == b"first"
        assert not stream.finished
        await chunks.aclose()
        stream.close()
        async with asyncio.timeout(5):
            await spec.disconnected.wait()
        stream.release()  # after close: a no-op, the connection is not pooled
        assert client.pool.open_connections == 0
    finally:
        await client.aclose()


async def test_release_of_an_unfinished_answer_closes_the_connection(
    raw_server: Start,
) -> None:
    async def reply(n: int, body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"

    spec = RawServer(reply)
    url = await raw_server(spec)
    client = UpstreamClient(TIMEOUTS)
    try:
        stream = await client.open(url, "/v1/completions", b"{}", {})
        assert await anext(stream.chunks()) == b"half"
        stream.release()
        async with asyncio.timeout(5):
            await spec.disconnected.wait()
        assert client.pool.open_connections == 0
    finally:
        await client.aclose()


async def test_reading_pauses_while_the_relay_does_not_take(raw_server: Start) -> None:
    """A replica that sends 4 MB to a relay that reads nothing: kvlb holds at most the high-water
    mark (plus one socket read), the rest waits in the kernel and the replica's send buffer."""
    size = 4 * 1024 * 1024

    async def reply(n: int, body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size

    url = await raw_server(RawServer(reply))
    client = UpstreamClient(TIMEOUTS)
    try:
        stream = await client.open(url, "/v1/completions", b"{}", {})
        for _ in range(20):  # let the replica write what the connection will take
            await asyncio.sleep(0.01)
        conn = stream._conn
        assert 0 < conn.buffered <= HIGH_WATER_BYTES + 256 * 1024
        total = 0
        async for chunk in stream.chunks():
            total += len(chunk)
            assert conn.buffered <= HIGH_WATER_BYTES + 256 * 1024
        assert total == size and stream.finished
        stream.release()
    finally:
        await client.aclose()


async def test_aclose_closes_connections_in_use(raw_server: Start) -> None:
    async def reply(n: int, body: bytes) -> bytes | None:
        return None

    spec = RawServer(reply)
    url = await raw_server(spec)
    client = UpstreamClient(TimeoutConfig(first_byte_s=10.0))
    opening = asyncio.create_task(client.open(url, "/v1/completions", b"{}", {}))
    async with asyncio.timeout(5):
        await spec.received.wait()
    await client.aclose()
    async with asyncio.timeout(5):
        await spec.disconnected.wait()
    with pytest.raises(RetryableUpstream):
        await opening


async def test_the_pool_bound_makes_requests_wait_within_first_byte_s(raw_server: Start) -> None:
    """One connection allowed, in use by a streaming answer: another request waits for it, within
    ``first_byte_s``, and then reuses it."""
    release = asyncio.Event()
    streaming = asyncio.Event()

    async def reply(n: int, body: bytes) -> bytes:
        if n == 1:
            spec.writers[0].write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
            streaming.set()
            await release.wait()
        return b"ok" if n == 1 else b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    spec = RawServer(reply)
    url = await raw_server(spec)
    client = UpstreamClient(TimeoutConfig(first_byte_s=0.3), UpstreamConfig(max_connections=1))
    try:
        first = asyncio.create_task(read_all(client, url))
        await streaming.wait()
        with pytest.raises(RetryableUpstream, match=r"no response headers within 0\.3s"):
            await client.open(url, "/v1/completions", b"{}", {})
        second = asyncio.create_task(read_all(client, url))
        await asyncio.sleep(0.05)
        release.set()
        assert await first == (200, b"ok", True)
        assert await second == (200, b"ok", True)
        assert spec.accepted == 1 and client.counters.pool_waits == 2
    finally:
        release.set()
        await client.aclose()


async def test_retryable_statuses_and_connect_errors(
    raw_server: Start,
) -> None:
    async def reply(n: int, body: bytes) -> bytes:
        return b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy"

    url = await raw_server(RawServer(reply))
    client = UpstreamClient(TIMEOUTS)
    try:
        with pytest.raises(RetryableUpstream, match="replica answered 503") as info:
            await client.open(url, "/v1/completions", b"{}", {})
        assert (info.value.reason, info.value.status) == ("status", 503)
        with pytest.raises(RetryableUpstream, match=r"cannot connect to http://127\.0\.0\.1:1") as info:
            await client.open("http://127.0.0.1:1", "/v1/completions", b"{}", {})
        assert info.value.reason == "connect"
    finally:
        await client.aclose()


async def test_https_to_a_replica_with_a_self_signed_certificate(tmp_path: Path) -> None:
    from security.certs import self_signed

    pem = self_signed(tmp_path)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(pem.cert, pem.key)

    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response({"body": (await request.read()).decode()})

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=served).start()
    url = f"https://localhost:{runner.addresses[0][1]}"
    trusting = UpstreamClient(TIMEOUTS, ssl_context=ssl.create_default_context(cafile=str(pem.cert)))
    default = UpstreamClient(TIMEOUTS)
    try:
        for _ in range(2):
            assert await read_all(trusting, url, b"hi") == (200, b'{"body": "hi"}', True)
        assert trusting.pool.open_connections == 1
        with pytest.raises(RetryableUpstream, match="CERTIFICATE_VERIFY_FAILED") as info:
            await default.open(url, "/v1/completions", b"{}", {})  # verified against the system's CAs
        assert info.value.reason == "connect"
    finally:
        await trusting.aclose()
        await default.aclose()
        await runner.cleanup()


def test_reuse_and_streaming_under_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def main() -> tuple[list[bytes], int]:

        async def answer(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"data: a\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response

        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        client = UpstreamClient(TIMEOUTS)
        bodies = []
        try:
            for _ in range(3):
                stream = await client.open(url, "/v1/completions", b"{}", {})
                bodies.append(b"".join([chunk async for chunk in stream.chunks()]))
                assert stream.finished and stream.answered
                stream.release()
            return bodies, client.pool.open_connections
        finally:
            await client.aclose()
            await runner.cleanup()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        bodies, connections = runner.run(main())
    assert bodies == [b"data: a\n\ndata: [DONE]\n\n"] * 3
    assert connections == 1


async def test_idle_connections_of_a_replica_no_longer_asked_are_closed(raw_server: Start) -> None:
    async def reply(n: int, body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    left, staying = RawServer(reply), RawServer(reply)
    left_url, staying_url = await raw_server(left), await raw_server(staying)
    client = UpstreamClient(TIMEOUTS, UpstreamConfig(idle_ttl_s=0.2))
    try:
        assert await read_all(client, left_url) == (200, b"ok", True)
        await asyncio.sleep(0.3)  # the left replica's connection is past its time, and nobody asks it
        assert not left.disconnected.is_set()
        assert await read_all(client, staying_url) == (200, b"ok", True)
        await asyncio.wait_for(left.disconnected.wait(), 5)
        assert not staying.disconnected.is_set()
    finally:
        await client.aclose()
