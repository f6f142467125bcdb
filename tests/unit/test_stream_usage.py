"""Usage asked on every stream and taken back out (pure): the request's rewrite and the answer's
filter, on the event shapes of vLLM, SGLang and TensorRT-LLM (their ``serving_chat.py`` and
``postprocess_handlers.py``: a last event with ``"choices":[]`` and a ``usage`` object)."""

from __future__ import annotations

import itertools
import json
import re
import tracemalloc

import pytest

from balancer.api.parsing import parse_request
from balancer.upstream.stream_usage import UsageStrip, event_ends, stream_usage_of, with_stream_usage

USAGE = (
    b'{"prompt_tokens":9,"total_tokens":11,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}'
)
HEAD = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'
VLLM_CHUNK = HEAD + b'"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
VLLM_USAGE = HEAD + b'"choices":[],"usage":' + USAGE + b"}\n\n"
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"stream": True}, "missing"),
        ({"stream": True, "stream_options": None}, "merge"),
        ({"stream": True, "stream_options": {"include_usage": True}}, "asked"),
        ({"stream": True, "stream_options": {"include_usage": False}}, "merge"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "merge"),
        ({"stream": True, "stream_options": "yes"}, "leave"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "leave"),
        ({"stream": False}, "asked"),
        ({}, "asked"),
    ],
)
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_request_says_what_it_asked(body: dict[str, object], expected: str, kind: str) -> None:
    prompt: dict[str, object] = (
        {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": [1, 2, 3]}
    )
    raw = json.dumps({"model": "m", **prompt, **body}).encode()
    assert parse_request(raw, kind).stream_usage == expected  # type: ignore[arg-type]
    assert (
        stream_usage_of(bool(body.get("stream")), body.get("stream_options"), "stream_options" in body)
        == expected
    )


def test_a_body_without_options_gets_them_before_its_brace_and_nothing_else_changes() -> None:
    raw = b'{"model": "m", "prompt": "x \\u00e9", "stream": true}\n'
    out = with_stream_usage(raw, "missing")
    assert (
        out
        == b'{"model": "m", "prompt": "x \\u00e9", "stream": true,"stream_options":{"include_usage":true}}\n'
    )
    assert json.loads(out)["stream_options"] == {"include_usage": True}


def test_writing_the_option_in_copies_the_body_once() -> None:
    """The body is copied into the new one, not sliced first: a 4 MB body peaks at one new copy."""
    raw = b'{"model": "m", "stream": true, "prompt": "' + b"x" * 4_000_000 + b'"}'
    tracemalloc.start()
    try:
        out = with_stream_usage(raw, "missing")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out is not None and out.endswith(b',"stream_options":{"include_usage":true}}')
    assert peak < 1.5 * len(raw)  # a slice of the head, then the join: 2 copies (8 MB)


def test_a_body_with_other_options_keeps_them() -> None:
    raw = json.dumps(
        {"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    ).encode()
    out = with_stream_usage(raw, "merge")
    assert out is not None
    assert json.loads(out)["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert with_stream_usage(raw, "asked") is None and with_stream_usage(raw, "leave") is None
    null = json.dumps({"model": "m", "stream": True, "stream_options": None}).encode()
    assert json.loads(with_stream_usage(null, "merge") or b"")["stream_options"] == {"include_usage": True}


def test_the_usage_event_goes_and_everything_else_is_the_same_bytes() -> None:
    strip = UsageStrip("absent")
    chunk = VLLM_CHUNK
    assert strip.feed(chunk) is chunk  # no usage: the chunk itself, no copy
    assert strip.feed(VLLM_USAGE) == b""
    assert strip.feed(DONE) == DONE
    assert strip.close() == b"" and strip.dropped_events == 1


def test_events_split_anywhere_come_out_whole_and_filtered() -> None:
    stream = VLLM_CHUNK + VLLM_CHUNK + VLLM_USAGE + DONE
    for size in (1, 2, 7, 50, 333):
        strip = UsageStrip("absent")
        out = b"".join(strip.feed(stream[i : i + size]) for i in range(0, len(stream), size)) + strip.close()
        assert out == VLLM_CHUNK + VLLM_CHUNK + DONE, size


def test_crlf_events_and_a_last_event_without_its_blank_line() -> None:
    strip = UsageStrip("absent")
    crlf = VLLM_USAGE.replace(b"\n\n", b"\r\n\r\n")
    assert strip.feed(VLLM_CHUNK.replace(b"\n\n", b"\r\n\r\n") + crlf) == VLLM_CHUNK.replace(
        b"\n\n", b"\r\n\r\n"
    )
    assert strip.feed(VLLM_USAGE.rstrip()) == b""
    assert strip.close() == b"" and strip.dropped_events == 2


def test_continuous_usage_is_taken_out_as_the_engine_writes_a_chunk_without_it() -> None:
    # vLLM / TensorRT-LLM: no member; SGLang: "usage":null
    with_usage = VLLM_CHUNK.replace(b"]}\n\n", b'],"usage":' + USAGE + b"}\n\n")
    assert UsageStrip("absent").feed(with_usage) == VLLM_CHUNK
    first = VLLM_CHUNK.replace(b'{"id":"c1",', b'{"usage":' + USAGE + b',"id":"c1",')
    assert UsageStrip("absent").feed(first) == VLLM_CHUNK
    sglang = VLLM_CHUNK.replace(b"]}\n\n", b'],"usage":null}\n\n')
    sglang_with = VLLM_CHUNK.replace(b"]}\n\n", b'],"usage":' + USAGE + b"}\n\n")
    strip = UsageStrip("null")
    assert strip.feed(sglang) is sglang  # a null usage is what the engine writes anyway
    assert strip.feed(sglang_with) == sglang
    assert strip.feed(VLLM_USAGE.replace(b"}\n\n", b',"system_fingerprint":null}\n\n')) == b""


def test_text_that_looks_like_usage_is_left_alone() -> None:
    text = b'data: {"choices":[{"index":0,"text":"\\"usage\\":{\\"choices\\":[]}"}]}\n\n'
    assert UsageStrip("absent").feed(text) == text


def test_an_event_past_the_bound_passes_unfiltered() -> None:
    strip = UsageStrip("absent", max_event_bytes=100)
    big = b"data: " + b"x" * 200
    assert strip.feed(big) == big
    assert strip.unfiltered_events == 1
    assert strip.feed(b"\n\n") == b"\n\n"


_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def _regex_ends(data: bytes) -> list[int]:
    """The events' ends as the usage filter found them with a regex before ``event_ends``."""
    ends = []
    for end in _EVENT_END.finditer(data):
        if end.end() == len(data) and end.group() == b"\r\r":
            break  # maybe the start of a CRLF CRLF
        ends.append(end.end())
    return ends


def test_event_ends_are_where_the_blank_line_regex_ends_them() -> None:
    """Every text of up to 8 bytes of CR, LF and a letter (and a bytearray of it): the same ends as
    ``finditer`` of ``\\r\\n\\r\\n|\\n\\n|\\r\\r``, a trailing CR CR left for the next chunk."""
    for size in range(9):
        for text in itertools.product(b"\r\na", repeat=size):
            data = bytes(text)
            assert event_ends(data) == _regex_ends(data), data
            assert event_ends(bytearray(data)) == _regex_ends(data), data
