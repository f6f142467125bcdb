"""The estimates of what a parse costs, from the bytes before it runs (:mod:`balancer.api.parse_cost`):
the bound on a JSON document's values and keys is never below their count (hypothesis, UTF-8 and
UTF-16), the JSON estimate is above what ``tracemalloc`` sees of ``parse_request`` on the worst
shapes, the gRPC estimate above what the parsed message keeps, a scan of protobuf fields that gives
up on what is not a message, and the look for lone surrogates that no longer costs a path string an
item (no I/O)."""

from __future__ import annotations

import contextlib
import gc
import json
import tracemalloc
from typing import Any

import pytest
from fuzz_examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.errors import ApiError
from balancer.api.parse_cost import (
    PARSE_HOLD_MIN_BYTES,
    PROTOBUF_PARSE_BYTES_PER_BYTE,
    chat_convert_bytes,
    json_parse_bytes,
    json_values_bound,
    length_delimited_fields,
    parsed_message_bytes,
    protobuf_parse_bytes,
)
from balancer.api.parsing import holds_lone_surrogate, lone_surrogate_at, parse_request

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=40,
)


def values_and_keys(value: Any) -> int:
    """How many values (the document itself included) and keys ``value`` holds."""
    count, pending = 0, [value]
    while pending:
        item = pending.pop()
        count += 1
        if isinstance(item, dict):
            count += len(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return count


@settings(max_examples=examples(300), deadline=None)
@given(JSON_VALUES, st.booleans(), st.sampled_from(["utf-8", "utf-16", "utf-32"]))
def test_the_values_bound_is_never_below_the_values_and_keys(
    value: Any, compact: bool, encoding: str
) -> None:
    separators = (",", ":") if compact else (", ", ": ")
    text = json.dumps(value, separators=separators, ensure_ascii=False)
    raw = text.encode(encoding, "surrogatepass")
    assert json_values_bound(raw) >= values_and_keys(value)
    assert json_values_bound(text) == json_values_bound(text.encode("utf-8", "surrogatepass"))


def test_commas_and_colons_in_text_are_counted_so_the_bound_stays_above() -> None:
    raw = json.dumps({"model": "m", "prompt": ", : [ " * 10}).encode()
    assert json_values_bound(raw) == 1 + 10 + 10 + 1 + 2 * (10 + 2)
    # 5 "[", 3 "[]" (one in a string), 2 ",", 1 ":": the 7 values and keys exactly
    assert json_values_bound(b'[[], [[]], {"a": "[]"}]') == 1 + 5 - 3 + 2 + 2 * 1 == 7


def test_a_small_body_costs_nothing_to_estimate() -> None:
    small = b'{"x": [' + b",".join([b"{}"] * 1000) + b"]}"
    assert len(small) < PARSE_HOLD_MIN_BYTES and json_parse_bytes(small) == 0
    assert protobuf_parse_bytes(b"\x0a\x00" * 1000, "generate") == 0
    assert chat_convert_bytes(PARSE_HOLD_MIN_BYTES - 1, 100_000, "") == 0


def _traced_peak(raw: bytes, kind: str) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        with contextlib.suppress(ApiError):
            parse_request(raw, kind)  # type: ignore[arg-type]
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


def _objects(count: int, head: str = '"messages": [{"role": "user", "content": "x"}]') -> str:
    return '{"model": "m", ' + head + ', "x": [' + ",".join(["{}"] * count) + "]}"


WORST = {
    "empty objects, untyped": ("chat", _objects(200_000).encode()),
    "empty arrays, untyped": ("chat", _objects(200_000).replace("{},", "[],").encode()),
    "empty objects and a lone surrogate (stdlib, walked)": (
        "chat",
        _objects(200_000, '"messages": [{"role": "user", "content": "\\ud800"}]').encode(),
    ),
    "empty objects in UTF-16 (stdlib)": ("completions", _objects(100_000, '"prompt": "x"').encode("utf-16")),
    "empty objects in UTF-32 (stdlib)": ("completions", _objects(50_000, '"prompt": "x"').encode("utf-32")),
    "distinct keys": (
        "chat",
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "x": {'
        + b",".join(b'"%d":0' % i for i in range(60_000))
        + b"}}",
    ),
    "one-letter messages": (
        "chat",
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}] * 20_000}).encode(),
    ),
    "one string of CJK in UTF-16": (
        "chat",
        json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "\u4e00" * 200_000}]}, ensure_ascii=False
        ).encode("utf-16"),
    ),
    "one string of ASCII": (
        "chat",
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "a" * 600_000}]}).encode(),
    ),
}


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() walks only what it made
@pytest.mark.parametrize("name", sorted(WORST))
def test_the_json_estimate_is_above_what_the_parse_costs(name: str) -> None:
    kind, raw = WORST[name]
    assert len(raw) >= PARSE_HOLD_MIN_BYTES
    peak = _traced_peak(raw, kind)
    estimate = json_parse_bytes(raw)
    assert peak <= estimate <= max(12 * peak, 4 * len(raw)), (peak, estimate)


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() walks only what it made
def test_the_look_for_lone_surrogates_builds_no_path_per_item() -> None:
    """A UTF-16 body is walked for lone surrogates: that walk made a path string and a tuple for every
    item (1.4 M empty objects: 274 MB, 33 times the body); it now only looks, then names the place."""
    kind, raw = WORST["empty objects in UTF-16 (stdlib)"]
    assert _traced_peak(raw, kind) < 15 * len(raw)
    assert lone_surrogate_at({"a": [{}, {"b": ["ok", "\ud800"]}]}) == "'a[1].b[1]'"
    assert lone_surrogate_at({"a": [{}, {"\udfff": 1}]}) == "a key of 'a[1]'"
    assert lone_surrogate_at({"a": [{}, {"b": ["ok", "\u4e00"]}]}) is None


class Untouchable(list[Any]):
    """A decoded array that must not be looked into."""

    def __iter__(self) -> Any:
        raise AssertionError("walked past the lone surrogate")

    def __reversed__(self) -> Any:
        raise AssertionError("walked past the lone surrogate")


def test_the_look_for_lone_surrogates_goes_in_document_order() -> None:
    """It stops at the first one, before listing what comes after it (a body of a chat with one,
    then 2.8 M empty objects, listed them all first: 974 ms where the path walk alone took 246)."""
    assert holds_lone_surrogate({"messages": [{"content": "\ud800"}], "x": Untouchable([{}])})
    assert not holds_lone_surrogate({"messages": [{"content": "ok"}], "x": [[], {"\u4e00": "\u4e00"}]})


def _generate(**fields: Any) -> bytes:
    return pb.GenerateRequest(model="m", **fields).SerializeToString()


def test_the_scan_reads_the_top_level_fields_and_gives_up_on_what_is_not_a_message() -> None:
    raw = _generate(prompt_text="hello", max_tokens=3, extra_json="{}")
    fields = length_delimited_fields(raw, 0, len(raw))
    assert fields is not None
    assert [(number, raw[first:last]) for number, first, last in fields] == [
        (1, b"m"),
        (4, b"hello"),
        (9, b"{}"),
    ]
    assert length_delimited_fields(b"\x0a\x05ab", 0, 4) is None  # a field past the end
    assert length_delimited_fields(b"\x0b\x0c", 0, 2) is None  # a group
    assert length_delimited_fields(b"\x08" + b"\xff" * 11, 0, 12) is None  # a varint too long
    many = b"\x28\x01" * (PARSE_HOLD_MIN_BYTES // 2)  # max_tokens, over and over: too many fields to scan
    assert protobuf_parse_bytes(many, "generate") == PROTOBUF_PARSE_BYTES_PER_BYTE * len(many)


def _padded(raw: bytes, size: int) -> bytes:
    pad = size - len(raw) - 5
    return raw + b"\xc2\x3e" + bytes([0x80 | pad & 0x7F, 0x80 | pad >> 7 & 0x7F, pad >> 14]) + b"x" * pad


SIZE = PARSE_HOLD_MIN_BYTES + 1000
MESSAGES = {
    "empty chat messages": pb.GenerateRequest(
        model="m", chat_messages=pb.ChatMessages(messages=[pb.ChatMessage()] * (SIZE // 2))
    ),
    "one-byte token ids": pb.GenerateRequest(model="m", prompt_token_ids=pb.TokenIds(ids=[1] * SIZE)),
    "a text prompt": pb.GenerateRequest(model="m", prompt_text="a" * SIZE),
    "chat messages of text": pb.GenerateRequest(
        model="m",
        chat_messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="ab")] * (SIZE // 11)),
    ),
}


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_the_protobuf_estimate_covers_what_the_parsed_message_keeps(name: str) -> None:
    request = MESSAGES[name]
    raw = request.SerializeToString()
    parsed = pb.GenerateRequest.FromString(raw)
    chats = len(parsed.chat_messages.messages)
    ids = len(parsed.prompt_token_ids.ids)
    kept = parsed_message_bytes(len(raw), chats, ids)
    assert kept <= protobuf_parse_bytes(raw, "generate") <= PROTOBUF_PARSE_BYTES_PER_BYTE * len(raw)
    route = pb.RouteRequest(request=request, reserve=True).SerializeToString()
    assert protobuf_parse_bytes(route, "route") >= parsed_message_bytes(len(route), chats, ids)
    if chats or ids:  # a plain message's estimate is its bytes: the chat messages and ids are Generate's
        assert protobuf_parse_bytes(raw, "plain") < kept


def test_unknown_fields_cost_their_bytes_once() -> None:
    raw = _padded(_generate(prompt_token_ids=pb.TokenIds(ids=[1, 2, 3])), 2 * PARSE_HOLD_MIN_BYTES)
    assert pb.GenerateRequest.FromString(raw).prompt_token_ids.ids == [1, 2, 3]
    assert protobuf_parse_bytes(raw, "generate") == len(raw) + 8 * 5  # TokenIds: 0a 03 01 02 03
