"""A request body's HTTP chunks are bounded (``limits.max_body_chunks``), over raw sockets.

aiohttp parses each chunk of a ``Transfer-Encoding: chunked`` body with a Python call on the event
loop before kvlb reads it, so a body sent in one-byte chunks held the loop for seconds (the
adversarial run of 2026-11-30: a 1 MB body in 1,000,065 chunks, ``/healthz`` 0.36–0.73 s). A body in
more chunks than the limit is refused with 400 and its connection closed, so the rest of it is never
parsed; one within the limit is served as before. The chunks are counted as kvlb reads the body: a
small body that has arrived whole before its handler runs was parsed already, and is served."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

import pytest
from kvlb_harness import MODEL, Harness, metric, nothing_held, read_answer, running, shared_deepseek, wait_for

from balancer.tokenizer.tokenizer import Tokenizer


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def chunked(body: bytes, size: int) -> bytes:
    pieces = (body[i : i + size] for i in range(0, len(body), size))
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


async def send(
    h: Harness, body: bytes, chunk_bytes: int, *, refused: bool = True
) -> tuple[int, dict[str, Any], bool]:
    """The status, the JSON answer, and (``refused``) whether kvlb closed the connection after
    it."""
    port = urlsplit(h.url).port
    assert port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        await writer.drain()
        await asyncio.sleep(0.2)  # kvlb's handler reads the body as it comes (a body whole before it
        writer.write(chunked(body, chunk_bytes))  # runs was parsed already: nothing left to save)
        await writer.drain()
        status, _, raw = await read_answer(reader, 10)
        closed = refused and await asyncio.wait_for(reader.read(1), 10) == b""
        return status, json.loads(raw), closed
    finally:
        writer.close()


def completion(pad_chars: int) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1, "user": "x" * pad_chars}).encode()


async def test_a_body_in_more_chunks_than_the_limit_is_refused_and_its_connection_closed(
    tokenizer: Tokenizer,
) -> None:
    async with running(tokenizer, 1, limits__max_body_chunks=64) as h:
        body = completion(200)  # about 270 bytes in chunks of 1: more than 64
        status, answer, closed = await send(h, body, 1)
        assert status == 400, answer
        message = answer["error"]["message"]
        assert message == (
            "request body arrived in more than limits.max_body_chunks = 64 chunks; "
            "send it in fewer, larger chunks"
        )
        assert closed
        assert await metric(h, "kvlb_http_body_chunk_overflow_total") == 1
        await wait_for("every byte of the budget back", lambda: nothing_held(h))
        # the same body in 64 chunks or fewer is served
        status, answer, _ = await send(h, body, -(-len(body) // 64), refused=False)
        assert status == 200, answer
        assert await metric(h, "kvlb_http_body_chunk_overflow_total") == 1


async def test_a_large_body_in_ordinary_chunks_is_served_at_the_default(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1) as h:
        body = completion(1_000_000)
        status, answer, _ = await send(h, body, 1024, refused=False)  # 977 chunks: within 4,096
        assert status == 200, answer
        status, answer, closed = await send(h, completion(5_000), 1)  # 5,067 one-byte chunks
        assert status == 400 and closed, answer
        assert "limits.max_body_chunks = 4096" in answer["error"]["message"]
