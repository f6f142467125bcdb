"""A long chat encoded in pieces holds one piece's work of the byte budget, over real sockets.

A balancer and an emulated replica on 127.0.0.1, the default tokenizer. A chat whose text is over
``piece_chars`` (a RAG context) holds, while it is rendered and tokenized in a thread, the pieces'
estimate (:func:`~balancer.api.openai.tokenizing_hold_bytes` with
:func:`~balancer.api.openai.piece_hold_chars`: one piece's work, the rendering and its ids), not
the whole encode's: a burst of long ASCII chats that the whole encode's hold let through one at a
time (the rest waited, here without a queue: 429) is held all at once and served, and every byte
comes back. A chat with a message without a safe cut for two pieces' length stops its thread
before that message is encoded and then holds the whole encode's estimate, as before."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from kvlb_harness import MODEL, Answer, metric, nothing_held, running, shared_deepseek, wait_for

from balancer.api.openai import piece_hold_chars, tokenizing_hold_bytes
from balancer.api.parsing import ParsedRequest, parse_request
from balancer.tokenizer.tokenizer import Tokenizer

WORDS = ("alpha", "river", "stone", "cloud", "green", "seven", "quiet", "table")
BURST = 4
CONTEXT_CHARS = 1_000_000
"""Characters of each chat's context (about 164,000 tokens, 0.3-0.5 s of a thread each)."""


def context(salt: int, chars: int) -> str:
    """ASCII words, a line of them every 60 words."""
    made = [WORDS[(i * 7 + salt) % len(WORDS)] for i in range(chars // 6 + 1)]
    return "\n".join(" ".join(made[at : at + 60]) for at in range(0, len(made), 60))[:chars]


def body(text: str, salt: int = 0) -> bytes:
    messages = [
        {"role": "system", "content": f"Answer from the context ({salt})."},
        {"role": "user", "content": f"Context:\n{text}\nQuestion: which word comes first?"},
    ]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()


def forwarded(answer: Answer) -> bool:
    """The emulated replica refuses a prompt over its 512-token context (400): the answer kvlb
    relays once it has tokenized and routed the chat."""
    return "x-kvlb-replica" in answer.headers and b"exceeds 512" in answer.body


def parsed(data: bytes) -> ParsedRequest:
    return parse_request(data, "chat")


def pieces_hold(request: ParsedRequest) -> int:
    tokenizer = shared_deepseek()
    pieces = piece_hold_chars(tokenizer, request)
    assert pieces is not None  # encoded in pieces
    return tokenizing_hold_bytes(request, pieces, tokenizer.limits.max_prompt_tokens)


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def test_a_burst_of_long_ascii_chats_is_held_at_once_and_served(tokenizer: Tokenizer) -> None:
    bodies = [body(context(salt, CONTEXT_CHARS), salt) for salt in range(BURST)]
    largest = max(map(len, bodies))
    piece = max(pieces_hold(parsed(b)) for b in bodies)
    whole = max(tokenizing_hold_bytes(parsed(b)) for b in bodies)
    # every body, its pieces' hold and its ids (4 B each, at most one a character)
    budget = BURST * (largest + piece + 4 * CONTEXT_CHARS)
    # the whole encode's hold let no two of them be tokenized at once in that budget
    assert 2 * (largest + whole) > budget
    async with running(
        tokenizer,
        1,
        limits__max_queued=0,  # a request that would wait is refused at once: 429
        limits__max_body_bytes=largest,
        limits__max_inflight_body_bytes=budget,
    ) as h:
        answers = await asyncio.gather(*(h.post("/v1/chat/completions", b) for b in bodies))
        assert all(map(forwarded, answers)), [(a.status, a.body[:200]) for a in answers]
        assert await metric(h, "kvlb_admission_shed_total", reason="body_bytes") == 0
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)


async def test_a_chat_with_a_message_without_cuts_holds_the_whole_estimate(tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    digits = body("".join(rng.choices("0123456789", k=600_000)))  # no safe cut in the context
    whole = tokenizing_hold_bytes(parsed(digits))
    assert pieces_hold(parsed(digits)) < whole  # what it holds first: its thread stops at once
    async with running(tokenizer, 1, limits__max_body_bytes=len(digits)) as h:
        peak = 0.0
        done = asyncio.Event()

        async def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, await metric(h, "kvlb_admission_tokenizing_bytes"))
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        answer = asyncio.create_task(h.post("/v1/chat/completions", digits))

        async def holds_whole() -> bool:
            return await metric(h, "kvlb_admission_tokenizing_bytes") == whole

        # about 200,000 tokens: a second or more of a thread, with the whole estimate held
        await wait_for("the whole encode's estimate held", holds_whole, timeout_s=20.0)
        assert forwarded(await answer)
        done.set()
        await sampler
        assert peak == whole  # never both holds at once: the pieces' was given back first
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)
