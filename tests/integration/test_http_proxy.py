"""The request path over real sockets: serve → route → proxy → stream back (emulated replicas)."""

from __future__ import annotations

import pytest
from kvlb_harness import MODEL, running, shared_deepseek, sse_payloads

from balancer.tokenizer.tokenizer import Tokenizer


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
