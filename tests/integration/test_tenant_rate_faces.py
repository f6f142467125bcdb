"""``limits.tenant_rate_per_s`` on both faces, in process (emulated replicas, a real balancer, real
sockets and a real gRPC channel): over HTTP a tenant over its rate is answered 429 from its headers
alone, before its body is read (a client that has sent none yet gets the answer at once); over gRPC
a ``Generate`` call of such a tenant ends ``RESOURCE_EXHAUSTED`` with a ``retry-after`` trailer,
before its message is read; another tenant is served."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import grpc
import pytest
from grpc_harness import failure, grpc_running, token_request
from kvlb_harness import MODEL, metric, read_answer, running, shared_deepseek

from balancer.tokenizer.tokenizer import Tokenizer

HEADER = "x-kvlb-tenant"
LIMITS = {
    "limits__tenant_rate_per_s": 0.5,
    "limits__tenant_burst": 1,
    "limits__tenant_rate_new_per_s": 100.0,  # tenant b, new, is not held back by a's first request
}


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def test_a_tenant_over_its_rate_is_refused_before_its_body_is_read(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, timeouts__body_read_s=30, **LIMITS) as h:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
        first = await h.post("/v1/completions", body, headers={HEADER: "a"})
        assert first.status == 200, first.body
        parts = urlsplit(h.url)
        assert parts.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", parts.port)
        try:  # the head of a 1,000-byte body, and no body: kvlb must answer from the head alone
            writer.write(
                f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: 1000\r\n{HEADER}: a\r\n\r\n".encode()
            )
            await writer.drain()
            async with asyncio.timeout(5):  # not timeouts.body_read_s (30 s)
                status, headers, raw = await read_answer(reader)
        finally:
            writer.close()
        assert status == 429, raw
        assert headers["retry-after"] == "2", headers  # a token every 2 s, rounded up
        error = json.loads(raw)["error"]
        assert error["type"] == "rate_limit_error" and "limits.tenant_rate_per_s = 0.5" in error["message"]
        assert headers["x-request-id"]
        other = await h.post("/v1/completions", body, headers={HEADER: "b"})
        assert other.status == 200, other.body


async def test_a_grpc_generate_over_its_tenants_rate_is_resource_exhausted(tokenizer: Tokenizer) -> None:
    async with grpc_running(tokenizer, 1, **LIMITS) as g:
        request = token_request([1, 2, 3])
        async for _ in g.balancer.Generate(request, metadata=((HEADER, "a"),)):
            pass
        error = await failure(g.balancer.Generate(request, metadata=((HEADER, "a"),)).read())
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert "limits.tenant_rate_per_s" in error.details()
        assert dict(error.trailing_metadata() or ())["retry-after"] == "2"
        async for _ in g.balancer.Generate(request, metadata=((HEADER, "b"),)):
            pass


async def test_with_expect_100_continue_the_rate_is_checked_before_the_body_is_asked_for(
    tokenizer: Tokenizer,
) -> None:
    """A tenant over its rate that asks ``Expect: 100-continue`` is answered 429 (``Connection:
    close``) instead of ``100 Continue``, so it never sends its body; one within its rate gets the
    100, sends its body and is served, and its request takes one token, not two (a burst of 2: the
    next request still goes)."""
    limits = {**LIMITS, "limits__tenant_burst": 2}
    async with running(tokenizer, 1, **limits) as h:
        parts = urlsplit(h.url)
        assert parts.port is not None
        body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}).encode()

        async def ask(tenant: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection("127.0.0.1", parts.port)
            writer.write(
                f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n{HEADER}: {tenant}\r\n\r\n".encode()
            )
            await writer.drain()
            return reader, writer

        reader, writer = await ask("c")
        try:
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert interim.startswith(b"HTTP/1.1 100 Continue"), interim
            writer.write(body)
            await writer.drain()
            status, _, raw = await read_answer(reader)
            assert status == 200, raw
        finally:
            writer.close()
        second = await h.post("/v1/completions", json.loads(body), headers={HEADER: "c"})
        assert second.status == 200, second.body  # the Expect request took one token of 2
        reader, writer = await ask("c")  # none left now
        try:
            status, headers, raw = await read_answer(reader)
        finally:
            writer.close()
        assert status == 429, raw
        assert headers["connection"] == "close" and headers["retry-after"] == "2", headers
        assert "limits.tenant_rate_per_s" in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize("opt_in", [False, True])
async def test_the_default_tenant_is_exempt_from_the_rate_unless_opted_in(
    tokenizer: Tokenizer, opt_in: bool
) -> None:
    """Requests without a tenant header (a service without tenants) are not held to one tenant's
    rate unless ``limits.tenant_rate_default_tenant`` says so (before 2026-12-01, h-tenantfollow,
    they always were: the whole service at ``tenant_rate_per_s``); a named tenant is held either way."""
    async with running(tokenizer, 1, limits__tenant_rate_default_tenant=opt_in, **LIMITS) as h:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
        unnamed = [(await h.post("/v1/completions", body)).status for _ in range(4)]
        unnamed.append((await h.post("/v1/completions", body, headers={HEADER: ""})).status)
        named = [(await h.post("/v1/completions", body, headers={HEADER: "a"})).status for _ in range(2)]
        shed = await metric(h, "kvlb_admission_shed_total", reason="tenant_rate")
    assert named == [200, 429], named
    if opt_in:  # one bucket of depth 1 for all of them, refilled every 2 s
        assert unnamed == [200, 429, 429, 429, 429], unnamed
        assert shed == 5
    else:
        assert unnamed == [200] * 5, unnamed
        assert shed == 1
