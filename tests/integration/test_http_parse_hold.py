"""A large body's parse in the byte budget (``limits.max_inflight_body_bytes``) over real sockets: a
balancer and an emulated replica on 127.0.0.1, real HTTP. A body of 256 KiB or more holds the
estimate of its parse (:func:`~balancer.api.parse_cost.json_parse_bytes`) while it is parsed, counted
in ``kvlb_admission_parse_holds_total{face="http", waited}``; a body shaped to cost many times its
bytes (empty objects, UTF-16) is served as any other, after waiting while the budget is full (or 429
without a queue), honest bodies (8k token ids, a large chat of text full of commas) are served as
before, and every byte comes back."""

from __future__ import annotations

import asyncio
import json

import pytest
from kvlb_harness import MODEL, Answer, metric, nothing_held, running, shared_deepseek, tokenizing, wait_for

from balancer.api.openai import piece_hold_chars, tokenizing_hold_bytes
from balancer.api.parse_cost import PARSE_HOLD_MIN_BYTES, json_parse_bytes
from balancer.api.parsing import parse_request
from balancer.tokenizer.tokenizer import Tokenizer

HOLDS = "kvlb_admission_parse_holds_total"


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def empty_objects(count: int, salt: int = 0, encoding: str = "utf-16") -> bytes:
    """A completion of a 4-id prompt with ``count`` empty objects in an unknown field (neither routed
    on nor read by kvlb, forwarded as it is), in ``encoding``: a body the stdlib decoder parses."""
    text = (
        f'{{"model": "{MODEL}", "prompt": [{salt + 1}, 2, 3, 4], "max_tokens": 1, "x": ['
        + ",".join(["{}"] * count)
        + "]}"
    )
    return text.encode(encoding)


def tiny_chat(salt: int, count: int = 40_000) -> bytes:
    """A chat of ``count`` one-letter messages: tokenized in a thread for about half a second."""
    messages = [{"role": "user", "content": f"s{salt}"}] + [{"role": "user", "content": "a"}] * (count - 1)
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()


def forwarded(answer: Answer) -> bool:
    """``answer`` is the replica's: 200, or its 400 for a prompt over its 512-token context."""
    return "x-kvlb-replica" in answer.headers and (answer.status == 200 or b"exceeds 512" in answer.body)


PATHOLOGICAL = empty_objects(200_000)
"""1.2 MB: its parse is estimated at about 21 MB (measured about 16 MB)."""


async def test_a_body_of_empty_objects_in_utf16_holds_its_parse_and_is_served(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, limits__max_body_bytes=8 * 1024 * 1024) as h:
        big = asyncio.create_task(h.post("/v1/completions", PATHOLOGICAL))
        small = asyncio.create_task(
            h.post("/v1/completions", {"model": MODEL, "prompt": [9, 2, 3], "max_tokens": 1})
        )
        answers = await asyncio.gather(big, small)
        assert [a.status for a in answers] == [200, 200], [a.body[:200] for a in answers]
        assert await metric(h, HOLDS, face="http", waited="no") == 1  # the large one only
        assert await metric(h, HOLDS, face="http", waited="yes") == 0
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=5.0)


async def test_honest_bodies_are_served_as_before(tokenizer: Tokenizer) -> None:
    """8k token ids (about 48 kB: no estimate, no hold) and a 1 MiB chat of text full of commas and
    colons (held for its parse, never refused for them: the counts are an over-count, and holding
    is all they do)."""
    ids = {"model": MODEL, "prompt": [100_000 + i % 20_000 for i in range(8192)], "max_tokens": 1}
    body = json.dumps(ids).encode()
    assert len(body) < PARSE_HOLD_MIN_BYTES
    text = "a, b: [c], d: {e}, " * (1024 * 1024 // 19)
    chat = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    ).encode()
    assert json_parse_bytes(chat) > 40 * len(chat)  # counted as if every comma and colon were a value
    async with running(
        tokenizer, 1, limits__max_body_bytes=8 * 1024 * 1024, limits__max_prompt_tokens=1_000_000
    ) as h:
        for data in (body, chat):
            answer = await h.post("/v1/completions" if data is body else "/v1/chat/completions", data)
            assert forwarded(answer), answer.body[:300]
        assert await metric(h, HOLDS, face="http", waited="no") == 1  # the chat only
        assert await metric(h, "kvlb_admission_shed_total", reason="body_bytes") == 0
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=5.0)


CHAT = tiny_chat(0)
_PARSED = parse_request(CHAT, "chat")
TOKENIZING = tokenizing_hold_bytes(
    _PARSED, piece_hold_chars(shared_deepseek(), _PARSED), shared_deepseek().limits.max_prompt_tokens
)
LIMITS = {
    "limits__max_body_bytes": 2 * 1024 * 1024,
    # the chat's body and tokenizing hold and the large body, not its parse too
    "limits__max_inflight_body_bytes": len(CHAT)
    + TOKENIZING
    + len(PATHOLOGICAL)
    + json_parse_bytes(PATHOLOGICAL) // 2,
    "limits__max_prompt_tokens": 200_000,
}


async def test_a_parse_waits_while_the_budget_is_full_then_is_served(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, limits__queue_timeout_s=30.0, **LIMITS) as h:
        first = asyncio.create_task(h.post("/v1/chat/completions", tiny_chat(1)))
        await wait_for("the chat to be tokenized", lambda: tokenizing(h), timeout_s=10.0)
        second = await h.post("/v1/completions", empty_objects(200_000, salt=7))
        assert second.status == 200, second.body[:300]
        assert forwarded(await first)
        assert await metric(h, HOLDS, face="http", waited="yes") == 1  # waited for the chat's thread
        assert await metric(h, "kvlb_admission_shed_total", reason="body_bytes") == 0
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)


async def test_without_a_queue_a_parse_that_does_not_fit_gets_429(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, limits__max_queued=0, **LIMITS) as h:
        first = asyncio.create_task(h.post("/v1/chat/completions", tiny_chat(2)))
        await wait_for("the chat to be tokenized", lambda: tokenizing(h), timeout_s=10.0)
        second = await h.post("/v1/completions", empty_objects(200_000, salt=8))
        assert second.status == 429 and int(second.headers["Retry-After"]) >= 1, second.body[:300]
        assert "max_inflight_body_bytes" in second.json()["error"]["message"]
        assert forwarded(await first)
        assert await metric(h, "kvlb_admission_shed_total", reason="body_bytes") == 1
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)
        again = await h.post("/v1/completions", empty_objects(200_000, salt=8))  # the budget is free
        assert again.status == 200, again.body[:300]
