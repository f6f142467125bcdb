"""Chats sharing a system prompt over HTTP: the known prefix is decoded once (``limits.prefix_memo_*``),
the requests routed as with the memo off, and bad bodies answered with the same 4xx."""

from __future__ import annotations

import json

import pytest
from kvlb_harness import MODEL, metric_value, running, shared_deepseek

from balancer.tokenizer.tokenizer import Tokenizer

SYSTEM = "缓存缓存缓存缓存" * 48
"""2,306 bytes as JSON (``\\u7f13``: 6 bytes a character) and about 200 tokens (the replicas hold 256)."""


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def _chat(question: str) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return json.dumps({"model": MODEL, "max_tokens": 1, "messages": messages}).encode()


BAD_TAILS: list[bytes] = [
    _chat("a key again")[:-1] + b', "model": 5}',  # the prefix's key repeated: the last one counts
    _chat("cut")[:-3],
    _chat("stream")[:-1] + b', "stream": "yes"}',
    _chat("no role")[:-3] + b', {"content": "x"}]}',
    _chat("not UTF-8")[:-4] + b'\xff"}]}',
]


async def _metrics(h: object) -> str:
    async with h.session.get(h.url + "/metrics") as response:  # type: ignore[attr-defined]
        return str(await response.text())


async def _answers(tokenizer: Tokenizer, entries: int) -> tuple[list[tuple[int, str]], str]:
    """Each body's status and error message (or its replica), with ``prefix_memo_entries``."""
    out: list[tuple[int, str]] = []
    async with running(tokenizer, limits__prefix_memo_entries=entries) as h:
        for index in range(5):
            answer = await h.post("/v1/chat/completions", _chat(f"Question number {index}?"))
            assert answer.status == 200, answer.body
            out.append((answer.status, answer.headers["x-kvlb-replica"]))
        for body in BAD_TAILS:
            answer = await h.post("/v1/chat/completions", body)
            out.append((answer.status, json.loads(answer.body)["error"]["message"]))
        text = await _metrics(h)
    return out, text


async def test_a_shared_system_prompt_is_decoded_once_and_answers_are_as_without_the_memo(
    tokenizer: Tokenizer,
) -> None:
    with_memo, text = await _answers(tokenizer, 256)
    assert metric_value(text, "kvlb_http_prefix_memo_learned_total") == 1
    # from the prefix's third sight (the first noted its head, the second proposed it), and the body
    # with a bad "stream": valid JSON, refused by the checks after decoding as it was before
    assert metric_value(text, "kvlb_http_prefix_memo_hits_total") == 3 + 1
    assert metric_value(text, "kvlb_http_prefix_memo_fallbacks_total") == len(BAD_TAILS) - 1
    assert metric_value(text, "kvlb_http_prefix_memo_entries") == 1
    assert metric_value(text, "kvlb_http_prefix_memo_held_bytes") > 2 * len(SYSTEM)
    without, text = await _answers(tokenizer, 0)
    assert metric_value(text, "kvlb_http_prefix_memo_hits_total") == 0
    assert with_memo == without
    assert all(status == 400 for status, _ in with_memo[5:])
    assert len({replica for _, replica in with_memo[1:5]}) == 1  # the prefix's holder
