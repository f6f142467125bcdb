"""Usage on every stream (pure: bytes in, bytes out; bounded): what kvlb adds to a streaming request
so that its engine reports ``usage`` (and with it ``prompt_tokens_details.cached_tokens``, the
receipt :meth:`~balancer.routing.router.PoolRouter.settle_receipt` reads), and what it takes back
out of the answer so that a client that did not ask for usage sees what its engine would have sent.

**The request** (:func:`stream_usage_of`, :func:`with_stream_usage`): a streaming request whose
``stream_options.include_usage`` is not ``true`` gets it. A body without ``stream_options`` has
``"stream_options":{"include_usage":true}`` written before its closing brace (one copy of the body,
no slice of it, no JSON round trip); a body whose ``stream_options`` is an object without
``include_usage: true`` (``{"continuous_usage_stats": true}``, ``{"include_usage": false}``) is
decoded and encoded again with ``include_usage`` set and its other options as the client wrote
them, and so is one whose ``stream_options`` is ``null`` (the only cases with a second JSON round
trip). A body whose
``stream_options`` is something else, or whose ``include_usage`` is not a boolean, is left as it is
(the engine refuses it, as without kvlb).

**The answer** (:class:`UsageStrip`): OpenAI's engines answer the option with one last event before
``data: [DONE]`` whose ``choices`` is empty and whose ``usage`` is an object (vLLM's and SGLang's
``serving_chat.py``/``serving_completions.py``, TensorRT-LLM's ``postprocess_handlers.py``:
``...Response(..., choices=[], usage=...)``): that event is dropped whole. An engine also given
``continuous_usage_stats`` (vLLM and TensorRT-LLM count it only with ``include_usage``) puts a
``usage`` object in every chunk: it is taken out (the member and its comma) or written back as
``null``, as the engine writes a chunk without usage (:attr:`EngineSpec.unasked_stream_usage
<balancer.engines.spec.EngineSpec.unasked_stream_usage>`). Events without ``"usage":{`` pass as the
same bytes; a chunk that ends on an event's end and has none is returned as it came (the common
case: one search of the chunk). An event longer than ``max_event_bytes`` before its end is passed
on unfiltered (counted in :attr:`UsageStrip.unfiltered_events`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final, Literal

import msgspec

from balancer import strict_json

StreamUsage = Literal["asked", "missing", "merge", "leave"]
"""What a request says about usage on its stream:

* ``asked``: not a stream, or ``stream_options.include_usage`` is ``true``: the body goes as it came;
* ``missing``: a stream without ``stream_options``: the option is written in;
* ``merge``: a stream whose ``stream_options`` is ``null`` or an object without ``include_usage:
  true``: the body is written again;
* ``leave``: a stream whose ``stream_options`` (or its ``include_usage``) has a wrong type: the
  engine answers it (a 400), kvlb does not touch it."""
UnaskedUsage = Literal["absent", "null"]
"""How an engine writes a chunk without usage: no ``usage`` member (``absent``: vLLM, TensorRT-LLM),
or ``"usage":null`` (``null``: SGLang)."""

MAX_EVENT_BYTES: Final = 256 * 1024
"""Default bound of one event held back until its end, in bytes (a usage event is about 300)."""

_OPTION: Final = b'"stream_options":{"include_usage":true}'
_USAGE_OBJECT: Final = re.compile(rb'"usage"\s*:\s*\{')
_EMPTY_CHOICES: Final = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_SPACE: Final = b" \t\r\n"
_ENDS: Final = (b"\n\n", b"\r\n\r\n", b"\r\r")
"""An event's end at a chunk's end (a chunk ending so holds no unfinished event)."""


def stream_usage_of(stream: bool, options: Any, present: bool) -> StreamUsage:
    """Classify a request by its ``stream`` and ``stream_options`` (``present``: the key is there)."""
    if not stream:
        return "asked"
    if not present:
        return "missing"
    if options is None:
        return "merge"  # written again without the null (no duplicate key)
    if not isinstance(options, Mapping):
        return "leave"
    include = options.get("include_usage")
    if include is True:
        return "asked"
    if include is None or include is False:
        return "merge"
    return "leave"


def with_stream_usage(body: bytes, usage: StreamUsage) -> bytes | None:
    """``body`` (a JSON object, already parsed) asking for usage on its stream; ``None`` when it
    is left as it is (``usage`` is ``asked`` or ``leave``, or the body cannot be written again)."""
    if usage == "missing":
        end = len(body.rstrip(_SPACE))
        # the head through a memoryview: ``join`` copies it once (a slice would copy it first)
        return b"".join((memoryview(body)[: end - 1], b",", _OPTION, body[end - 1 :]))
    if usage == "merge":
        try:
            decoded = msgspec.json.decode(body)
            decoded["stream_options"] = {**(decoded["stream_options"] or {}), "include_usage": True}
            return strict_json.dumps(decoded, separators=(",", ":")).encode("utf-8")
        except (msgspec.DecodeError, ValueError, TypeError, KeyError):
            return None
    return None


class UsageStrip:
    """Takes out of one event stream the usage its client did not ask for (one per stream)."""

    __slots__ = ("_max_event_bytes", "_null", "_pending", "dropped_events", "unfiltered_events")

    def __init__(self, unasked: UnaskedUsage, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._null = unasked == "null"
        self._pending = bytearray()
        """Bytes after the last complete event (at most ``max_event_bytes``)."""
        self._max_event_bytes = max_event_bytes
        self.dropped_events = 0
        """Usage-only events taken out."""
        self.unfiltered_events = 0
        """Events passed on unfiltered because they outgrew ``max_event_bytes`` before their end."""

    def feed(self, chunk: bytes) -> bytes:
        """What the client gets of ``chunk``: its complete events, filtered (an event's start is held
        back until its end arrives)."""
        if not self._pending and chunk.endswith(_ENDS) and _USAGE_OBJECT.search(chunk) is None:
            return chunk
        pending = self._pending
        pending += chunk
        out: list[bytes] = []
        start = 0
        for end in event_ends(pending):
            out.append(self._event(bytes(pending[start:end])))
            start = end
        del pending[:start]
        if len(pending) > self._max_event_bytes:
            self.unfiltered_events += 1
            out.append(bytes(pending))
            pending.clear()
        return b"".join(out)

    def close(self) -> bytes:
        """At the end of the stream: a last event that lacks its blank line, filtered."""
        rest = bytes(self._pending)
        self._pending.clear()
        return self._event(rest) if rest else b""

    def _event(self, event: bytes) -> bytes:
        found = _USAGE_OBJECT.search(event)
        if found is None:
            return event
        if _EMPTY_CHOICES.search(event) is not None and _usage_only(event):
            self.dropped_events += 1
            return b""
        end = _object_end(event, found.end() - 1)
        if end is None:
            return event
        if self._null:
            return b"".join((event[: found.start()], b'"usage":null', event[end:]))
        start = found.start()
        before = event[:start].rstrip(_SPACE)
        if before.endswith(b","):
            return before[:-1] + event[end:]
        after = event[end:].lstrip(_SPACE)
        if after.startswith(b","):
            return event[:start] + after[1:]
        return event


def event_ends(data: bytes | bytearray) -> list[int]:
    r"""Where the complete events of ``data`` end: just past each blank line, as ``finditer`` of
    ``\r\n\r\n|\n\n|\r\r`` finds them (leftmost first; no two of the three can start at one
    place), less a ``\r\r`` that ends ``data`` (maybe the start of a CRLF CRLF: the next chunk
    decides). Found with three byte searches, each run again only once passed (the regex tried its
    forms at every byte: 32,000 instructions for the bench's 600-byte last chunk)."""
    ends: list[int] = []
    find = data.find
    crlf, lf, cr = find(b"\r\n\r\n"), find(b"\n\n"), find(b"\r\r")
    while True:  # the leftmost of the three (no two can start at one place)
        start, end = crlf, crlf + 4
        if lf >= 0 and (start < 0 or lf < start):
            start, end = lf, lf + 2
        if cr >= 0 and (start < 0 or cr < start):
            if cr + 2 == len(data):
                return ends
            start, end = cr, cr + 2
        if start < 0:
            return ends
        ends.append(end)
        if 0 <= crlf < end:
            crlf = find(b"\r\n\r\n", end)
        if 0 <= lf < end:
            lf = find(b"\n\n", end)
        if 0 <= cr < end:
            cr = find(b"\r\r", end)


def _usage_only(event: bytes) -> bool:
    """Whether every ``data:`` payload of ``event`` is an object with empty ``choices`` and a
    ``usage`` object (the engines' answer to ``include_usage``)."""
    lines = [line for line in event.splitlines() if line.startswith(b"data:")]
    if len(lines) != 1:
        return False
    try:
        payload = msgspec.json.decode(lines[0][5:])
    except (msgspec.DecodeError, ValueError):
        return False
    return (
        isinstance(payload, dict) and payload.get("choices") == [] and isinstance(payload.get("usage"), dict)
    )


def _object_end(text: bytes, start: int) -> int | None:
    """The index just past the JSON object opening at ``text[start]`` (``{``), strings skipped;
    ``None`` when it does not close within ``text``."""
    depth = 0
    index = start
    length = len(text)
    while index < length:
        byte = text[index]
        if byte == 0x22:  # a string: skip to its closing quote
            index += 1
            while index < length and text[index] != 0x22:
                index += 2 if text[index] == 0x5C else 1
        elif byte == 0x7B:
            depth += 1
        elif byte == 0x7D:
            depth -= 1
            if depth == 0:
                return index + 1
        index += 1
    return None
