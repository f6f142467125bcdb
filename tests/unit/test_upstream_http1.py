"""The HTTP/1.1 response parser: framings, 1xx, bounds, malformed input, connection reuse, and a
property test against h11 (an independent parser) over arbitrary responses and chunkings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.errors import UpstreamError
from balancer.upstream.http1 import HttpParseError, ParserLimits, ResponseParser


def parse(data: bytes, cuts: list[int] | None = None, eof: bool = False) -> tuple[ResponseParser, bytes]:
    parser = ResponseParser()
    body = bytearray()
    points = sorted({c for c in (cuts or []) if 0 < c < len(data)})
    for start, end in zip([0, *points], [*points, len(data)], strict=True):
        for chunk in parser.feed(data[start:end]):
            body += chunk
    if eof:
        parser.feed_eof()
    return parser, bytes(body)


def test_content_length_body_and_headers_looked_up_case_insensitively() -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello"
    parser, body = parse(raw)
    assert parser.head is not None
    assert (parser.head.status, parser.head.reason, parser.head.version) == (200, "OK", "1.1")
    assert parser.head.headers.get("content-type") == "text/plain"
    assert parser.head.headers["CONTENT-TYPE"] == "text/plain"
    assert parser.head.headers.get("x-a") == "1, 2"
    assert body == b"hello" and parser.complete and parser.reusable


def test_chunked_body_with_extensions_and_trailers() -> None:
    raw = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n1A\r\n" + b"x" * 26 + b"\r\n0\r\nX-Trailer: yes\r\n\r\n"
    )
    for cut in range(len(raw)):
        parser, body = parse(raw, [cut])
        assert body == b"hello" + b"x" * 26
        assert parser.complete and parser.reusable


def test_close_delimited_body_ends_at_eof_and_is_not_reusable() -> None:
    parser, body = parse(b"HTTP/1.1 200 OK\r\n\r\nsome body", eof=False)
    assert body == b"some body" and not parser.complete
    parser.feed_eof()
    assert parser.complete and not parser.reusable


def test_interim_responses_are_skipped() -> None:
    raw = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\nHTTP/1.1 201 Created\r\n"
    raw += b"Content-Length: 2\r\n\r\nok"
    parser, body = parse(raw, [3, 30])
    assert parser.head is not None and parser.head.status == 201 and body == b"ok"


def test_connection_close_http_1_0_and_trailing_bytes_forbid_reuse() -> None:
    assert not parse(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")[0].reusable
    assert not parse(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")[0].reusable
    parser, body = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA")
    assert body == b"ok" and parser.complete and not parser.reusable
    assert parse(b"HTTP/1.1 204 No Content\r\n\r\n")[0].reusable


def test_an_answer_with_both_transfer_encoding_and_content_length_is_not_reused() -> None:
    """RFC 9112, 6.3: the body is framed by ``Transfer-Encoding`` and the connection is closed
    after it (the ``Content-Length`` may be a smuggling attempt)."""
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    parser, body = parse(raw)
    assert body == b"hello" and parser.complete and not parser.reusable


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"HTTP/1.1 2000 OK\r\n\r\n", "malformed"),
        (b"HTTP/1.1 999 Weird\r\nContent-Length: 2\r\n\r\nok", "malformed"),  # RFC 9110, 15
        (b"HTTP/1.1 600 X\r\n\r\n", "malformed"),
        (b"HTTP/1.1 099 X\r\n\r\nHTTP/1.1 200 OK\r\n\r\n", "malformed"),  # not an interim 1xx
        (b"SPDY/3 200 OK\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\nBad Header: x\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n", "malformed"),
        # control characters in a value (RFC 9110, 5.5): aiohttp will not write them to the client
        (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; x=\x0bq\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\x7f\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\nX: a\x1bb\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\nX: a\x00b\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n", "malformed"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: " + b"a" * 70_000, "header_overflow"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 200 + b"\r\n", "header_overflow"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 5000, "header_overflow"),
    ],
)
def test_malformed_or_oversized_input_is_a_clear_upstream_error(raw: bytes, reason: str) -> None:
    with pytest.raises(HttpParseError) as info:
        parse(raw)
    assert info.value.reason == reason
    assert isinstance(info.value, UpstreamError)
    assert f"({reason})" in str(info.value)


def test_header_bounds_come_from_the_limits() -> None:
    parser = ResponseParser(ParserLimits(max_header_bytes=64, max_headers=2))
    with pytest.raises(HttpParseError, match="header_overflow"):
        parser.feed(b"HTTP/1.1 200 OK\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n")
    with pytest.raises(HttpParseError, match="header_overflow"):
        ResponseParser(ParserLimits(max_header_bytes=64)).feed(b"HTTP/1.1 200 OK\r\nA: " + b"1" * 80)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"HTTP/1.1 200 OK\r\nContent-Le",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
    ],
)
def test_eof_before_the_end_is_truncated(raw: bytes) -> None:
    parser = ResponseParser()
    parser.feed(raw)
    with pytest.raises(HttpParseError, match="truncated"):
        parser.feed_eof()
    assert parser.received == len(raw)


# --- property test against h11 ---------------------------------------------------------------

h11 = pytest.importorskip("h11")

_names = st.sampled_from(["X-Thing", "content-type", "Server", "x-request-id", "Via", "cache-control"])
_values = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=0, max_size=12)


@st.composite
def responses(draw: st.DrawFn) -> tuple[bytes, int, list[tuple[str, str]], bytes, str, bool]:
    status = draw(st.sampled_from([200, 201, 400, 404, 429, 500, 503]))
    fields = draw(st.lists(st.tuples(_names, _values), max_size=6))
    body = draw(st.binary(max_size=300))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    close = draw(st.booleans())
    interim = draw(st.integers(0, 2))
    head = b"".join(b"HTTP/1.1 100 Continue\r\n\r\n" for _ in range(interim))
    head += f"HTTP/1.1 {status} Whatever Reason\r\n".encode()
    for name, value in fields:
        head += f"{name}: {value}\r\n".encode()
    if close:
        head += b"Connection: close\r\n"
    if framing == "length":
        raw = head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    elif framing == "chunked":
        sizes = draw(st.lists(st.integers(1, 64), max_size=8))
        pieces, at = [], 0
        for size in sizes:
            piece = body[at : at + size]
            if piece:
                pieces.append(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            at += size
        if at < len(body):
            pieces.append(f"{len(body) - at:x}\r\n".encode() + body[at:] + b"\r\n")
        trailer = b"X-Checksum: abc\r\n" if draw(st.booleans()) else b""
        raw = head + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(pieces) + b"0\r\n" + trailer + b"\r\n"
    else:
        raw = head + b"\r\n" + body
    return raw, status, fields, body, framing, close


def _h11_parse(raw: bytes, cuts: list[int]) -> tuple[int, dict[str, str], bytes, bool]:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")]))
    conn.send(h11.EndOfMessage())
    points = sorted({c for c in cuts if 0 < c < len(raw)})
    status, headers, body, keep = 0, {}, bytearray(), False
    for start, end in zip([0, *points, len(raw)], [*points, len(raw), None], strict=True):
        conn.receive_data(raw[start:end] if end is not None else b"")
        while True:
            event = conn.next_event()
            if event in (h11.NEED_DATA, h11.PAUSED) or isinstance(event, h11.ConnectionClosed):
                break
            if isinstance(event, h11.Response):
                status = event.status_code
                for name, value in event.headers:
                    key = name.decode()
                    headers[key] = f"{headers[key]}, {value.decode()}" if key in headers else value.decode()
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                keep = conn.our_state is h11.DONE and conn.their_state is h11.DONE
    return status, headers, bytes(body), keep


@settings(max_examples=300, deadline=None)
@given(responses(), st.lists(st.integers(0, 2000), max_size=12))
def test_the_parser_agrees_with_h11_over_any_chunking(
    case: tuple[bytes, int, list[tuple[str, str]], bytes, str, bool], cuts: list[int]
) -> None:
    raw, status, _, body, framing, _ = case
    parser, got = parse(raw, cuts, eof=framing == "close")
    want_status, want_headers, want_body, want_reusable = _h11_parse(raw, cuts)
    assert parser.head is not None
    assert parser.head.status == want_status == status
    assert {name: parser.head.headers[name] for name in want_headers} == {
        name: value for name, value in want_headers.items()
    }
    assert len(parser.head.headers) == len(want_headers)
    assert got == want_body == body
    assert parser.complete
    # h11 reports a close-delimited body's end as DONE; the connection ended with it all the same
    assert parser.reusable == (want_reusable and framing != "close")


_pieces = st.sampled_from(
    [
        b"HTTP/1.1 200 OK\r\n",
        b"HTTP/1.0 100 x\r\n",
        b"Content-Length: 3\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"\r\n",
        b"3\r\nabc\r\n",
        b"0\r\n",
        b"X: y\r\n",
        b"ff;e\r\n",
        b"\n",
        b":",
        b" ",
        b"abc",
        b"\x00\xff",
    ]
)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.one_of(_pieces, st.binary(max_size=8)), max_size=16),
    st.lists(st.integers(0, 200)),
    st.booleans(),
)
def test_any_input_gives_a_response_or_a_parse_error_only(
    pieces: list[bytes], cuts: list[int], eof: bool
) -> None:
    """Whatever the bytes, the parser frames them or raises HttpParseError, never anything else."""
    raw = b"".join(pieces)
    try:
        parser, body = parse(raw, cuts, eof=eof)
    except HttpParseError:
        return
    head = parser.head
    if parser.complete and head is not None and "transfer-encoding" not in head.headers:
        framed = head.headers.get("content-length") == "3" and head.status not in (204, 304)
        assert len(body) == 3 or not framed
