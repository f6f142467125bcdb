"""The tokenizer's working memory in the byte budget (``limits.max_inflight_body_bytes``) over real
sockets: a balancer and an emulated replica on 127.0.0.1, text prompts of a few hundred thousand
characters tokenized in the tokenizer's threads. While one is tokenized it holds the estimate of its
parsed form and of the tokenizer's work (:func:`~balancer.api.openai.tokenizing_hold_bytes`: for
these texts, encoded in pieces, one piece's work and the ids' list; in
``kvlb_admission_tokenizing_bytes``); a second one waits for it (or gets 429 without a queue;
RESOURCE_EXHAUSTED over gRPC); a chat tokenized on the event loop through the segment cache holds
nothing; and every byte comes back after an answer, a 400 over ``limits.max_prompt_tokens`` and a
client gone while its prompt was in the thread (then only once the thread is done)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from grpc_harness import failure, grpc_running
from kvlb_harness import (
    MODEL,
    Answer,
    metric,
    nothing_held,
    running,
    shared_deepseek,
    tokenizing,
    wait_for,
)

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.openai import (
    INLINE_TOKENIZE_CHARS,
    PIECE_HOLD_FACTOR,
    TOKEN_ID_LIST_BYTES,
    TOKENIZER_BYTES_PER_ASCII_CHAR,
    piece_hold_chars,
    tokenizing_hold_bytes,
)
from balancer.api.parsing import ParsedRequest, parse_request
from balancer.tokenizer.tokenizer import Tokenizer

TEXT_CHARS = 400_000
"""Characters of each text prompt: about 65,000 tokens, tokenized in a thread for about 0.3 s."""
WORDS = ("alpha", "river", "stone", "cloud", "green", "seven", "quiet", "table")


def text(salt: int, chars: int = TEXT_CHARS) -> str:
    words = " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(chars // 6 + 1))
    return f"s{salt} {words}"[:chars]


def text_body(salt: int, chars: int = TEXT_CHARS) -> bytes:
    return json.dumps({"model": MODEL, "prompt": text(salt, chars), "max_tokens": 1}).encode()


def forwarded(answer: Answer) -> bool:
    """``answer`` is the replica's: the emulated one refuses a prompt over its 512-token context
    (400), which is how it answers these prompts once kvlb has routed them."""
    return "x-kvlb-replica" in answer.headers and b"exceeds 512" in answer.body


def hold_of(parsed: ParsedRequest) -> int:
    """What ``parsed`` holds while the balancer's tokenizer (the default one, with its own limits:
    ``kvlb_harness`` hands it over as it is) encodes it in a thread: for these long texts, the
    pieces' hold (:func:`~balancer.api.openai.piece_hold_chars`)."""
    tokenizer = shared_deepseek()
    pieces = piece_hold_chars(tokenizer, parsed)
    return tokenizing_hold_bytes(parsed, pieces, tokenizer.limits.max_prompt_tokens)


BODY = len(text_body(0))
HOLD = hold_of(parse_request(text_body(0), "completions"))
LIMITS = {
    "limits__max_body_bytes": 4 * BODY,
    # two bodies and one prompt's hold, not two
    "limits__max_inflight_body_bytes": 2 * BODY + HOLD + HOLD // 2,
    "limits__max_prompt_tokens": 100_000,
}


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def test_the_hold_is_mostly_the_tokenizer_s_work() -> None:
    parsed = parse_request(text_body(0), "completions")
    piece = PIECE_HOLD_FACTOR * shared_deepseek().limits.piece_chars
    # encoded in pieces: one piece's work and the ids' list (fewer ids than characters: ASCII)
    assert (
        HOLD - parsed.parsed_bytes
        == TOKENIZER_BYTES_PER_ASCII_CHAR * piece + TOKEN_ID_LIST_BYTES * TEXT_CHARS
    )
    assert HOLD > 100 * BODY


async def test_a_long_text_holds_its_tokenizer_estimate_while_tokenized_and_a_second_waits(
    tokenizer: Tokenizer,
) -> None:
    async with running(tokenizer, 1, limits__queue_timeout_s=30.0, **LIMITS) as h:
        peak_tokenizing = 0.0
        done = asyncio.Event()

        async def sample() -> None:
            nonlocal peak_tokenizing
            while not done.is_set():
                peak_tokenizing = max(peak_tokenizing, await metric(h, "kvlb_admission_tokenizing_bytes"))
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        first = asyncio.create_task(h.post("/v1/completions", text_body(1)))
        await wait_for("the first prompt to be tokenized", lambda: tokenizing(h), timeout_s=10.0)
        assert await metric(h, "kvlb_admission_tokenizing_bytes") == HOLD
        assert await metric(h, "kvlb_admission_body_bytes") >= BODY + HOLD
        second = asyncio.create_task(h.post("/v1/completions", text_body(2)))
        answers = await asyncio.gather(first, second)
        done.set()
        await sampler
        assert all(map(forwarded, answers)), [a.body[:200] for a in answers]
        assert peak_tokenizing == HOLD  # one at a time: the second waited for the first's thread
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)
        assert await metric(h, "kvlb_admission_shed_total", reason="body_bytes") == 0


def chat_body(system: str, question: str) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()


async def test_without_a_queue_a_second_text_gets_429_a_cached_chat_goes_and_every_byte_comes_back(
    tokenizer: Tokenizer,
) -> None:
    long_body = text_body(3, 4 * TEXT_CHARS)  # about a second in the thread: the chats come meanwhile
    system = text(9, 3 * INLINE_TOKENIZE_CHARS)
    chat_hold = tokenizing_hold_bytes(parse_request(chat_body(system, "second question"), "chat"))
    long_hold = hold_of(parse_request(long_body, "completions"))
    limits = dict(
        LIMITS,
        limits__max_body_bytes=len(long_body),
        # the long prompt's body and hold, and room for the bodies of the chats, not their holds
        limits__max_inflight_body_bytes=len(long_body) + long_hold + chat_hold // 2,
    )
    async with running(tokenizer, 1, limits__max_queued=0, **limits) as h:
        warm = await h.post("/v1/chat/completions", chat_body(system, "first question"))
        assert "x-kvlb-replica" in warm.headers, warm.body[:200]  # its system prompt now cached
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)

        first = asyncio.create_task(h.post("/v1/completions", long_body))
        await wait_for("the first prompt to be tokenized", lambda: tokenizing(h), timeout_s=10.0)
        second = await h.post("/v1/completions", text_body(4))
        assert second.status == 429 and int(second.headers["Retry-After"]) >= 1
        assert "max_inflight_body_bytes" in second.json()["error"]["message"]
        # a chat whose new part is short is tokenized on the event loop: it holds nothing, so it
        # goes while the budget is held; the same chat with a system prompt never seen goes to a
        # thread, must hold, and finds no queue
        cached = await h.post("/v1/chat/completions", chat_body(system, "second question"))
        assert "x-kvlb-replica" in cached.headers, cached.body[:200]
        new = await h.post("/v1/chat/completions", chat_body(text(10, 3 * INLINE_TOKENIZE_CHARS), "q"))
        assert await tokenizing(h), "the first prompt was tokenized before the chats were sent"
        assert new.status == 429, new.body[:200]
        # about 270,000 tokens: over max_prompt_tokens, refused once tokenized, its hold given back
        refused = await first
        assert refused.status == 400 and "max_prompt_tokens" in refused.json()["error"]["message"]
        assert await metric(h, "kvlb_admission_shed_total", reason="body_bytes") == 2
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)


async def test_a_client_gone_while_its_prompt_is_tokenized_holds_until_the_thread_is_done(
    tokenizer: Tokenizer,
) -> None:
    chars = 4 * TEXT_CHARS  # about a second in the thread
    hold = hold_of(parse_request(text_body(5, chars), "completions"))
    async with running(
        tokenizer, 1, **dict(LIMITS, limits__max_body_bytes=4 * len(text_body(5, chars)))
    ) as h:
        gone = asyncio.create_task(h.post("/v1/completions", text_body(5, chars)))
        await wait_for("the prompt to be tokenized", lambda: tokenizing(h), timeout_s=10.0)
        gone.cancel()  # the client closes its connection: kvlb cancels the handler
        with pytest.raises(asyncio.CancelledError):
            await gone
        await asyncio.sleep(0.05)
        # the thread cannot be stopped: its estimate stays held until it is done, then comes back
        assert await metric(h, "kvlb_admission_tokenizing_bytes") == hold
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=20.0)
        assert forwarded(await h.post("/v1/completions", text_body(6)))
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)


async def test_a_grpc_text_holds_its_tokenizer_estimate_and_a_second_gets_resource_exhausted(
    tokenizer: Tokenizer,
) -> None:
    async with grpc_running(tokenizer, 1, limits__max_queued=0, **LIMITS) as g:
        h = g.http

        async def generate(salt: int) -> grpc.aio.AioRpcError:
            request = pb.GenerateRequest(model=MODEL, prompt_text=text(salt), max_tokens=1)
            return await failure(_drain(g.balancer.Generate(request)))

        first = asyncio.create_task(generate(1))
        await wait_for("the first prompt to be tokenized", lambda: tokenizing(h), timeout_s=10.0)
        held = await metric(h, "kvlb_admission_tokenizing_bytes")
        parsed = parse_request(text_body(1), "completions")
        assert HOLD - parsed.parsed_bytes < held <= HOLD + 1024
        second = await generate(2)
        assert second.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, second.details()
        assert "max_inflight_body_bytes" in (second.details() or "")
        refused = await first  # the emulated replica's answer: kvlb routed and forwarded it
        assert "exceeds 512" in (refused.details() or ""), refused.details()
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)


async def _drain(call: Any) -> None:
    async for _ in call:
        pass
