"""Whole bodies sent again over HTTP are found in the body memo (``limits.body_memo_*``): routed as
a fresh parse routes them, counted, bounded, and a bad body keeps its 4xx however often it comes."""

from __future__ import annotations

import pytest
from kvlb_harness import MODEL, metric_value, running, shared_deepseek

from balancer.tokenizer.tokenizer import Tokenizer


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def _chat(question: str, **more: object) -> dict[str, object]:
    system = "You are a terse assistant who answers about caches. " * 20
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 1, **more}


async def _metrics(h: object) -> str:
    async with h.session.get(h.url + "/metrics") as response:  # type: ignore[attr-defined]
        return str(await response.text())


async def test_a_chat_sent_again_is_found_and_routed_as_a_fresh_parse_routes_it(tokenizer: Tokenizer) -> None:
    body = _chat("What is a prefix cache?", user="alice")
    async with running(tokenizer) as h:
        answers = [await h.post("/v1/chat/completions", body) for _ in range(4)]
        assert all(a.status == 200 for a in answers), answers[0].body
        text = await _metrics(h)
        assert metric_value(text, "kvlb_http_body_memo_hits_total") == 2  # kept from its second sight
        assert metric_value(text, "kvlb_http_body_memo_entries") == 1
        # the same body with the memo's answer and with a fresh parse (another ``user``: its own key)
        holder = answers[1].headers["x-kvlb-replica"]
        assert {a.headers["x-kvlb-replica"] for a in answers[1:]} == {holder}
        cached = {a.headers["x-kvlb-cached-tokens"] for a in answers[2:]}
        fresh = await h.post("/v1/chat/completions", {**body, "user": "bob"})
        assert fresh.status == 200
        assert metric_value(await _metrics(h), "kvlb_http_body_memo_hits_total") == 2
        assert fresh.headers["x-kvlb-cached-tokens"] in cached and int(cached.pop()) > 200


async def test_bad_bodies_get_their_4xx_every_time_and_are_never_kept(tokenizer: Tokenizer) -> None:
    bad: list[tuple[bytes | dict[str, object], int]] = [
        (b'{"model": "' + MODEL.encode() + b'", "messages": [', 400),  # not JSON
        (_chat("n too large", n=100_000), 400),  # over limits.max_n
        ({**_chat("unknown model"), "model": "no-such-model"}, 404),
        (_chat("stream is not a boolean", stream="yes"), 400),
        (_chat("x" * 400), 400),  # 294 tokens: over limits.max_prompt_tokens below
    ]
    async with running(tokenizer, limits__max_prompt_tokens=250) as h:
        for body, status in bad:
            for _ in range(3):
                answer = await h.post("/v1/chat/completions", body)
                assert answer.status == status, (body, answer.body)
        text = await _metrics(h)
        assert metric_value(text, "kvlb_http_body_memo_hits_total") == 0
        assert metric_value(text, "kvlb_http_body_memo_entries") == 0


async def test_the_memo_is_bounded_in_entries_and_its_evictions_counted(tokenizer: Tokenizer) -> None:
    bodies = [_chat(f"Question number {i}?") for i in range(4)]
    async with running(tokenizer, limits__body_memo_entries=2) as h:
        for body in bodies:
            for _ in range(2):
                assert (await h.post("/v1/chat/completions", body)).status == 200
        text = await _metrics(h)
        assert metric_value(text, "kvlb_http_body_memo_entries") == 2
        assert metric_value(text, "kvlb_http_body_memo_evictions_total") == 2
        assert metric_value(text, "kvlb_http_body_memo_held_bytes") > 0
