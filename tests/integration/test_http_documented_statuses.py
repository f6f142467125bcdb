"""Statuses kvlb answers that its OpenAPI document (``/openapi.json``) must list, over real sockets.

Every operation that reads a body answers 408 to a body that has not arrived
``timeouts.body_rate_grace_s`` after the headers and 413 to one declared over
``limits.max_body_bytes``: the admin ones (``PUT /admin/policy``, ``POST /admin/explain``,
``POST /admin/whatif``) as well as ``/v1/*``. A client whose body write lags its header write gets
that 408 (``requests`` sends the two in separate writes, so a stalled schemathesis run can meet it).
``POST /admin/explain`` answers 429 while every replica holds ``limits.max_inflight_per_replica``.
Every admin operation answers 400 to a query parameter it does not take (or one given twice), and
every admin write 403 to another ``Origin`` and 417 to an ``Expect`` other than ``100-continue``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

import pytest
from kvlb_harness import MODEL, Harness, running, shared_deepseek

from balancer.api.openapi import openapi_document
from balancer.tokenizer.tokenizer import Tokenizer

TOKEN = "doc-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY_BYTES = 4096
GRACE_S = 0.2
BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/chat/completions"): {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    },
    ("POST", "/v1/completions"): {"model": MODEL, "prompt": "hi", "max_tokens": 1},
    ("PUT", "/admin/policy"): {"reason": "documented statuses"},
    ("POST", "/admin/explain"): {"model": MODEL, "prompt": "hi"},
    ("POST", "/admin/whatif"): {},
    ("POST", "/admin/replicas/{replica}/drain"): {"reason": "documented statuses"},
    ("POST", "/admin/replicas/{replica}/undrain"): {"reason": "documented statuses"},
}
"""A valid body for every operation of the document that takes one."""


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def documented(method: str, path: str) -> set[int]:
    return {int(status) for status in openapi_document()["paths"][path][method.lower()]["responses"]}


async def status_without_body(h: Harness, method: str, path: str, declared: int) -> int:
    """Send the headers of a request declaring ``declared`` body bytes, then nothing: the status."""
    parts = urlsplit(h.url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
        )
        writer.write(head.encode())
        await writer.drain()
        async with asyncio.timeout(10 * GRACE_S + 5):
            line = await reader.readline()
        return int(line.split()[1])
    finally:
        writer.close()


async def test_every_body_operation_documents_its_408_and_413(tokenizer: Tokenizer) -> None:
    paths = openapi_document()["paths"]
    taking_a_body = {
        (method.upper(), path)
        for path, ops in paths.items()
        for method, op in ops.items()
        if "requestBody" in op
    }
    assert taking_a_body == set(BODIES)
    limits = {"limits__max_body_bytes": MAX_BODY_BYTES, "timeouts__body_rate_grace_s": GRACE_S}
    async with running(tokenizer, 2, auth__api_keys=[TOKEN], auth__admin_token=TOKEN, **limits) as h:
        for (method, template), body in BODIES.items():
            statuses = documented(method, template)
            path = template.replace("{replica}", "r0")
            data = json.dumps(body).encode()
            async with h.session.request(method, h.url + path, data=data, headers=AUTH) as response:
                assert response.status == 200, (method, path, await response.text())
            late = await status_without_body(h, method, path, len(data))
            assert late == 408 and late in statuses, (method, path, late, sorted(statuses))
            padded = b" " * MAX_BODY_BYTES + data  # valid JSON, one byte over the limit at least
            async with h.session.request(method, h.url + path, data=padded, headers=AUTH) as response:
                answer = await response.json()
                assert response.status == 413 and 413 in statuses, (method, path, response.status)
                assert answer["error"]["code"] == 413


async def test_explain_documents_its_429_while_every_replica_is_full(tokenizer: Tokenizer) -> None:
    async with running(
        tokenizer, 1, time_scale=0.25, auth__admin_token=TOKEN, limits__max_inflight_per_replica=1
    ) as h:
        stream = {"model": MODEL, "prompt": [10, 2, 3, 4, 5], "max_tokens": 200, "stream": True}
        response = await h.session.post(h.url + "/v1/completions", json=stream)
        try:
            assert response.status == 200
            assert (await response.content.readline()).startswith(b"data: ")
            explain = BODIES["POST", "/admin/explain"]
            async with h.session.post(h.url + "/admin/explain", json=explain, headers=AUTH) as answer:
                assert answer.status == 429 and "Retry-After" in answer.headers
                assert "in flight" in (await answer.json())["error"]["message"]
        finally:
            response.close()
        assert 429 in documented("POST", "/admin/explain")


def admin_operations() -> list[tuple[str, str]]:
    """Every ``/admin`` operation of the OpenAPI document, as (method, path template)."""
    return [
        (method.upper(), path)
        for path, ops in openapi_document()["paths"].items()
        if path.startswith("/admin")
        for method in ops
    ]


def concrete(template: str) -> str:
    return template.replace("{replica}", "r0").replace("{id}", "1")


async def test_every_admin_operation_refuses_a_query_parameter_it_does_not_take(tokenizer: Tokenizer) -> None:
    """docs/http-api.md: "A query parameter the endpoint does not take, or one given more than once,
    is a 400", on every admin endpoint, before it reads the body: the write is not made."""
    async with running(tokenizer, 2, auth__admin_token=TOKEN) as h:
        answer = await h.post("/v1/completions", BODIES["POST", "/v1/completions"])  # decision 1
        assert answer.status == 200, answer.body
        version = (await h.admin("GET", "/admin/policy"))["version"]
        for method, template in admin_operations():
            body = BODIES.get((method, template))
            data = None if body is None else json.dumps(body).encode()
            for query in ("?bogus=1", "?bogus=1&bogus=2"):
                path = concrete(template) + query
                async with h.session.request(method, h.url + path, data=data, headers=AUTH) as response:
                    answer_json = await response.json()
                    assert response.status == 400, (method, path, response.status, answer_json)
                assert "unknown query parameter(s) ['bogus']" in answer_json["error"]["message"], answer_json
            assert 400 in documented(method, template), (method, template)
        assert (await h.admin("GET", "/admin/policy"))["version"] == version  # no change was applied
        assert not (await h.replica_view("r0"))["health"]["draining"]


async def test_every_admin_write_documents_its_403_and_417(tokenizer: Tokenizer) -> None:
    """An admin write from another ``Origin`` is a 403 and an ``Expect`` other than ``100-continue``
    a 417 (docs/http-api.md), and the OpenAPI document lists both for each of them."""
    async with running(tokenizer, 2, auth__admin_token=TOKEN) as h:
        writes = [(m, t) for m, t in admin_operations() if m != "GET"]
        assert writes and all((m, t) in BODIES for m, t in writes)
        for method, template in writes:
            data = json.dumps(BODIES[method, template]).encode()
            url = h.url + concrete(template)
            foreign = {**AUTH, "Origin": "http://elsewhere.example"}
            async with h.session.request(method, url, data=data, headers=foreign) as response:
                assert response.status == 403, (method, template, response.status)
                assert "another origin" in (await response.json())["error"]["message"]
            async with h.session.request(method, url, data=data, headers={**AUTH, "Expect": "x"}) as response:
                assert response.status == 417, (method, template, response.status)
            assert {403, 417} <= documented(method, template), (method, template)
