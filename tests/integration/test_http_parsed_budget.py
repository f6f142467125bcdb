"""The parsed request in the byte budget (``limits.max_inflight_body_bytes``) over real sockets: a
balancer and an emulated replica on 127.0.0.1, chats of many one-letter messages (each keeps about
8× its body once parsed) tokenized in the tokenizer's threads. While one is tokenized its estimate
is held (``kvlb_admission_body_bytes``, ``kvlb_admission_tokenizing_bytes``), a second one waits for it
(or gets 429 without a queue; RESOURCE_EXHAUSTED over gRPC), a bad body still gets its 4xx, and
every byte comes back."""

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
from balancer.api.openai import piece_hold_chars, tokenizing_hold_bytes
from balancer.api.parsing import parse_request
from balancer.tokenizer.tokenizer import Tokenizer

MESSAGES = 40_000
"""One-letter messages in each chat: tokenized in a thread for about half a second."""


def forwarded(answer: Answer) -> bool:
    """``answer`` is the replica's: the emulated one refuses a prompt over its 512-token context
    (400), which is how it answers these chats once kvlb has routed them."""
    return "x-kvlb-replica" in answer.headers and b"exceeds 512" in answer.body


def tiny_chat(salt: int, count: int = MESSAGES, content: str = "a") -> bytes:
    messages = [{"role": "user", "content": f"s{salt}"}] + [{"role": "user", "content": content}] * (
        count - 1
    )
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()


BODY = len(tiny_chat(0))
_TINY = parse_request(tiny_chat(0), "chat")
PARSED = tokenizing_hold_bytes(
    _TINY, piece_hold_chars(shared_deepseek(), _TINY), shared_deepseek().limits.max_prompt_tokens
)
"""What such a chat holds while it waits for and runs in a thread: its parsed estimate and the
tokenizer's work, the pieces' estimate since h-chathold (its text is over ``piece_chars``)."""
LIMITS = {
    "limits__max_body_bytes": BODY + 1024,
    # two bodies and one parsed chat, not two parsed chats
    "limits__max_inflight_body_bytes": 2 * BODY + PARSED + PARSED // 2,
    "limits__max_prompt_tokens": 4 * MESSAGES,
}


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def test_a_tiny_message_chat_weighs_many_times_its_body_parsed() -> None:
    assert PARSED > 8 * BODY


async def test_the_budget_holds_the_parsed_chat_while_it_is_tokenized_and_a_second_waits(
    tokenizer: Tokenizer,
) -> None:
    async with running(tokenizer, 1, limits__queue_timeout_s=30.0, **LIMITS) as h:
        peak_parsed = peak_held = 0.0
        done = asyncio.Event()

        async def sample() -> None:
            nonlocal peak_parsed, peak_held
            while not done.is_set():
                peak_parsed = max(peak_parsed, await metric(h, "kvlb_admission_tokenizing_bytes"))
                peak_held = max(peak_held, await metric(h, "kvlb_admission_body_bytes"))
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        first = asyncio.create_task(h.post("/v1/chat/completions", tiny_chat(1)))
        await wait_for("the first chat to be tokenized", lambda: tokenizing(h), timeout_s=10.0)
        held = await metric(h, "kvlb_admission_body_bytes")
        assert held >= BODY + PARSED  # its body and its parsed estimate
        second = asyncio.create_task(h.post("/v1/chat/completions", tiny_chat(2)))
        answers = await asyncio.gather(first, second)
        done.set()
        await sampler
        assert all(map(forwarded, answers)), [a.body[:200] for a in answers]
        assert peak_parsed == PARSED  # one parsed chat at a time: the second waited for the first
        assert BODY + PARSED <= peak_held <= 2 * BODY + PARSED + 2 * 4 * 4 * MESSAGES  # and ids
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)
        assert await metric(h, "kvlb_admission_shed_total", reason="body_bytes") == 0


async def test_without_a_queue_the_second_parsed_chat_gets_429_and_bad_bodies_their_4xx(
    tokenizer: Tokenizer,
) -> None:
    async with running(tokenizer, 1, limits__max_queued=0, **LIMITS) as h:
        first = asyncio.create_task(h.post("/v1/chat/completions", tiny_chat(3)))
        await wait_for("the first chat to be tokenized", lambda: tokenizing(h), timeout_s=10.0)
        second = await h.post("/v1/chat/completions", tiny_chat(4))
        assert second.status == 429 and int(second.headers["Retry-After"]) >= 1
        assert "max_inflight_body_bytes" in second.json()["error"]["message"]
        assert forwarded(await first)
        assert await metric(h, "kvlb_admission_shed_total", reason="body_bytes") == 1
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)
        # a bad message is refused by the parse, before any hold
        bad = tiny_chat(5).replace(b'"role": "user"', b'"role": 7', 1)
        answer = await h.post("/v1/chat/completions", bad)
        assert answer.status == 400 and "messages[0].role" in answer.json()["error"]["message"]
        # a chat over max_prompt_tokens is refused once tokenized, its parsed bytes given back
        long = tiny_chat(6, MESSAGES // 2, "a b c d e f g h")  # about 10 tokens a message
        assert len(long) <= BODY
        answer = await h.post("/v1/chat/completions", long)
        assert answer.status == 400 and "max_prompt_tokens" in answer.json()["error"]["message"]
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)
        assert forwarded(await h.post("/v1/chat/completions", tiny_chat(7)))
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)


def grpc_chat(salt: int) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role="user", content=f"s{salt}")]
    messages += [pb.ChatMessage(role="user", content="a")] * (MESSAGES - 1)
    return pb.GenerateRequest(model=MODEL, chat_messages=pb.ChatMessages(messages=messages), max_tokens=1)


async def test_a_grpc_chat_holds_its_parsed_estimate_and_a_second_gets_resource_exhausted(
    tokenizer: Tokenizer,
) -> None:
    async with grpc_running(tokenizer, 1, limits__max_queued=0, **LIMITS) as g:
        h = g.http

        async def generate(salt: int) -> grpc.aio.AioRpcError:
            return await failure(_drain(g.balancer.Generate(grpc_chat(salt))))

        first = asyncio.create_task(generate(1))
        await wait_for("the first chat to be tokenized", lambda: tokenizing(h), timeout_s=10.0)
        assert await metric(h, "kvlb_admission_tokenizing_bytes") >= PARSED // 2  # the same chat, as a dict
        second = await generate(2)
        assert second.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, second.details()
        assert "max_inflight_body_bytes" in (second.details() or "")
        refused = await first  # the emulated replica's answer: kvlb routed and forwarded it
        assert "exceeds 512" in (refused.details() or ""), refused.details()
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)


async def _drain(call: Any) -> None:
    async for _ in call:
        pass
