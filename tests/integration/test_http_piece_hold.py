"""A long text encoded in pieces holds one piece's work of the byte budget, over real sockets.

A balancer and an emulated replica on 127.0.0.1, the default tokenizer. A text prompt the tokenizer
encodes in pieces (:mod:`balancer.tokenizer.cuts`) holds, while it is tokenized in a thread, the
pieces' estimate (:func:`~balancer.api.openai.tokenizing_hold_bytes` with
:func:`~balancer.api.openai.piece_hold_chars`), not the whole encode's: a burst of long ASCII prompts
that the whole encode's hold let through one at a time (the rest waited, here without a queue: 429)
is now held all at once and served, and every byte comes back. A text with no safe cut for two
pieces' length stops its thread before anything is encoded and then holds the whole encode's
estimate, as before. Long chats (a RAG context) alike: a chat holds the pieces' estimate with its
rendering, and one with a message without a safe cut for two pieces' length stops its thread before
that message is encoded."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import grpc
import pytest
from grpc_harness import failure, grpc_running
from kvlb_harness import MODEL, Answer, metric, nothing_held, running, shared_deepseek, wait_for

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.openai import piece_hold_chars, tokenizing_hold_bytes
from balancer.api.parsing import ParsedRequest, parse_request
from balancer.tokenizer.tokenizer import Tokenizer

WORDS = ("alpha", "river", "stone", "cloud", "green", "seven", "quiet", "table")
TEXT_CHARS = 1_000_000
"""Characters of each prompt or chat context of a burst (about 164,000 tokens, 0.3-0.5 s of a thread
each)."""
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BURSTS = {"completions": 6, "chat": 4}


def words(salt: int, chars: int) -> str:
    return (
        f"s{salt} " + " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(chars // 6 + 1))[: chars - 3]
    )


def context(salt: int, chars: int) -> str:
    """ASCII words, a line of them every 60 words (a chat's RAG context)."""
    made = [WORDS[(i * 7 + salt) % len(WORDS)] for i in range(chars // 6 + 1)]
    return "\n".join(" ".join(made[at : at + 60]) for at in range(0, len(made), 60))[:chars]


def body(prompt: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()


def chat_body(text: str, salt: int = 0) -> bytes:
    messages = [
        {"role": "system", "content": f"Answer from the context ({salt})."},
        {"role": "user", "content": f"Context:\n{text}\nQuestion: which word comes first?"},
    ]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()


def long_body(kind: str, salt: int) -> bytes:
    """A burst's body: a text prompt of ASCII words, or a chat with a context of lines of them."""
    if kind == "chat":
        return chat_body(context(salt, TEXT_CHARS), salt)
    return body(words(salt, TEXT_CHARS))


def forwarded(answer: Answer) -> bool:
    """The emulated replica refuses a prompt over its 512-token context (400): the answer kvlb
    relays once it has tokenized and routed the prompt."""
    return "x-kvlb-replica" in answer.headers and b"exceeds 512" in answer.body


def parsed(data: bytes, kind: str = "completions") -> ParsedRequest:
    return parse_request(data, "chat" if kind == "chat" else "completions")


def pieces_hold(request: ParsedRequest) -> int:
    tokenizer = shared_deepseek()
    pieces = piece_hold_chars(tokenizer, request)
    assert pieces is not None  # encoded in pieces
    return tokenizing_hold_bytes(request, pieces, tokenizer.limits.max_prompt_tokens)


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


@pytest.mark.parametrize("kind", sorted(PATHS))
async def test_a_burst_of_long_ascii_prompts_or_chats_is_held_at_once_and_served(
    kind: str, tokenizer: Tokenizer
) -> None:
    bodies = [long_body(kind, salt) for salt in range(BURSTS[kind])]
    largest = max(map(len, bodies))
    piece = max(pieces_hold(parsed(b, kind)) for b in bodies)
    whole = max(tokenizing_hold_bytes(parsed(b, kind)) for b in bodies)
    # every body, its pieces' hold and its ids (4 B each, at most one a character)
    budget = BURSTS[kind] * (largest + piece + 4 * TEXT_CHARS)
    # the whole encode's hold let no two of them be tokenized at once in that budget
    assert 2 * (largest + whole) > budget
    async with running(
        tokenizer,
        1,
        limits__max_queued=0,  # a request that would wait is refused at once: 429
        limits__max_body_bytes=largest,
        limits__max_inflight_body_bytes=budget,
    ) as h:
        answers = await asyncio.gather(*(h.post(PATHS[kind], b) for b in bodies))
        assert all(map(forwarded, answers)), [(a.status, a.body[:200]) for a in answers]
        assert await metric(h, "kvlb_admission_shed_total", reason="body_bytes") == 0
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)


@pytest.mark.parametrize("kind", sorted(PATHS))
async def test_a_text_or_chat_without_cuts_holds_the_whole_estimate(kind: str, tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    text = "".join(rng.choices("0123456789", k=600_000))  # no safe cut at all
    digits = chat_body(text) if kind == "chat" else body(text)
    whole = tokenizing_hold_bytes(parsed(digits, kind))
    assert pieces_hold(parsed(digits, kind)) < whole  # what it holds first: its thread stops at once
    async with running(tokenizer, 1, limits__max_body_bytes=len(digits)) as h:
        peak = 0.0
        done = asyncio.Event()

        async def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, await metric(h, "kvlb_admission_tokenizing_bytes"))
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        answer = asyncio.create_task(h.post(PATHS[kind], digits))

        async def holds_whole() -> bool:
            return await metric(h, "kvlb_admission_tokenizing_bytes") == whole

        # about 200,000 tokens: a second or more of a thread, with the whole estimate held
        await wait_for("the whole encode's estimate held", holds_whole, timeout_s=20.0)
        assert forwarded(await answer)
        done.set()
        await sampler
        assert peak == whole  # never both holds at once: the pieces' was given back first
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)


async def test_over_grpc_a_text_without_cuts_waits_its_turn_for_the_whole_estimate_and_is_served(
    tokenizer: Tokenizer,
) -> None:
    """The gRPC face takes the same holds: a text with cuts holds the pieces' estimate; a text
    without cuts sent with it stops its thread and then needs the whole estimate, which the budget
    has room for only once the first's hold is given back (or alone): it waits for it in the queue,
    its message dropped and made again once let in, if the first is still in its thread then.
    Both are routed, nothing is refused for want of bytes, and every byte comes back."""
    rng = random.Random(8)
    digits = "".join(rng.choices("0123456789", k=600_000))
    text = words(1, TEXT_CHARS)
    whole = tokenizing_hold_bytes(parsed(body(digits)))
    piece = pieces_hold(parsed(body(text)))
    # room for the first's pieces' hold and the second's, not for the second's whole estimate
    budget = 4 * TEXT_CHARS + piece + pieces_hold(parsed(body(digits))) + 4 * TEXT_CHARS
    assert piece + whole > budget
    async with grpc_running(
        tokenizer, 1, limits__queue_timeout_s=30.0, limits__max_inflight_body_bytes=budget
    ) as g:
        h = g.http

        async def generate(prompt: str) -> grpc.aio.AioRpcError:
            request = pb.GenerateRequest(model=MODEL, prompt_text=prompt, max_tokens=1)
            return await failure(_drain(g.balancer.Generate(request)))

        answers = await asyncio.gather(generate(text), generate(digits))
        for answer in answers:  # the emulated replica's answer: kvlb routed and forwarded it
            assert "exceeds 512" in (answer.details() or ""), answer.details()
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)
        assert await metric(h, "kvlb_admission_shed_total", reason="body_bytes") == 0


async def _drain(call: Any) -> None:
    async for _ in call:
        pass
