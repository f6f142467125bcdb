"""An HTTP/1.1 response parser (pure: bytes in, head and body chunks out, no I/O, no clock).

Frames what a replica answers to one request: the status line and headers (1xx interim responses
skipped), then the body by ``Transfer-Encoding: chunked`` (trailers read and dropped),
``Content-Length`` or, without either, up to the connection's end (with both, the former frames it
and the connection is not reused, RFC 9112 6.3). Header bytes and counts are
bounded; anything malformed or over a bound raises :class:`HttpParseError` (an ``UpstreamError``
with a stable ``reason`` label for metrics). :attr:`ResponseParser.reusable` tells the shell whether
the connection may carry another request: keep-alive, the body read to its end, nothing after it.

Lines end in CRLF (what every HTTP server sends); a bare LF is malformed. The shell in
:mod:`~balancer.upstream.connections` feeds it what the socket delivers, in any chunking.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

from balancer.errors import UpstreamError

ParseErrorReason = Literal["header_overflow", "malformed", "truncated"]
PARSE_ERROR_REASONS: Final[tuple[ParseErrorReason, ...]] = ("header_overflow", "malformed", "truncated")
"""Every :attr:`HttpParseError.reason`."""

_STATUS_RE: Final = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: ([^\r\n]*))?")
_TOKEN_RE: Final = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEX_RE: Final = re.compile(rb"[0-9A-Fa-f]{1,16}")
_CTL_RE: Final = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
"""Control characters a field value may not hold (RFC 9110, 5.5: all but HTAB). aiohttp refuses to
write them, so a relayed ``Content-Type`` holding one failed the client's answer with a 500."""
_CHUNK_LINE_BYTES: Final = 4096
"""Longest chunk-size line (size and extensions)."""
_CRLF: Final = b"\r\n"

# body framings
_NONE: Final = 0
_LENGTH: Final = 1
_CHUNKED: Final = 2
_CLOSE: Final = 3
# states
_HEAD: Final = 0
_BODY: Final = 1  # reading Content-Length or close-delimited bytes
_CHUNK_SIZE: Final = 2
_CHUNK_DATA: Final = 3
_CHUNK_END: Final = 4  # the CRLF after a chunk's data
_TRAILERS: Final = 5
_DONE: Final = 6


class HttpParseError(UpstreamError):
    """The replica's answer is not HTTP/1.1 kvlb can frame; ``reason`` labels it for metrics."""

    def __init__(self, reason: ParseErrorReason, detail: str) -> None:
        super().__init__(f"bad response from replica ({reason}): {detail}")
        self.reason: ParseErrorReason = reason


@dataclass(frozen=True, slots=True)
class ParserLimits:
    """Bounds on what one response may make the parser hold."""

    max_header_bytes: int = 65_536
    """Largest status line plus headers (and, separately, trailers), in bytes; over → ``header_overflow``."""
    max_headers: int = 128
    """Most header (or trailer) fields in one response; over → ``header_overflow``."""


class Headers:
    """Response header fields, looked up case-insensitively; repeated fields joined by ``", "``."""

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[str, str]) -> None:
        self._fields = fields  # lower-case names

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._fields.get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return self._fields[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._fields

    def __len__(self) -> int:
        return len(self._fields)

    def items(self) -> list[tuple[str, str]]:
        return list(self._fields.items())


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """A final (non-1xx) response's status line and headers."""

    version: str
    """``"1.1"`` or ``"1.0"``."""
    status: int
    reason: str
    headers: Headers


class ResponseParser:
    """One response on one connection: :meth:`feed` bytes as they arrive, :meth:`feed_eof` at the end.

    ``feed`` returns the body bytes the data completed, in order (possibly none); :attr:`head` is set
    once the final response's headers are in, :attr:`complete` once the body's end is.
    """

    __slots__ = (
        "_buf",
        "_chunk_left",
        "_framing",
        "_keep_alive",
        "_left",
        "_limits",
        "_state",
        "_trailing",
        "head",
        "received",
    )

    def __init__(self, limits: ParserLimits = ParserLimits()) -> None:
        self._limits = limits
        self._buf = bytearray()
        self._state = _HEAD
        self._framing = _NONE
        self._left = 0  # Content-Length bytes still to come
        self._chunk_left = 0
        self._keep_alive = False
        self._trailing = False
        self.head: ResponseHead | None = None
        self.received = 0
        """Bytes fed so far (0: the peer has said nothing on this request)."""

    @property
    def complete(self) -> bool:
        """The body's end has been read (its last bytes were returned by :meth:`feed`)."""
        return self._state == _DONE

    @property
    def reusable(self) -> bool:
        """The connection may carry another request: keep-alive, body complete, nothing after it."""
        return self._state == _DONE and self._keep_alive and not self._trailing

    def feed(self, data: bytes) -> list[bytes]:
        """Take the next bytes from the connection; return the body bytes they complete."""
        self.received += len(data)
        state = self._state
        if state == _BODY and not self._buf:  # the common case: body bytes, nothing buffered
            return self._body(data)
        if state == _DONE:
            self._trailing = self._trailing or bool(data)
            return []
        self._buf += data
        return self._run()

    def feed_eof(self) -> None:
        """The connection ended: completes a close-delimited body; raises if anything else was cut."""
        if self._state == _DONE:
            return
        if self._state == _BODY and self._framing == _CLOSE:
            self._state = _DONE
            return
        if self._state == _HEAD:
            if not self.received:
                raise HttpParseError("truncated", "the connection closed before any response byte")
            raise HttpParseError("truncated", "the connection closed inside the response headers")
        raise HttpParseError("truncated", "the connection closed before the body's end")

    # --- the state machine ---------------------------------------------------------------

    def _body(self, data: bytes) -> list[bytes]:
        if self._framing == _CLOSE:
            return [data] if data else []
        left = self._left
        if len(data) < left:
            self._left = left - len(data)
            return [data] if data else []
        self._left = 0
        self._state = _DONE
        if len(data) > left:
            self._trailing = True
            data = data[:left]
        return [data] if data else []

    def _run(self) -> list[bytes]:
        out: list[bytes] = []
        buf = self._buf
        while True:
            state = self._state
            if state == _HEAD:
                if not self._parse_head():
                    return out
            elif state == _BODY:
                if buf:
                    data = bytes(buf)
                    buf.clear()
                    out += self._body(data)
                return out
            elif state == _CHUNK_SIZE:
                end = buf.find(_CRLF)
                if end < 0:
                    if len(buf) > _CHUNK_LINE_BYTES:
                        raise HttpParseError("header_overflow", "chunk-size line too long")
                    return out
                if end > _CHUNK_LINE_BYTES:
                    raise HttpParseError("header_overflow", "chunk-size line too long")
                line = bytes(buf[:end]).split(b";", 1)[0].strip(b" \t")
                del buf[: end + 2]
                if not _HEX_RE.fullmatch(line):
                    raise HttpParseError("malformed", f"bad chunk size {line[:40]!r}")
                size = int(line, 16)
                if size == 0:
                    self._state = _TRAILERS
                else:
                    self._chunk_left = size
                    self._state = _CHUNK_DATA
            elif state == _CHUNK_DATA:
                if not buf:
                    return out
                take = min(self._chunk_left, len(buf))
                out.append(bytes(buf[:take]))
                del buf[:take]
                self._chunk_left -= take
                if self._chunk_left == 0:
                    self._state = _CHUNK_END
            elif state == _CHUNK_END:
                if len(buf) < 2:
                    if buf and buf[0:1] != b"\r":
                        raise HttpParseError("malformed", "chunk data not followed by CRLF")
                    return out
                if buf[:2] != _CRLF:
                    raise HttpParseError("malformed", "chunk data not followed by CRLF")
                del buf[:2]
                self._state = _CHUNK_SIZE
            elif state == _TRAILERS:
                if buf[:2] == _CRLF:
                    del buf[:2]
                    self._finish_buffered()
                    return out
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > self._limits.max_header_bytes:
                        raise HttpParseError("header_overflow", "trailers too large")
                    return out
                if end + 4 > self._limits.max_header_bytes:
                    raise HttpParseError("header_overflow", "trailers too large")
                self._fields(bytes(buf[:end]).split(_CRLF))  # checked, then dropped
                del buf[: end + 4]
                self._finish_buffered()
                return out
            else:  # _DONE
                self._finish_buffered()
                return out

    def _finish_buffered(self) -> None:
        self._state = _DONE
        if self._buf:
            self._trailing = True
            self._buf.clear()

    def _parse_head(self) -> bool:
        """Parse one head from the buffer; False when it is not all in yet."""
        buf = self._buf
        limit = self._limits.max_header_bytes
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > limit:
                raise HttpParseError("header_overflow", f"response headers over {limit} bytes")
            if buf[:1] and not b"HTTP/1."[: len(buf)].startswith(bytes(buf[:7])):
                raise HttpParseError("malformed", f"not an HTTP/1 status line: {bytes(buf[:40])!r}")
            return False
        if end + 4 > limit:
            raise HttpParseError("header_overflow", f"response headers over {limit} bytes")
        lines = bytes(buf[:end]).split(_CRLF)
        del buf[: end + 4]
        match = _STATUS_RE.fullmatch(lines[0])
        if match is None:
            raise HttpParseError("malformed", f"bad status line {lines[0][:80]!r}")
        minor, code, reason = match.groups()
        status = int(code)
        if not 100 <= status <= 599:  # RFC 9110, 15: invalid, to be taken as a server error
            raise HttpParseError("malformed", f"status {status} outside 100..599")
        fields = self._fields(lines[1:])
        if status < 200:
            if status == 101:
                raise HttpParseError("malformed", "unexpected 101 Switching Protocols")
            return True  # an interim response: the final one follows
        headers = Headers(fields)
        version = "1.1" if minor == b"1" else "1.0"
        self.head = ResponseHead(version, status, (reason or b"").decode("latin-1"), headers)
        connection = {t.strip().lower() for t in fields.get("connection", "").split(",")}
        self._keep_alive = version == "1.1" and "close" not in connection
        self._frame(status, fields)
        return True

    def _frame(self, status: int, fields: dict[str, str]) -> None:
        coding = fields.get("transfer-encoding")
        length = fields.get("content-length")
        if status in (204, 304):
            self._framing = _NONE
            self._state = _DONE
        elif coding is not None:
            if coding.strip().lower() != "chunked":
                raise HttpParseError("malformed", f"unsupported Transfer-Encoding {coding[:40]!r}")
            if length is not None:
                # RFC 9112, 6.3: Transfer-Encoding frames the body, and the connection must be
                # closed after it: a peer that sends both may be smuggling a second answer.
                self._keep_alive = False
            self._framing = _CHUNKED
            self._state = _CHUNK_SIZE
        elif length is not None:
            values = {v.strip() for v in length.split(",")}
            value = values.pop() if len(values) == 1 else ""
            if not value.isdigit() or not value.isascii() or len(value) > 18:
                raise HttpParseError("malformed", f"bad Content-Length {length[:40]!r}")
            self._framing = _LENGTH
            self._left = int(value)
            self._state = _DONE if self._left == 0 else _BODY
        else:
            self._framing = _CLOSE
            self._keep_alive = False
            self._state = _BODY

    def _fields(self, lines: list[bytes]) -> dict[str, str]:
        if len(lines) > self._limits.max_headers:
            raise HttpParseError("header_overflow", f"more than {self._limits.max_headers} header fields")
        fields: dict[str, str] = {}
        for line in lines:
            name, sep, value = line.partition(b":")
            if not sep or not _TOKEN_RE.fullmatch(name):
                raise HttpParseError("malformed", f"bad header line {line[:80]!r}")
            if _CTL_RE.search(value) is not None:
                raise HttpParseError("malformed", f"bad header value in {line[:80]!r}")
            key = name.decode("ascii").lower()
            text = value.strip(b" \t").decode("latin-1")
            fields[key] = f"{fields[key]}, {text}" if key in fields else text
        return fields
