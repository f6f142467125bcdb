"""The request path over real sockets: serve → route → proxy → stream back (emulated replicas)."""

from __future__ import annotations

import pytest
from kvlb_harness import (
    MODEL,
    balancer_over,
    metric_value,
    running,
    shared_deepseek,
    sse_payloads,
    stalling_stream_replica,
)

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


async def test_a_replica_silent_after_its_first_chunk_ends_the_stream_at_the_total_timeout() -> None:
    """``timeouts.total_s`` bounds a stream the replica started and then stopped feeding: the client
    gets the first chunk, then one error event naming the timeout; the request is counted as a
    ``stream_error`` and its load is freed."""
    first = b'data: {"id": "c1", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]}\n\n'
    async with (
        stalling_stream_replica(first) as url,
        balancer_over(url, timeouts={"total_s": 1.0}) as (
            balancer,
            session,
        ),
    ):
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


async def test_token_ids_sent_again_are_found_in_the_memo_and_routed_alike(tokenizer: Tokenizer) -> None:
    """A token-id prompt sent again is decoded from the memo of runs (its hits counted), reaches the
    replica that holds it, and a prompt sharing only its first runs is routed from the right ids."""
    prompt = [4_000_000_000 + i * 7919 for i in range(200)]  # 2.4 kB of JSON: two runs
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with running(tokenizer, limits__body_memo_entries=0) as h:  # the runs memo, not the bodies one
        holder = await h.warm(prompt)
        answers = [await h.post("/v1/completions", body) for _ in range(3)]
        assert all(a.status == 200 for a in answers), answers[0].body
        assert [a.headers["x-kvlb-replica"] for a in answers] == [holder] * 3
        cached = {int(a.headers["x-kvlb-cached-tokens"]) for a in answers}
        assert len(cached) == 1 and 180 <= cached.pop() < 200  # the same prediction, all but a block
        async with h.session.get(h.url + "/metrics") as response:
            text = await response.text()
        assert metric_value(text, "kvlb_tokenizer_token_id_memo_hits_total") > 0
        assert metric_value(text, "kvlb_tokenizer_token_id_memo_misses_total") > 0
        assert 'kvlb_route_key_memo_evictions_total{space="' in text  # every key space's key memo
        tail = {**body, "prompt": prompt[:180] + [5, 6, 7] * 6}  # its first run found, the rest new
        answer = await h.post("/v1/completions", tail)
        assert answer.status == 200 and answer.headers["x-kvlb-replica"] == holder
        assert 160 <= int(answer.headers["x-kvlb-cached-tokens"]) <= 180  # the shared 180 ids
