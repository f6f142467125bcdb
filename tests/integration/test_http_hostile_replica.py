"""Replica answers kvlb must not relay as they are (the adversarial run of 2026-11-30, branch
h-adversary), over real sockets: a raw TCP replica on 127.0.0.1 behind a real balancer.

* Header values holding control characters: kvlb relays the replica's ``Content-Type``, and aiohttp
  refuses to write a header value holding a control character other than HTAB, so such an answer
  was a 500 and a traceback for the client.
* A status outside 100..599 (``HTTP/1.1 999``) was relayed as is; RFC 9110 (15) has a client take
  it as a server error.

kvlb's parser now refuses both as malformed, before any byte reached the client: the request is
retried elsewhere, or the client gets the 502 of a replica that failed to answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from kvlb_harness import MODEL, balancer_over, metric_value

BODY = b'{"id": "c1", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]}'


def answer_with(content_type: bytes, status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
        status,
        content_type,
        len(BODY),
        BODY,
    )


@asynccontextmanager
async def replica_answering(answer: bytes) -> AsyncIterator[str]:
    """A raw replica (its URL yielded): ``GET`` answers ok, ``POST`` answers ``answer``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if head.startswith(b"GET "):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                else:
                    writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "content_type",
    [b"text/event-stream; x=\x0bq", b"application/json\x7f", b"application/json; a=\x1b[31m"],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_whose_headers_hold_control_characters_is_a_502_not_a_500(
    content_type: bytes, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with replica_answering(answer_with(content_type)) as url, balancer_over(url) as (balancer, session):
        body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1, "stream": stream}
        async with session.post(balancer.url + "/v1/completions", json=body) as response:
            answer = await response.read()
        assert response.status == 502, answer
        error = json.loads(answer)["error"]
        assert error["code"] == 502 and "bad header value" in error["message"]
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []
        async with session.get(balancer.url + "/metrics") as metrics:
            text = await metrics.text()
        assert metric_value(text, "kvlb_http_inflight_requests") == 0
        assert metric_value(text, "kvlb_upstream_protocol_errors_total", reason="malformed") >= 1


async def test_a_tab_in_a_header_value_is_still_relayed() -> None:
    async with (
        replica_answering(answer_with(b"application/json;\tcharset=utf-8")) as url,
        balancer_over(url) as (b, session),
    ):
        body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1}
        async with session.post(b.url + "/v1/completions", json=body) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "application/json;\tcharset=utf-8"
            assert await response.read() == BODY


@pytest.mark.parametrize("status", [b"999 Weird", b"600 X", b"099 X"])
async def test_a_status_outside_100_to_599_is_a_502(status: bytes) -> None:
    async with (
        replica_answering(answer_with(b"application/json", status)) as url,
        balancer_over(url) as (b, session),
    ):
        body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1}
        async with session.post(b.url + "/v1/completions", json=body) as response:
            answer = await response.read()
        assert response.status == 502, answer
        assert "outside 100..599" in json.loads(answer)["error"]["message"]
