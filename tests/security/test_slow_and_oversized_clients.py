"""Hostile connections: slowloris (headers trickled or never finished), oversized header lines, too
many headers, huge request lines. The balancer answers 400 to the malformed ones, closes idle and
half-sent connections after ``timeouts.client_idle_s``, and keeps serving everyone else meanwhile.
"""

from __future__ import annotations

import asyncio
import time

from unstalled import Unstalled
from upstream_stub import MODEL, StubRun, balancer_over

BODY = b'{"model": "%s", "prompt": [1, 2, 3, 4, 5], "max_tokens": 1}' % MODEL.encode()
IDLE_S = 1.0
SLOW_CLIENTS = 100


def address(run: StubRun) -> tuple[str, int]:
    host, port = run.balancer.url.removeprefix("http://").split(":")
    return host, int(port)


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    """True if the server closes (EOF or reset) within ``timeout_s``; what it sent is ignored."""
    try:
        async with asyncio.timeout(timeout_s):
            while await reader.read(4096):
                pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


async def raw_exchange(run: StubRun, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(*address(run))
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(5):
            return await reader.read(65536)
    finally:
        writer.close()


async def test_slowloris_connections_are_closed_while_others_are_served() -> None:
    async with balancer_over(1, timeouts__client_idle_s=IDLE_S) as run:
        host, port = address(run)
        conns = [await asyncio.open_connection(host, port) for _ in range(SLOW_CLIENTS)]
        for _, writer in conns:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")

        async def trickle() -> None:  # one more header byte every 0.2 s: never a complete request
            for _ in range(20):
                for _, writer in conns:
                    if not writer.is_closing():
                        writer.write(b"X")
                await asyncio.sleep(0.2)

        trickling = asyncio.create_task(trickle())
        started = time.monotonic()
        url = run.balancer.url + "/v1/completions"
        for _ in range(5):  # served promptly during the attack (a stall of this process not counted)
            begin = Unstalled()
            async with run.session.post(url, data=BODY) as response:
                assert response.status == 200
            assert begin.seconds() < 0.5
        closed = await asyncio.gather(*(closed_within(r, IDLE_S + 3.0) for r, _ in conns))
        elapsed_s = time.monotonic() - started
        trickling.cancel()
        for _, writer in conns:
            writer.close()
        assert all(closed), f"{closed.count(False)} of {SLOW_CLIENTS} slow connections still open"
        assert elapsed_s < IDLE_S + 3.0
        async with run.session.get(run.balancer.url + "/healthz") as response:
            assert response.status == 200


async def test_an_idle_connection_is_closed_after_client_idle_s() -> None:
    async with balancer_over(1, timeouts__client_idle_s=IDLE_S) as run:
        reader, writer = await asyncio.open_connection(*address(run))
        started = time.monotonic()
        assert await closed_within(reader, IDLE_S + 2.0)
        assert time.monotonic() - started >= IDLE_S * 0.8
        writer.close()


async def test_oversized_and_malformed_heads_get_400_and_the_balancer_survives() -> None:
    async with balancer_over(1) as run:
        heads = {
            "header over 8 KiB": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
            "500 headers": b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-H%d: v\r\n" % i for i in range(500))
            + b"\r\n",
            "request line over 8 KiB": b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            "garbage": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64 + b"\r\n\r\n",
            "bad content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
            "two content-lengths": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
            b"Content-Length: 4\r\n\r\nabcd",
            "chunked and length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        }
        for name, head in heads.items():
            answer = await raw_exchange(run, head)
            status_line = answer.split(b"\r\n", 1)[0]
            assert status_line.split(b" ")[1:2] in ([b"400"], [b"413"], [b"414"], [b"431"], []), (
                name,
                answer[:200],
            )
            assert not status_line.endswith(b" 200 OK"), name
        async with run.session.post(run.balancer.url + "/v1/completions", data=BODY) as response:
            assert response.status == 200
