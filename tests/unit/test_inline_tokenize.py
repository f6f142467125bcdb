"""What runs on the event loop: a request is tokenized inline only when all the text the tokenizer
reads is short (content parts, tools and the message count included); longer ones go to a thread."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

import pytest

from balancer.api.errors import ApiError
from balancer.api.openai import INLINE_TOKENIZE_CHARS, PRECHECK_CHARS, tokenize, tokenize_inline
from balancer.api.parsing import PER_MESSAGE_CHARS, ParsedRequest, json_text_chars, parse_request
from balancer.service.state import Pool
from balancer.tokenizer.default import deepseek_tokenizer_file, default_tokenizer
from balancer.tokenizer.tokenizer import TokenizeLimits


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


def parts(text: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": text}, {"type": "image_url", "image_url": "http://x/y.png"}]


def test_json_text_chars_counts_every_string_and_key() -> None:
    assert json_text_chars({"ab": ["cde", {"f": "gh"}, 3, None, True]}) == 2 + 3 + 1 + 2
    assert json_text_chars("x" * 10) == 10
    assert json_text_chars([]) == 0


def test_content_parts_count_towards_the_size() -> None:
    text = "word " * 20_000
    parsed = parse_request(chat_body([{"role": "user", "content": parts(text)}]), "chat")
    assert parsed.text_chars >= len(text) > INLINE_TOKENIZE_CHARS


def test_tools_count_towards_the_size() -> None:
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 10_000, "parameters": {}}}
    parsed = parse_request(chat_body([{"role": "user", "content": "hi"}], tools=[tool]), "chat")
    assert parsed.text_chars >= 10_000 > INLINE_TOKENIZE_CHARS


def test_many_short_messages_count_towards_the_size() -> None:
    messages = [
        {"role": "user", "content": "ok"} for _ in range(INLINE_TOKENIZE_CHARS // PER_MESSAGE_CHARS + 1)
    ]
    parsed = parse_request(chat_body(messages), "chat")
    assert parsed.text_chars > INLINE_TOKENIZE_CHARS


def test_a_short_chat_stays_small() -> None:
    parsed = parse_request(chat_body([{"role": "user", "content": "What is 2+2?"}]), "chat")
    assert parsed.text_chars < INLINE_TOKENIZE_CHARS


class RecordingTokenizer:
    """Records the thread each encode ran on."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def encode_chat(self, messages: Sequence[Any], **kwargs: Any) -> list[int]:
        self.threads.append(threading.current_thread())
        return [1, 2, 3]

    def encode_chat_if_cached(self, messages: Sequence[Any], kwargs: Any, max_new_chars: int) -> None:
        return None  # nothing is cached here


async def test_a_large_content_part_request_is_tokenized_in_a_thread() -> None:
    recorder = RecordingTokenizer()
    pool = cast(Pool, SimpleNamespace(tokenizer=recorder))
    large = parse_request(chat_body([{"role": "user", "content": parts("word " * 20_000)}]), "chat")
    small = parse_request(chat_body([{"role": "user", "content": parts("word")}]), "chat")
    assert list(await tokenize(pool, large, 100)) == [1, 2, 3]
    assert list(await tokenize(pool, small, 100)) == [1, 2, 3]
    assert recorder.threads[0] is not threading.main_thread()
    assert recorder.threads[1] is threading.main_thread()


@pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed")
async def test_the_loop_keeps_running_while_a_large_content_part_is_tokenized() -> None:
    """A 1M-character content part with the real tokenizer: the event loop ticks throughout (it was
    tokenized inline before, so no tick could happen until it was done)."""
    tokenizer = await asyncio.to_thread(default_tokenizer)
    pool = cast(Pool, SimpleNamespace(tokenizer=tokenizer))
    text = " ".join(f"word{i % 977}" for i in range(120_000))
    parsed: ParsedRequest = parse_request(chat_body([{"role": "user", "content": parts(text)}]), "chat")
    task = asyncio.create_task(tokenize(pool, parsed, 1_048_576))
    ticks = 0
    while not task.done():
        await asyncio.sleep(0.001)
        ticks += 0 if task.done() else 1
    assert len(await task) > 100_000
    assert ticks >= 5


class ThreadOf:
    """The real tokenizer, recording where each full encode ran and what the cache check said."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.threads: list[threading.Thread] = []
        self.checks: list[bool] = []

    def encode_chat(self, messages: Sequence[Any], **kwargs: Any) -> list[int]:
        self.threads.append(threading.current_thread())
        ids: list[int] = self.tokenizer.encode_chat(messages, **kwargs)
        return ids

    def encode_chat_if_cached(self, messages: Sequence[Any], kwargs: Any, max_new_chars: int) -> Any:
        ids = self.tokenizer.encode_chat_if_cached(messages, kwargs, max_new_chars)
        self.checks.append(ids is not None)
        return ids


@pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed")
async def test_a_chat_whose_system_prompt_is_cached_is_tokenized_inline() -> None:
    """A large chat is tokenized on the loop when all but a short user message is in the segment
    cache, with the ids of a plain encode; a new one, or one with a long new message, in a thread."""
    tokenizer = await asyncio.to_thread(default_tokenizer)
    recorder = ThreadOf(tokenizer)
    pool = cast(Pool, SimpleNamespace(tokenizer=recorder))
    system = " ".join(f"rule{i % 613}" for i in range(6_000))
    assert INLINE_TOKENIZE_CHARS < len(system) < PRECHECK_CHARS

    def chat(question: str) -> ParsedRequest:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return parse_request(chat_body(messages), "chat")

    first = await tokenize(pool, chat("What is the first rule?"), 1_048_576)  # all new: a thread
    second = await tokenize(pool, chat("And the second one?"), 1_048_576)  # system prompt cached
    long_question = "why " * (INLINE_TOKENIZE_CHARS // 2)
    third = await tokenize(pool, chat(long_question), 1_048_576)  # too much new text: a thread
    assert recorder.checks == [False, True, False]
    assert [t is threading.main_thread() for t in recorder.threads] == [False, False]
    for ids, question in ((first, "What is the first rule?"), (second, "And the second one?")):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        plain = tokenizer._ids(tokenizer.render_chat(messages), add_special_tokens=False)
        assert list(ids) == plain
    assert len(third) > len(second)


@pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed")
async def test_a_text_over_max_prompt_chars_is_refused_on_the_loop_before_any_hold() -> None:
    """Such a text would hold about 2 GiB for a thread that refuses it at once: it is refused inline
    (400); one character fewer goes to a thread (``None``: the caller holds, then encodes)."""
    tokenizer = await asyncio.to_thread(default_tokenizer, TokenizeLimits(max_prompt_chars=10_000))
    pool = cast(Pool, SimpleNamespace(tokenizer=tokenizer))

    def text(chars: int) -> ParsedRequest:
        return parse_request(json.dumps({"model": "m", "prompt": "a" * chars}).encode(), "completions")

    with pytest.raises(ApiError) as refused:
        tokenize_inline(pool, text(10_001), 1_000_000)
    assert refused.value.status == 400 and "10000" in str(refused.value)
    assert tokenize_inline(pool, text(10_000), 1_000_000) is None
