"""``Expect: 100-continue`` over raw sockets (the adversarial run of 2026-11-30 left it open):
kvlb answered ``100 Continue`` before it looked at the headers, so a client declaring a body over
``limits.max_body_bytes`` (or without its key) sent the whole body for a 413 (or 401). What the
headers alone refuse is now answered instead of the 100, in the JSON error shape, with
``Connection: close``; a body kvlb will read still gets its 100 first."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import pytest
from kvlb_harness import MODEL, metric_value, read_answer, running, shared_deepseek

from balancer.tokenizer.tokenizer import Tokenizer

MAX_BODY_BYTES = 4096
KEY = "sk-expect-test"


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def send_head(
    url: str, method: str, path: str, length: int, extra: str = ""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1" and parts.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", parts.port)
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\nExpect: 100-continue\r\n{extra}\r\n"
    )
    writer.write(head.encode())
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/completions"), ("PUT", "/admin/policy")])
async def test_a_declared_length_over_the_limit_is_a_413_instead_of_100(
    tokenizer: Tokenizer, method: str, path: str
) -> None:
    async with running(tokenizer, 1, limits__max_body_bytes=MAX_BODY_BYTES) as h:
        reader, writer = await send_head(h.url, method, path, MAX_BODY_BYTES + 1)
        try:
            status, headers, body = await read_answer(reader)  # no body sent: kvlb must answer now
            assert status == 413, body
            error = json.loads(body)["error"]
            assert error["code"] == 413
            assert error["message"] == (
                f"request body of {MAX_BODY_BYTES + 1} bytes exceeds limits.max_body_bytes = {MAX_BODY_BYTES}"
            )
            assert headers["content-type"].startswith("application/json")
            # a body sent anyway is dropped unparsed, kvlb's side shut down after the answer
            assert headers["x-request-id"] and headers["connection"] == "close"
        finally:
            writer.close()
        text = await (await h.session.get(h.url + "/metrics")).text()
        assert metric_value(text, "kvlb_http_requests_total", endpoint=path, status="413") == 1


async def test_a_missing_key_is_a_401_instead_of_100(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, auth__api_keys=[KEY]) as h:
        reader, writer = await send_head(h.url, "POST", "/v1/chat/completions", 100)
        try:
            status, headers, body = await read_answer(reader)
            assert status == 401 and json.loads(body)["error"]["code"] == 401
            assert headers["www-authenticate"] == "Bearer" and headers["x-request-id"]
        finally:
            writer.close()


async def test_a_client_key_on_an_admin_write_is_a_403_instead_of_100(tokenizer: Tokenizer) -> None:
    """A valid client key is authenticated but not allowed on ``/admin``: 403, no ``WWW-Authenticate``."""
    async with running(tokenizer, 1, auth__api_keys=[KEY], auth__admin_token="admin-expect") as h:
        reader, writer = await send_head(
            h.url, "PUT", "/admin/policy", 100, extra=f"Authorization: Bearer {KEY}\r\n"
        )
        try:
            status, headers, body = await read_answer(reader)
            assert status == 403 and json.loads(body)["error"]["code"] == 403, body
            assert "www-authenticate" not in headers and headers["connection"] == "close"
        finally:
            writer.close()


async def test_an_unknown_expectation_is_a_417_in_the_json_shape(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1) as h:
        parts = urlsplit(h.url)
        reader, writer = await asyncio.open_connection("127.0.0.1", parts.port)
        try:
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n"
                b"Expect: 200-ok\r\n\r\n"
            )
            status, headers, body = await read_answer(reader)
            assert status == 417 and json.loads(body)["error"]["message"].startswith("unsupported Expect")
            assert headers["x-request-id"]
        finally:
            writer.close()


async def test_a_body_within_the_limit_gets_100_then_its_answer(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, limits__max_body_bytes=MAX_BODY_BYTES, auth__api_keys=[KEY]) as h:
        payload = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 2}).encode()
        reader, writer = await send_head(
            h.url, "POST", "/v1/completions", len(payload), f"Authorization: Bearer {KEY}\r\n"
        )
        try:
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(payload)
            status, _, body = await read_answer(reader)
            assert status == 200, body
            assert json.loads(body)["choices"]
        finally:
            writer.close()


async def test_an_admin_write_from_another_origin_is_a_403_instead_of_100(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, auth__admin_token="root") as h:
        reader, writer = await send_head(
            h.url, "PUT", "/admin/policy", 10, "Authorization: Bearer root\r\nOrigin: http://evil.example\r\n"
        )
        try:
            status, headers, body = await read_answer(reader)
            assert status == 403 and "another origin" in json.loads(body)["error"]["message"]
            assert headers["x-request-id"]
        finally:
            writer.close()


async def test_a_body_sent_anyway_after_a_refusal_ends_the_connection_at_once(tokenizer: Tokenizer) -> None:
    """A client that sends part of its body after the 413 and keeps its side open sees kvlb's end
    of the connection right after the answer (aiohttp's lingering close read the body for up to
    10 s first), and kvlb stays responsive while the client goes on sending."""
    async with running(tokenizer, 1, limits__max_body_bytes=MAX_BODY_BYTES) as h:
        reader, writer = await send_head(h.url, "POST", "/v1/completions", 10 * MAX_BODY_BYTES)
        try:
            status, _, _ = await read_answer(reader)
            assert status == 413
            writer.write(b"x" * MAX_BODY_BYTES)  # part of the body, anyway; the rest never comes
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 2.0) == b""  # kvlb's end, not 10 s later
            writer.write(b"y" * MAX_BODY_BYTES)  # more: dropped unparsed, nothing answered
            await writer.drain()
            async with h.session.get(h.url + "/healthz") as response:
                assert response.status == 200
        finally:
            writer.close()
