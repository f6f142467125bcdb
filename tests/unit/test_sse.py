"""The SSE ``data:`` parser (balancer/upstream/sse.py): line ends, comments, multi-line data, chunking,
``[DONE]``, the end of a stream and the bound on one event."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from balancer.errors import UpstreamError
from balancer.upstream.sse import DONE, SseEvents

STREAM = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}\n\n'
    b": keep-alive comment\n\n"
    b'data: {"choices":[{"index":0,"delta":{"content":" there"},"finish_reason":"stop"}]}\r\n\r\n'
    b"event: note\rid: 7\rdata:first\rdata:  second\r\r"
    b"retry: 100\n\n"
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9,'
    b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
    b"data: [DONE]\n\n"
)
PAYLOADS = [
    b'{"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}',
    b'{"choices":[{"index":0,"delta":{"content":" there"},"finish_reason":"stop"}]}',
    b"first\n second",
    b'{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9,'
    b'"prompt_tokens_details":{"cached_tokens":4}}}',
    DONE,
]


def test_each_event_yields_its_data_once_and_nothing_else() -> None:
    events = SseEvents()
    assert events.feed(STREAM) == PAYLOADS
    assert events.close() == []


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_sse_splitting_does_not_depend_on_how_the_bytes_are_chunked(cuts: list[int]) -> None:
    whole = SseEvents().feed(STREAM)
    events = SseEvents()
    bounds = [0, *sorted(cuts), len(STREAM)]
    pieces = [STREAM[a:b] for a, b in itertools.pairwise(bounds)]
    assert [p for piece in pieces for p in events.feed(piece)] + events.close() == whole


def test_one_byte_at_a_time() -> None:
    events = SseEvents()
    assert [p for i in range(len(STREAM)) for p in events.feed(STREAM[i : i + 1])] == PAYLOADS


def test_crlf_split_between_chunks_is_one_line_end() -> None:
    events = SseEvents()
    assert events.feed(b"data: a\r") == []
    assert events.feed(b"\n") == []  # the LF completes the CRLF: no blank line yet
    assert events.feed(b"\r\n") == [b"a"]
    assert events.feed(b"data: b\r") == []
    assert events.feed(b"\rdata: c\n\n") == [b"b", b"c"]  # CR alone ends a line too


def test_comments_other_fields_and_events_without_data_yield_nothing() -> None:
    events = SseEvents()
    assert events.feed(b": ping\n\n:\n\nevent: update\nid: 1\nretry: 5\n\n") == []
    assert events.feed(b"event: update\ndata: x\nid: 2\n\n") == [b"x"]


def test_multi_line_data_joins_with_lf_and_drops_one_space() -> None:
    events = SseEvents()
    assert events.feed(b'data: {\ndata:  "a": 1\ndata:}\n\n') == [b'{\n "a": 1\n}']
    assert events.feed(b"data\n\n") == [b""]  # a data line without a colon: empty data
    assert events.feed(b"data:\ndata:\n\n") == [b"\n"]
    assert events.feed(b"datum: x\nDATA: y\n\n") == []  # field names are exact


def test_done_is_a_payload_like_any_other() -> None:
    events = SseEvents()
    assert events.feed(b"data: [DONE]\n\n") == [DONE] == [b"[DONE]"]
    assert events.feed(b'data: {"after": "done"}\n\n') == [b'{"after": "done"}']


def test_close_returns_a_last_event_without_its_blank_line() -> None:
    events = SseEvents()
    assert events.feed(b"data: x\n\ndata: tail") == [b"x"]
    assert events.close() == [b"tail"]
    carriage = SseEvents()
    assert carriage.feed(b"data: y\r") == []
    assert carriage.close() == [b"y"]
    assert SseEvents().close() == []
    pending = SseEvents()
    assert pending.feed(b"data: one\ndata: two\n") == []
    assert pending.close() == [b"one\ntwo"]


def test_an_endless_event_is_refused() -> None:
    events = SseEvents(max_event_bytes=64)
    assert events.feed(b"data: " + b"x" * 50) == []
    with pytest.raises(UpstreamError):
        events.feed(b"y" * 20)


def test_the_bound_counts_an_events_data_lines_and_resets_after_it() -> None:
    lines = SseEvents(max_event_bytes=64)
    with pytest.raises(UpstreamError):
        for _ in range(20):
            lines.feed(b"data: 12345\n")  # no blank line: the event grows
    events = SseEvents(max_event_bytes=64)
    for _ in range(100):
        assert events.feed(b"data: 12345\ndata: 67890\n\n") == [b"12345\n67890"]
