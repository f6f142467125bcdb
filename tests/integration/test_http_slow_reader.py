"""A client that stops reading a non-streaming answer (the adversarial run of 2026-11-30, branch
h-adversary), over real sockets: a replica on 127.0.0.1 answering a 24 MiB JSON body, a real
balancer with ``timeouts.total_s`` of 3 s, and a client that sends its request and reads no more
than its socket buffers take.

Before, the handler returned the answer to aiohttp unwritten: the request's slot was given back at
once, and the answer's bytes stayed in kvlb, with the connection, for as long as the client kept
the connection open without reading (10 such clients of 20 MB answers: RSS 133 → 494 MB, still so
20 s later, with every in-flight gauge at 0). Now the answer is written while the request holds its
slot, and a client that has not read it by the deadline loses its connection (a 499).
"""

from __future__ import annotations

import asyncio
import json
import socket

from aiohttp import ClientSession, web
from kvlb_harness import MODEL, balancer_over, completion_replica, metric_value

TOTAL_S = 3.0
HELD_CHECK_S = 0.5
"""How long after the request first holds its slot the test looks again: well within ``TOTAL_S``, so a
machine that stalls the test for a second or two still sees the slot held."""
JSON_ANSWER_BYTES = 24 * 1024 * 1024  # more than the kernel buffers of both ends (4 MiB by default)


async def large_json(request: web.Request) -> web.StreamResponse:
    await request.read()
    return web.json_response({"id": "c1", "object": "text_completion", "pad": "x" * JSON_ANSWER_BYTES})


async def inflight_becomes(session: ClientSession, url: str, value: int, *, within_s: float) -> bool:
    """Poll ``kvlb_http_inflight_requests`` every 50 ms until it reads ``value`` (True) or
    ``within_s`` passes (False)."""
    try:
        async with asyncio.timeout(within_s):
            while True:
                async with session.get(url + "/metrics") as response:
                    if metric_value(await response.text(), "kvlb_http_inflight_requests") == value:
                        return True
                await asyncio.sleep(0.05)
    except TimeoutError:
        return False


async def test_a_client_that_stops_reading_its_answer_loses_its_connection_at_the_deadline() -> None:
    async with (
        completion_replica(large_json) as url,
        balancer_over(url, timeouts={"total_s": TOTAL_S}) as (balancer, session),
    ):
        host, port = balancer.url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
        body = json.dumps({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1}).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        try:
            # the request reaches its slot (on a loaded machine that may take a while) ...
            assert await inflight_becomes(session, balancer.url, 1, within_s=10.0)
            # ... and holds it while its answer is being written (before: given back at once)
            await asyncio.sleep(HELD_CHECK_S)
            async with session.get(balancer.url + "/metrics") as response:
                assert metric_value(await response.text(), "kvlb_http_inflight_requests") == 1
            # past the deadline, still not reading: the slot is given back
            assert await inflight_becomes(session, balancer.url, 0, within_s=TOTAL_S + 10.0)
            async with session.get(balancer.url + "/metrics") as response:
                text = await response.text()
            assert metric_value(text, "kvlb_http_requests_total", status="499") == 1
            # the connection is gone: what the kernel still held is read, then its end (or a reset)
            try:
                async with asyncio.timeout(5.0):
                    while await reader.read(1 << 20):
                        pass
            except ConnectionResetError:
                pass
            except TimeoutError:
                raise AssertionError(
                    "the balancer kept the connection of a client that stopped reading"
                ) from None
        finally:
            writer.close()
