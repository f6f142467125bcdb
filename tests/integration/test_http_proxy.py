"""The request path over real sockets: serve → route → proxy → stream back (emulated replicas)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kvlb_harness import MODEL, metric_value, running, shared_deepseek, sse_payloads, wait_ready

from balancer.app import Balancer
from balancer.config import Settings, from_mapping
from balancer.tokenizer.tokenizer import TokenIdTokenizer, Tokenizer


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def test_streaming_chat_arrives_intact_and_in_order(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Explain prefix caching in one sentence."}]
    body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": 12, "temperature": 0}
    async with running(tokenizer) as h:
        response = await h.post("/v1/chat/completions", body, headers={"x-request-id": "req-1"})
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["x-request-id"] == "req-1"
        replica = response.headers["x-kvlb-replica"]
        assert replica in ("r0", "r1")
        payloads = sse_payloads(response.body)
        assert payloads[-1] == "[DONE]"
        chunks = payloads[:-1]
        assert all(c["model"] == MODEL for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # The same greedy request sent straight to that replica gives the same words in the same order.
        direct = {**body, "stream": False}
        async with h.session.post(h.replica(replica).url + "/v1/chat/completions", json=direct) as answer:
            expected = (await answer.json())["choices"][0]["message"]["content"]
        assert text == expected and len(text.split()) == 12


async def test_non_streaming_completion_with_token_ids_relays_the_json(tokenizer: Tokenizer) -> None:
    body = {"model": MODEL, "prompt": list(range(100, 140)), "max_tokens": 5, "temperature": 0}
    async with running(tokenizer) as h:
        response = await h.post("/v1/completions", body)
        assert response.status == 200
        answer = response.json()
        assert answer["usage"]["prompt_tokens"] == 40
        assert len(answer["choices"][0]["text"].split()) == 5
        assert len(response.headers["x-request-id"]) == 32
        assert response.headers["x-kvlb-cached-tokens"] == "0"


async def test_a_replica_silent_after_its_first_chunk_ends_the_stream_at_the_total_timeout() -> None:
    """``timeouts.total_s`` bounds a stream the replica started and then stopped feeding: the client
    gets the first chunk, then one error event naming the timeout; the request is counted as a
    ``stream_error`` and its load is freed."""
    first = b'data: {"id": "c1", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]}\n\n'

    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(first)
        await asyncio.sleep(30.0)  # silent from here on (cancelled at cleanup)
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    tree: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {"model": MODEL, "replicas": [{"id": "r0", "url": url, "engine": "sglang", "block_size": 4}]}
        ],
        "timeouts": {"total_s": 1.0},
        "health_interval_s": 0.2,
        "scrape_interval_s": 0,
    }
    balancer = Balancer(from_mapping(Settings, tree).validate(), tokenizers={MODEL: TokenIdTokenizer()})
    try:
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)
            body = {"model": MODEL, "prompt": list(range(8)), "max_tokens": 4, "stream": True}
            async with session.post(balancer.url + "/v1/completions", json=body) as response:
                assert response.status == 200 and response.headers["x-kvlb-replica"] == "r0"
                raw = await response.read()
            payloads = sse_payloads(raw)
            assert payloads[0]["choices"][0]["text"] == "a" and len(payloads) == 2
            message = payloads[1]["error"]["message"]
            assert payloads[1]["error"]["code"] == 502
            assert message == "replica r0 failed mid-stream: request exceeded timeouts.total_s = 1.0s"
            async with session.get(balancer.url + "/metrics") as answer:
                text = await answer.text()
            assert metric_value(text, "kvlb_http_requests_total", status="stream_error", replica="r0") == 1
            async with session.get(balancer.url + "/admin/replicas") as answer:
                replicas = await answer.json()
            assert [r["inflight"] for r in replicas["replicas"] if r["id"] == "r0"] == [0]
    finally:
        await balancer.stop()
        await runner.cleanup()
