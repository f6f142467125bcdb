"""Server-sent events → their ``data:`` payloads, incrementally (pure: bytes in, payloads out; bounded).

The one SSE reader of the project: the gRPC face turns each payload of a replica's stream into one
``GenerateChunk``, and the load tools (``loadtests``) read the balancer's streams with it. It follows
the parts of the WHATWG event-stream rules that OpenAI-style streams use:

* a line ends with CRLF, LF or CR, and may be split anywhere between two chunks (a CR that ends a
  chunk waits for the next byte, which may be its LF);
* a blank line ends an event; its ``data:`` lines are joined with LF, each without the one space
  that may follow the colon (a ``data`` line without a colon is an empty data line);
* a line starting with ``:`` is a comment (keep-alives); other fields (``event:``, ``id:``,
  ``retry:``) are ignored, and an event without a data line yields nothing.

``[DONE]``, OpenAI's end-of-stream marker, is a payload like any other (:data:`DONE`). Memory is
bounded: an event longer than ``max_event_bytes`` before its blank line raises
:class:`~balancer.errors.UpstreamError`, so a peer cannot make the reader buffer without end.
"""

from __future__ import annotations

import re

from balancer.errors import UpstreamError

DONE = b"[DONE]"
"""The payload of OpenAI's last event (``data: [DONE]``)."""
MAX_EVENT_BYTES = 1024 * 1024
"""Default bound of one event (its data lines plus the line being read), in bytes."""

_LINE_END = re.compile(rb"\r\n|\r|\n")


class SseEvents:
    """Splits one event stream into its ``data:`` payloads, whatever the chunking (one per stream)."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buffer = bytearray()
        """Bytes after the last complete line."""
        self._data: list[bytes] | None = None
        """Data lines of the event being read (``None`` before its first)."""
        self._data_bytes = 0
        self._max_event_bytes = max_event_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of the events that ``chunk`` completes, in order."""
        buffer = self._buffer
        buffer += chunk
        payloads: list[bytes] = []
        start = 0
        for end in _LINE_END.finditer(buffer):
            if end.end() == len(buffer) and end.group() == b"\r":
                break  # maybe the first half of a CRLF: decide with the next chunk
            self._line(bytes(buffer[start : end.start()]), payloads)
            start = end.end()
        del buffer[:start]
        if len(buffer) + self._data_bytes > self._max_event_bytes:
            raise UpstreamError(f"an event of the stream exceeds {self._max_event_bytes} bytes")
        return payloads

    def close(self) -> list[bytes]:
        """At the end of the stream: the payload of a last event that lacks its blank line."""
        payloads: list[bytes] = []
        if self._buffer:  # one unfinished line (``feed`` took every finished one), or a lone CR
            self._line(bytes(self._buffer).removesuffix(b"\r"), payloads)
            self._buffer.clear()
        self._line(b"", payloads)
        return payloads

    def _line(self, line: bytes, payloads: list[bytes]) -> None:
        if not line:  # the end of an event
            if self._data is not None:
                payloads.append(b"\n".join(self._data))
            self._data, self._data_bytes = None, 0
            return
        name, colon, value = line.partition(b":")
        if name != b"data":
            return  # a comment (empty name) or a field this reader ignores
        if colon and value.startswith(b" "):
            value = value[1:]
        if self._data is None:
            self._data = []
        self._data.append(value)
        self._data_bytes += len(value) + 1
