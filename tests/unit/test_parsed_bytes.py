"""The parsed request's bytes: the estimate of :func:`~balancer.api.parsing.json_text_size` against
``tracemalloc`` on the worst shapes (tiny messages, content parts, distinct keys, tools, non-ASCII
text), what a request tokenized in a thread holds (:func:`~balancer.api.openai.tokenizing_hold_bytes`:
that estimate and the tokenizer's working memory), and the queue of
:meth:`~balancer.service.admission.Admission.hold_tokenizing`: in order, never two holds past the
budget, no deadlock, and every byte back (no I/O)."""

from __future__ import annotations

import asyncio
import gc
import json
import tracemalloc
from typing import Any

import pytest

from balancer.api.openai import (
    INLINE_TOKENIZE_CHARS,
    TOKENIZER_BYTES_PER_ASCII_CHAR,
    TOKENIZER_BYTES_PER_CHAR,
    tokenizing_hold_bytes,
)
from balancer.api.parsing import ParsedRequest, json_text_ascii, json_text_size, parse_request
from balancer.service.admission import MAX_BYTES, Admission, AdmissionLimits, AdmissionRefused

ESTIMATE_OVER_TRACED = (0.99, 1.6)
"""The estimate over the memory ``tracemalloc`` sees kept by the parsed request: not below it but
for the request's own fields (about 1 kB: its dataclass, ``model``), an object counted once per use
and none missed; at most 1.6 (measured 1.00–1.45; the surplus is the keys and one-character strings
the decoder shares)."""


def chat(messages: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}, ensure_ascii=False).encode()


SHAPES: dict[str, tuple[str, bytes]] = {
    "one long string": ("chat", chat([{"role": "user", "content": "a" * 1_000_000}])),
    "40,000 one-letter messages": ("chat", chat([{"role": "user", "content": "a"}] * 40_000)),
    "20,000 five-letter messages": ("chat", chat([{"role": "user", "content": "hello"}] * 20_000)),
    "content parts": ("chat", chat([{"role": "user", "content": [{"type": "text", "text": "ab"}] * 20_000}])),
    "deep content parts": (
        "chat",
        chat([{"role": "user", "content": [{"type": "text", "text": "ab", "x": [[[]]]}] * 10_000}]),
    ),
    "20,000 distinct keys": (
        "chat",
        chat([{"role": "user", "content": "a", **{f"k{i}": i for i in range(20_000)}}]),
    ),
    "non-ASCII messages": ("chat", chat([{"role": "user", "content": "é" * 100 + "😀"}] * 2_000)),
    "tools": (
        "chat",
        chat(
            [{"role": "user", "content": "hi"}],
            tools=[
                {"type": "function", "function": {"name": f"f{i}", "parameters": {"a": 1}}}
                for i in range(5_000)
            ],
        ),
    ),
    "text prompt": ("completions", json.dumps({"model": "m", "prompt": "abc" * 300_000}).encode()),
    "text prompt with one emoji": (
        "completions",
        json.dumps({"model": "m", "prompt": "abc" * 300_000 + "😀"}, ensure_ascii=False).encode(),
    ),
}


def traced_parse(body: bytes, kind: Any) -> tuple[ParsedRequest, int]:
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        parsed = parse_request(body, kind)
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return parsed, kept - base


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() walks only what it made
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_estimate_is_within_its_factor_of_the_traced_memory(name: str) -> None:
    kind, body = SHAPES[name]
    parsed, kept = traced_parse(body, kind)
    low, high = ESTIMATE_OVER_TRACED
    assert low * kept <= parsed.parsed_bytes <= high * kept, (name, parsed.parsed_bytes, kept)


def test_tiny_messages_weigh_many_times_their_body_and_the_estimate_says_so() -> None:
    body = SHAPES["40,000 one-letter messages"][1]
    parsed = parse_request(body, "chat")
    assert parsed.parsed_bytes > 8 * len(body)  # what the byte budget of the bodies alone missed


def test_json_text_size_counts_characters_as_json_text_chars_did() -> None:
    chars, size = json_text_size({"ab": ["cde", {"f": "gh"}, 3, None, True]})
    assert chars == 2 + 3 + 1 + 2 and size > 0
    assert json_text_size("x" * 10)[0] == 10


def test_a_thread_s_hold_is_the_parsed_estimate_and_the_tokenizer_s_work_per_character() -> None:
    long = parse_request(chat([{"role": "user", "content": "a"}] * 1_000), "chat")
    work = TOKENIZER_BYTES_PER_ASCII_CHAR * long.text_chars
    assert tokenizing_hold_bytes(long) == long.parsed_bytes + work
    text = parse_request(json.dumps({"model": "m", "prompt": "a" * 10_000}).encode(), "completions")
    assert tokenizing_hold_bytes(text) == text.parsed_bytes + TOKENIZER_BYTES_PER_ASCII_CHAR * 10_000
    assert text.parsed_bytes >= 10_000
    # the same characters in a wider form weigh more parsed, and the tokenizer's part is the one for
    # any text: per character, whatever their width
    emoji = parse_request(json.dumps({"model": "m", "prompt": "\U0001f600" * 10_000}).encode(), "completions")
    assert emoji.text_chars == 10_000 and emoji.parsed_bytes >= 40_000
    assert tokenizing_hold_bytes(emoji) - emoji.parsed_bytes == TOKENIZER_BYTES_PER_CHAR * 10_000
    latin = parse_request(json.dumps({"model": "m", "prompt": "\u00e9" * 10_000}).encode(), "completions")
    assert tokenizing_hold_bytes(latin) - latin.parsed_bytes == TOKENIZER_BYTES_PER_CHAR * 10_000


@pytest.mark.parametrize(
    "where",
    [
        {"messages": [{"role": "user", "content": "caf\u00e9 " * 2_000}]},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "x" * 9_000}, {"type": "text", "text": "\u4e2d"}],
                }
            ]
        },
        {"messages": [{"role": "user", "content": "x" * 9_000, "n\u00e4me": "a"}]},
        {
            "messages": [{"role": "user", "content": "x" * 9_000}],
            "tools": [{"type": "function", "function": {"name": "f", "description": "\u00fc"}}],
        },
    ],
    ids=["content", "a content part", "a key", "tools"],
)
def test_one_non_ascii_string_anywhere_in_a_chat_takes_the_estimate_for_any_text(
    where: dict[str, object],
) -> None:
    parsed = parse_request(json.dumps({"model": "m", **where}).encode(), "chat")
    assert parsed.text_chars > INLINE_TOKENIZE_CHARS
    assert tokenizing_hold_bytes(parsed) == parsed.parsed_bytes + TOKENIZER_BYTES_PER_CHAR * parsed.text_chars
    ascii_only = json.loads(json.dumps(where).encode().decode("unicode_escape").encode("ascii", "replace"))
    plain = parse_request(json.dumps({"model": "m", **ascii_only}).encode(), "chat")
    assert (
        tokenizing_hold_bytes(plain) == plain.parsed_bytes + TOKENIZER_BYTES_PER_ASCII_CHAR * plain.text_chars
    )


def test_json_text_ascii_looks_at_every_string_and_key() -> None:
    assert json_text_ascii({"ab": ["cde", {"f": "gh"}, 3, None, True]})
    assert not json_text_ascii({"ab": ["cde", {"f": "g\u00e9"}]})
    assert not json_text_ascii({"ab": ["cde", {"\u00e9": "gh"}]})
    assert json_text_ascii([]) and json_text_ascii({})


BUDGET = 1000


def gate(queued: int = 4, timeout_s: float = 5.0) -> Admission:
    return Admission(AdmissionLimits(8, queued, timeout_s, BUDGET))


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_parse_that_fits_holds_at_once_and_one_alone_goes_even_past_the_budget() -> None:
    g = gate()
    assert g.try_enter(300)
    assert g.try_hold_tokenizing(500) and (g.body_bytes, g.tokenizing_bytes) == (800, 500)
    g.give_back(500, 500)
    assert g.try_enter(600)  # 900 held by bodies
    assert g.try_hold_tokenizing(5_000)  # no tokenizing bytes held: it goes alone (it could never fit)
    assert (g.body_bytes, g.tokenizing_bytes) == (5_900, 5_000)
    assert not g.try_hold_tokenizing(1)  # another tokenizing hold taken and the budget passed: it waits
    assert not g.try_enter(0)  # newcomers wait while the budget is passed
    g.give_back(5_000, 5_000)
    assert (g.body_bytes, g.tokenizing_bytes) == (900, 0)


async def test_a_second_parse_waits_for_the_first_to_be_tokenized_then_goes() -> None:
    g = gate()
    assert g.try_enter(200) and g.try_enter(200)
    assert g.try_hold_tokenizing(700)  # 1,100 held: past the budget, alone
    second = asyncio.create_task(g.hold_tokenizing(700, g.deadline()))
    await settle()
    assert not second.done() and g.queued == 1 and g.tokenizing_bytes == 700
    assert not g.try_enter(0)  # the budget is passed: newcomers wait
    g.give_back(700, 700)  # the first is tokenized
    await second
    assert (g.body_bytes, g.tokenizing_bytes, g.queued) == (1_100, 700, 0)
    g.give_back(700, 700)
    g.leave(200)
    g.leave(200)
    assert (g.body_bytes, g.tokenizing_bytes, g.inflight) == (0, 0, 0)


async def test_a_newcomer_that_fits_does_not_wait_for_a_tokenizing_hold_waiting() -> None:
    """A tokenizing hold waits for the tokenizations before it to end, not for room newcomers take:
    a small request of another tenant goes in at once (before 2026-12-01 it waited until the first
    hold was given back), and the hold still goes, alone, when the first is given back."""
    g = gate()
    assert g.try_enter(100) and g.try_hold_tokenizing(700)  # 800 held
    second = asyncio.create_task(g.hold_tokenizing(700, g.deadline()))
    await settle()
    assert not second.done() and g.queued == 1
    other = g.tenant("other")
    assert g.try_enter(50, other)  # 850: it fits, and waits for nobody
    assert not g.try_enter(200, other)  # 1,050 would not fit
    g.give_back(700, 700)  # the first is tokenized: the second goes (alone, past the budget if need be)
    await second
    assert (g.body_bytes, g.tokenizing_bytes, g.inflight) == (850, 700, 2)


async def test_parsed_waiters_go_in_order_before_the_front_queue_and_the_newcomers() -> None:
    g = gate()
    assert g.try_enter(100) and g.try_hold_tokenizing(900)
    order: list[str] = []

    async def parsed(name: str, size: int) -> None:
        await g.hold_tokenizing(size, g.deadline())
        order.append(name)

    async def chunk(name: str, size: int) -> None:
        await g.hold(size, g.deadline())
        order.append(name)

    async def newcomer(name: str) -> None:
        await g.enter(g.deadline(), 50)
        order.append(name)

    tasks = [asyncio.create_task(newcomer("newcomer"))]
    await settle()
    tasks += [asyncio.create_task(parsed("large", 600)), asyncio.create_task(chunk("chunk", 100))]
    await settle()
    tasks.append(asyncio.create_task(parsed("small", 10)))  # it would fit with "large"'s room; it waits
    await settle()
    assert order == []
    g.give_back(900, 900)
    await settle()
    assert order == ["large", "small", "chunk", "newcomer"]
    await asyncio.gather(*tasks)
    assert (g.body_bytes, g.tokenizing_bytes) == (100 + 600 + 10 + 100 + 50, 610)


async def test_a_parsed_wait_too_long_is_503_a_full_queue_429_and_nothing_stays_held() -> None:
    g = gate(queued=1, timeout_s=0.05)
    assert g.try_enter(100) and g.try_hold_tokenizing(950)
    waiting = asyncio.create_task(g.hold_tokenizing(500, g.deadline()))
    await settle()
    with pytest.raises(AdmissionRefused) as full:
        await g.hold_tokenizing(500, g.deadline())
    assert (full.value.status, full.value.limit) == (429, MAX_BYTES)
    with pytest.raises(AdmissionRefused) as late:
        await waiting
    assert (late.value.status, late.value.limit) == (503, MAX_BYTES)
    assert "max_inflight_body_bytes" in late.value.message
    assert (g.body_bytes, g.tokenizing_bytes, g.queued) == (1_050, 950, 0)
    g.give_back(950, 950)
    g.leave(100)
    assert (g.body_bytes, g.tokenizing_bytes, g.inflight) == (0, 0, 0)


async def test_a_parsed_waiter_cancelled_leaves_the_queue_and_the_next_goes() -> None:
    g = gate()
    assert g.try_enter(100) and g.try_hold_tokenizing(900)
    first = asyncio.create_task(g.hold_tokenizing(500, g.deadline()))
    second = asyncio.create_task(g.hold_tokenizing(400, g.deadline()))
    await settle()
    first.cancel()
    await settle()
    assert first.cancelled() and not second.done()
    g.give_back(900, 900)
    await second
    assert (g.body_bytes, g.tokenizing_bytes) == (500, 400)


async def test_bodies_filling_the_budget_do_not_deadlock_their_parses() -> None:
    """Every request holds its body and waits for its parse's bytes: the first goes alone, and each
    next one when the one before is tokenized (a hold clamped to the room left would wait forever)."""
    g = gate()
    for _ in range(4):
        assert g.try_enter(250)  # the budget is full of bodies
    done: list[int] = []

    async def request(number: int) -> None:
        await g.hold_tokenizing(2_000, g.deadline())
        assert g.tokenizing_bytes == 2_000  # one parse at a time
        await asyncio.sleep(0.01)  # tokenized in a thread
        g.give_back(2_000, 2_000)
        done.append(number)

    async with asyncio.timeout(2.0):
        await asyncio.gather(*(request(n) for n in range(4)))
    assert done == [0, 1, 2, 3] and (g.body_bytes, g.tokenizing_bytes) == (1_000, 0)
