"""The memo of whole request bodies: bounded in entries and bytes, counted, and giving exactly what
a fresh parse of the same bytes gives (``balancer/api/body_memo.py``)."""

from __future__ import annotations

import json
from array import array
from dataclasses import replace
from typing import Any

import pytest

from balancer.api.body_memo import ENTRY_OVERHEAD_BYTES, BodyMemo
from balancer.api.parsing import ParsedRequest, RequestKind, parse_request

TOKENIZER = object()


def _raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _ids(count: int) -> array[int]:
    return array("I", range(count))


def _seen_twice(
    memo: BodyMemo, raw: bytes, kind: RequestKind = "chat", ids: array[int] | None = None
) -> None:
    parsed = parse_request(raw, kind)
    for _ in range(2):  # kept from its second sight
        memo.note(memo.key(raw, kind), parsed, TOKENIZER, ids if ids is not None else _ids(8))


def _slim(parsed: ParsedRequest) -> ParsedRequest:
    return replace(parsed, prompt=None, messages=None, chat_kwargs={}, packed=None)


SYSTEM = "You are a careful assistant. " * 40
VARIED: list[tuple[RequestKind, dict[str, Any]]] = [
    (
        "chat",
        {
            "model": "m",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Q1"}],
        },
    ),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "Q1"}], "stream": True}),
    (
        "chat",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Q1"}],
            "stream": True,
            "stream_options": {"include_usage": False},
        },
    ),
    (
        "chat",
        {"model": "m", "messages": [{"role": "user", "content": "Q1"}], "stream": True, "stream_options": {}},
    ),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "Q1"}], "user": "alice", "n": 3}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "Q1"}], "user": "bob", "max_tokens": 7}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "Q1"}], "max_completion_tokens": 9}),
    (
        "chat",
        {
            "model": "other",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "add_generation_prompt": True,
        },
    ),
    ("completions", {"model": "m", "prompt": "Once upon a time", "stream": False, "user": "carol"}),
    ("completions", {"model": "m", "prompt": list(range(100, 400)), "max_tokens": 3}),
    ("completions", {"model": "m", "prompt": [list(range(5, 50))], "n": 2.0, "stream": True}),
]


@pytest.mark.parametrize(("kind", "body"), VARIED)
def test_a_body_found_gives_exactly_what_a_fresh_parse_of_its_bytes_gives(
    kind: RequestKind, body: dict[str, Any]
) -> None:
    memo = BodyMemo(64, 1 << 20)
    raw = _raw(body)
    ids = _ids(300)
    _seen_twice(memo, raw, kind, ids)
    found = memo.find(memo.key(raw, kind))
    assert found is not None and memo.hits == 1
    fresh = parse_request(raw, kind)
    assert found.parsed == _slim(fresh)
    for name in ("kind", "model", "stream", "max_tokens", "session_key", "sequences", "stream_usage"):
        assert getattr(found.parsed, name) == getattr(fresh, name), name
    assert found.tokenizer is TOKENIZER and found.token_ids == ids


def test_bodies_that_differ_in_any_byte_or_kind_are_apart() -> None:
    memo = BodyMemo(64, 1 << 20)
    for kind, body in VARIED:
        _seen_twice(memo, _raw(body), kind)
    assert len(memo) == len(VARIED)
    for kind, body in VARIED:
        found = memo.find(memo.key(_raw(body), kind))
        assert found is not None and found.parsed == _slim(parse_request(_raw(body), kind))
    # one more space, or the same bytes as another kind: not found
    kind, body = VARIED[4]
    assert memo.find(memo.key(_raw(body) + b" ", kind)) is None
    assert memo.find(memo.key(_raw(VARIED[-2][1]), "chat")) is None
    assert memo.misses == len(VARIED) + 2  # each first sight, then the two


def test_a_body_is_kept_from_its_second_sight() -> None:
    memo = BodyMemo(8, 1 << 20)
    raw = _raw(VARIED[0][1])
    assert memo.key(raw, "chat") is None and memo.misses == 1  # a first sight: not even digested
    key = memo.key(raw, "chat")
    assert key is not None and memo.find(key) is None and memo.misses == 2
    memo.note(key, parse_request(raw, "chat"), TOKENIZER, _ids(8))
    assert memo.find(memo.key(raw, "chat")) is not None and len(memo) == 1 and memo.hits == 1


def test_a_body_sharing_another_ones_tail_is_still_apart() -> None:
    """Bodies of the same length and last kilobyte differ in their head: the guess sends both to
    the whole digest, which tells them apart."""
    tail = "t" * 2000
    one = _raw({"model": "a", "messages": [{"role": "user", "content": tail}]})
    two = _raw({"model": "b", "messages": [{"role": "user", "content": tail}]})
    assert len(one) == len(two) and one[-1024:] == two[-1024:]
    memo = BodyMemo(8, 1 << 20)
    _seen_twice(memo, one)
    assert memo.find(memo.key(two, "chat")) is None
    _seen_twice(memo, two)
    found = memo.find(memo.key(two, "chat"))
    assert found is not None and found.parsed.model == "b"
    found = memo.find(memo.key(one, "chat"))
    assert found is not None and found.parsed.model == "a"


def test_bounded_in_entries_least_recently_used_out_first() -> None:
    memo = BodyMemo(3, 1 << 20)
    raws = [_raw({"model": "m", "messages": [{"role": "user", "content": f"Q{i}"}]}) for i in range(5)]
    for raw in raws[:3]:
        _seen_twice(memo, raw)
    assert memo.find(memo.key(raws[0], "chat")) is not None  # now the most recently used
    for raw in raws[3:]:
        _seen_twice(memo, raw)
    assert len(memo) == 3 and memo.evictions == 2
    kept = [memo.find(memo.key(raw, "chat")) is not None for raw in raws]
    assert kept == [True, False, False, True, True]
    assert memo.bytes == 3 * (8 * 4 + ENTRY_OVERHEAD_BYTES + len("m"))  # ids, entry, model


def test_bounded_in_bytes_and_a_body_too_large_is_counted_not_kept() -> None:
    per_entry = 100 * 4 + ENTRY_OVERHEAD_BYTES + len("m")
    memo = BodyMemo(100, 2 * per_entry + 10)
    raws = [_raw({"model": "m", "messages": [{"role": "user", "content": f"Q{i}"}]}) for i in range(4)]
    for raw in raws:
        _seen_twice(memo, raw, ids=_ids(100))
    assert len(memo) == 2 and memo.bytes == 2 * per_entry and memo.evictions == 2
    big = _raw({"model": "m", "messages": [{"role": "user", "content": "long"}]})
    _seen_twice(memo, big, ids=_ids(1000))
    assert memo.too_large == 1 and memo.find(memo.key(big, "chat")) is None and len(memo) == 2


def test_a_long_user_string_counts_against_the_bytes() -> None:
    memo = BodyMemo(100, 4 * 8 + ENTRY_OVERHEAD_BYTES + 5_000)
    raw = _raw({"model": "m", "messages": [{"role": "user", "content": "Q"}], "user": "u" * 10_000})
    _seen_twice(memo, raw)
    assert memo.too_large == 1 and len(memo) == 0


def test_the_first_sights_kept_are_bounded_too() -> None:
    memo = BodyMemo(4, 1 << 20)
    for i in range(50):
        raw = _raw({"model": "m", "messages": [{"role": "user", "content": f"Q{i}"}]})
        assert memo.key(raw, "chat") is None
    assert len(memo) == 0 and memo.misses == 50
    assert len(memo._seen) + len(memo._seen_before) <= 8


@pytest.mark.parametrize(("entries", "size"), [(0, 1 << 20), (16, 0)])
def test_zero_turns_it_off(entries: int, size: int) -> None:
    memo = BodyMemo(entries, size)
    assert memo.key(b"{}", "chat") is None and memo.find(None) is None
    memo.note(None, parse_request(_raw(VARIED[0][1]), "chat"), TOKENIZER, _ids(8))
    assert len(memo) == 0 and memo.misses == 0


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        BodyMemo(-1, 10)
    with pytest.raises(ValueError, match="max_bytes"):
        BodyMemo(10, -1)
