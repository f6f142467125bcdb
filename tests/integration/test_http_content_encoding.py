"""Bodies with a ``Content-Encoding`` over real sockets (the adversarial run of 2026-11-30, branch
h-adversary): aiohttp decodes gzip and deflate bodies before kvlb reads them.

* A body that is not the coding it names was a 500 with a traceback on every endpoint that reads a
  body, and aiohttp logged another traceback at ERROR for any request carrying one (``GET
  /healthz`` included) when it read the rest of the body after the answer: now a 400 naming the
  coding, and one INFO line.
* A small compressed body of a large decoded one held only its compressed length of
  ``limits.max_inflight_body_bytes`` (a 1 kB gzip body of 500 kB held 1 kB): it now holds what kvlb
  keeps, its decoded bytes.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import zlib

import aiohttp
import pytest
from aiohttp import web
from kvlb_harness import (
    MODEL,
    balancer_over,
    completion_replica,
    metric_value,
    running,
    shared_deepseek,
    wait_for,
)

from balancer.tokenizer.tokenizer import Tokenizer

NOT_GZIP = b"this is not gzip data at all"
READING_ENDPOINTS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("PUT", "/admin/policy"),
    ("POST", "/admin/explain"),
    ("POST", "/admin/whatif"),
]


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_a_body_that_is_not_its_content_encoding_is_a_400_without_a_traceback(
    tokenizer: Tokenizer, coding: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with running(tokenizer, 1) as h:
        headers = {"Content-Encoding": coding, "Content-Type": "application/json"}
        for method, path in READING_ENDPOINTS:
            async with h.session.request(method, h.url + path, data=NOT_GZIP, headers=headers) as response:
                body = await response.read()
            assert response.status == 400, (path, body)
            error = json.loads(body)["error"]
            assert error["code"] == 400 and error["type"] == "invalid_request_error"
            wanted = f"the request body is malformed: Can not decode content-encoding: {coding}"
            assert error["message"] == wanted
            assert "x-request-id" in response.headers
            assert response.headers["Connection"] == "close"  # aiohttp closes it: not to be reused
        # a route that reads no body: answered, and the body aiohttp drains after it is not an ERROR
        closing = {**headers, "Connection": "close"}  # aiohttp closes it after the drain fails
        async with h.session.get(h.url + "/healthz", data=NOT_GZIP, headers=closing) as response:
            assert response.status == 200
        await asyncio.sleep(0.1)  # the drain after the answer
        assert errors_logged(caplog) == []
        dropped = [r for r in caplog.records if r.getMessage().startswith("malformed request body dropped")]
        assert dropped and all(r.levelno == logging.INFO for r in dropped)
        # the same request correctly encoded is served
        body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()
        encoded = gzip.compress(body) if coding == "gzip" else zlib.compress(body)
        answer = await h.post("/v1/completions", encoded, headers=headers)
        assert answer.status == 200, answer.body


DECODED_PAD_BYTES = 500_000


async def test_a_compressed_body_holds_its_decoded_bytes_of_the_budget() -> None:
    """A 1 kB gzip body of 500 kB, held by a replica that has not answered yet: the budget holds
    the decoded body (kvlb keeps it to forward it), not the 1 kB declared."""
    arrived = asyncio.Event()
    answer = asyncio.Event()

    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        arrived.set()
        await answer.wait()
        return web.json_response({"id": "c1", "object": "text_completion", "choices": []})

    payload = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1, "pad": " " * DECODED_PAD_BYTES}
    encoded = gzip.compress(json.dumps(payload).encode())
    assert len(encoded) < 2_000
    async with completion_replica(complete) as url, balancer_over(url) as (balancer, session):

        async def held() -> float:
            async with session.get(balancer.url + "/metrics") as response:
                return metric_value(await response.text(), "kvlb_admission_body_bytes")

        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        url = balancer.url + "/v1/completions"
        sent = asyncio.create_task(session.post(url, data=encoded, headers=headers))
        try:
            async with asyncio.timeout(5):
                await arrived.wait()
            assert await held() >= DECODED_PAD_BYTES
        finally:
            answer.set()
        response: aiohttp.ClientResponse = await sent
        assert response.status == 200
        response.release()

        async def released() -> bool:
            return await held() == 0

        await wait_for("every byte given back", released)
