"""What parsing a request costs in memory, estimated from its bytes before it is parsed (pure).

A JSON body's parse can cost many times its bytes (a body of empty objects, each a ``dict`` of 64 B
plus its slot in a list, from three bytes of ``{},``), and a gRPC message's too (an empty
``ChatMessage`` is two bytes on the wire, a upb message of about 56 B once parsed and a ``dict`` of
about 240 B once made into the OpenAI body). A request whose body is at least
:data:`PARSE_HOLD_MIN_BYTES` holds the estimate of its parse in ``limits.max_inflight_body_bytes``
while it is parsed (``balancer/api/openai.py``, ``balancer/api/grpc``), so the parse is within the
budget as the bodies are; below that size the estimate is not computed (the parse is at most about
27 × 256 KiB ≈ 7 MB, one at a time on each event loop) and costs nothing.

The estimates are upper bounds of the ``tracemalloc`` peaks of ``python -m loadtests.memory_figures
bodies`` (and the resident-set rises of the gRPC shapes there), not proofs: a shape not measured
may cost more.
"""

from __future__ import annotations

PARSE_HOLD_MIN_BYTES = 256 * 1024
"""Smallest body (JSON) or message (gRPC), in bytes, whose parse holds its estimate: below it the
four byte counts of :func:`json_values_bound` are not run (about 0.2 ms for 256 KiB, 7 ms for
8 MiB: less than the parse of any body shaped to cost much) and the parse is not held."""

JSON_VALUE_PARSE_BYTES = 96
"""Bytes a JSON value or key may cost while its body is parsed, per unit of :func:`json_values_bound`:
the worst measured is 81 (empty objects ``[{},{},...]`` in a UTF-16 body, on the stdlib decoder
and the walk that looks for lone surrogates), then 76 (the same in UTF-8 with a lone surrogate
elsewhere), 73 (on ``msgspec``'s untyped decoder), 65 (empty arrays), 51 (one-letter chat
messages), 35 (distinct keys); plus 18% for shapes not measured."""

JSON_BYTE_PARSE_BYTES = 3
"""Bytes a JSON body's parse may cost per byte of it, besides its values: the characters of its
strings (at most one byte each per byte of UTF-8; a UTF-16 body is decoded whole to a ``str`` first,
its strings are copied out of it, and the look for lone surrogates encodes each non-ASCII one:
2.5× measured for a UTF-16 body of one string of CJK)."""

PROTOBUF_PARSE_BYTES_PER_BYTE = 33
"""Bytes a gRPC request message may cost once parsed by protobuf (upb), per byte of it, when its
fields are not scanned (:func:`protobuf_parse_bytes`): the most the scan's estimate gives, for a
message of empty ``ChatMessage`` (2 bytes on the wire each: its bytes, 1×, plus
:data:`PARSED_CHAT_MESSAGE_BYTES` every 2 bytes). Measured: 28.2× (the resident-set rise of
``GenerateRequest.FromString`` of 4 M of them)."""

PARSED_CHAT_MESSAGE_BYTES = 64
"""Bytes a parsed ``ChatMessage`` costs besides its strings (56.4 B measured for an empty one: its upb
message and its slot in the array)."""

PARSED_TOKEN_ID_BYTES = 8
"""Bytes a parsed token id of ``TokenIds`` may cost: 4 B in upb's array, which grows by doubling
while it is parsed (8.2 B an id measured for 8 M one-byte packed ids, 4.1 for unpacked ones); an id
is at least one byte on the wire."""

MAX_SCANNED_FIELDS = 64
"""Most top-level fields :func:`protobuf_parse_bytes` reads before it gives up and estimates from the
size alone (an honest ``GenerateRequest`` has at most nine, each once)."""

GENERATE_CHATS, GENERATE_IDS = 2, 3
"""``GenerateRequest``'s field numbers of ``chat_messages`` and ``prompt_token_ids``."""
ROUTE_REQUEST = 1
"""``RouteRequest``'s field number of its ``GenerateRequest``."""

CHAT_MESSAGE_CONVERT_BYTES = 320
"""Bytes one chat message of a gRPC ``GenerateRequest`` may cost while it is made into the OpenAI
body and parsed as one (``openai_call``): its ``dict`` and strings, its part of the JSON written, the
walk that sizes it (``tracemalloc`` peak of 4 M empty messages: 243 B each; plus 30%). Its text is
counted by :data:`JSON_BYTE_PARSE_BYTES` per byte of the message."""


CONVERT_TOKEN_ID_BYTES = 20
"""Bytes one token id of a gRPC ``GenerateRequest`` may cost while it is made into the OpenAI body:
its ``array('I')`` (4 B), the list read from the message and the JSON text written of them (the
resident-set rise of ``openai_call`` of 8 M one-byte ids: 15.2 B an id; plus 30%)."""


def json_values_bound(raw: bytes | str) -> int:
    """An upper bound on the number of values and keys in the JSON document ``raw``, from four
    counts at C speed, nothing decoded: every value but the outermost follows a ``[``, ``,`` or
    ``:``, and every key precedes a ``:`` (so a ``:`` counts twice); the ``[`` of each ``[]`` precedes
    no value and is taken off (the pairs cannot overlap, and one inside a string was counted once as
    a ``[``). These characters inside strings are counted too: an over-count, so the bound stays
    safe (a text full of commas weighs more than it costs, and is held, never refused, for it). In a
    UTF-16 or UTF-32 body each character is still one such byte beside zero bytes, so the counts
    hold (and ``[]`` is never found there)."""
    if isinstance(raw, str):
        return 1 + raw.count("[") - raw.count("[]") + raw.count(",") + 2 * raw.count(":")
    return 1 + raw.count(b"[") - raw.count(b"[]") + raw.count(b",") + 2 * raw.count(b":")


def json_parse_bytes(raw: bytes | str) -> int:
    """The estimate of what parsing the JSON document ``raw`` costs at its peak, in bytes (0 below
    :data:`PARSE_HOLD_MIN_BYTES`): :data:`JSON_VALUE_PARSE_BYTES` a value or key of
    :func:`json_values_bound` plus :data:`JSON_BYTE_PARSE_BYTES` a byte (a ``str``: a character,
    counted at four bytes, its most in UTF-8)."""
    size = len(raw) if isinstance(raw, bytes) else 4 * len(raw)
    if size < PARSE_HOLD_MIN_BYTES:
        return 0
    return JSON_VALUE_PARSE_BYTES * json_values_bound(raw) + JSON_BYTE_PARSE_BYTES * size


def protobuf_parse_bytes(raw: bytes, shape: str = "plain") -> int:
    """The estimate of what the gRPC request message ``raw`` costs once parsed (0 under
    :data:`PARSE_HOLD_MIN_BYTES`), in bytes, before it is parsed: its bytes again (its strings and
    unknown fields are copied), :data:`PARSED_CHAT_MESSAGE_BYTES` for each ``0x0a`` byte (the tag
    every ``ChatMessage`` starts with) inside ``chat_messages``, and :data:`PARSED_TOKEN_ID_BYTES` a
    byte of ``prompt_token_ids``. ``shape``: ``"generate"`` (a ``GenerateRequest``), ``"route"`` (a
    ``RouteRequest``, whose ``GenerateRequest`` is scanned the same) or ``"plain"`` (no field that
    parses into more than its bytes). Only the top-level fields' tags and lengths are read (at most
    :data:`MAX_SCANNED_FIELDS`, else, or for bytes that are not a message,
    :data:`PROTOBUF_PARSE_BYTES_PER_BYTE` a byte)."""
    size = len(raw)
    if size < PARSE_HOLD_MIN_BYTES:
        return 0
    extra = _parsed_extra(raw, 0, size, shape)
    if extra is None:
        return PROTOBUF_PARSE_BYTES_PER_BYTE * size
    return size + extra


def _parsed_extra(raw: bytes, start: int, end: int, shape: str) -> int | None:
    """What the message in ``raw[start:end]`` costs parsed beyond its bytes (see
    :func:`protobuf_parse_bytes`); ``None`` when its fields cannot be scanned."""
    fields = length_delimited_fields(raw, start, end)
    if fields is None:
        return None
    extra = 0
    for number, first, last in fields:
        if shape == "generate" and number == GENERATE_CHATS:
            extra += PARSED_CHAT_MESSAGE_BYTES * raw.count(b"\x0a", first, last)
        elif shape == "generate" and number == GENERATE_IDS:
            extra += PARSED_TOKEN_ID_BYTES * (last - first)
        elif shape == "route" and number == ROUTE_REQUEST:
            inner = _parsed_extra(raw, first, last, "generate")
            if inner is None:
                return None
            extra += inner
    return extra


def length_delimited_fields(raw: bytes, start: int, end: int) -> list[tuple[int, int, int]] | None:
    """``(field number, first byte, end)`` of each length-delimited field of the protobuf message in
    ``raw[start:end]``, at its top level; ``None`` when the bytes are not a message (a bad varint, a
    field past the end, a group) or hold more than :data:`MAX_SCANNED_FIELDS` fields."""
    fields: list[tuple[int, int, int]] = []
    pos = start
    scanned = 0
    while pos < end:
        scanned += 1
        if scanned > MAX_SCANNED_FIELDS:
            return None
        tag, pos = _varint(raw, pos, end)
        wire_type = tag & 7
        if wire_type == 0:
            _, pos = _varint(raw, pos, end)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _varint(raw, pos, end)
            fields.append((tag >> 3, pos, pos + length))
            pos += length
        else:
            return None
        if pos > end or pos < 0:
            return None
    return fields


def _varint(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``raw[pos]`` and the position after it; a position past ``end`` if malformed."""
    value = 0
    for shift in range(0, 70, 7):
        if pos >= end:
            return 0, end + 1
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
    return 0, end + 1


def parsed_message_bytes(message_bytes: int, chat_messages: int, token_ids: int) -> int:
    """What a parsed gRPC request message of ``message_bytes`` keeps while its call lasts, in bytes:
    its bytes again (its strings and unknown fields are copies), :data:`PARSED_CHAT_MESSAGE_BYTES` a
    chat message and :data:`PARSED_TOKEN_ID_BYTES` a token id. At most
    :func:`protobuf_parse_bytes` of the same message, when that is not 0."""
    return message_bytes + PARSED_CHAT_MESSAGE_BYTES * chat_messages + PARSED_TOKEN_ID_BYTES * token_ids


def chat_convert_bytes(message_bytes: int, chat_messages: int, extra_json: str, token_ids: int = 0) -> int:
    """The estimate of what making a parsed ``GenerateRequest`` into its OpenAI body costs at its
    peak (``openai_call``): :data:`CHAT_MESSAGE_CONVERT_BYTES` a chat message,
    :data:`CONVERT_TOKEN_ID_BYTES` a token id, the texts' bytes at
    :data:`JSON_BYTE_PARSE_BYTES`, and the parse of ``extra_json`` (:func:`json_parse_bytes`); 0 for a
    message under :data:`PARSE_HOLD_MIN_BYTES`."""
    if message_bytes < PARSE_HOLD_MIN_BYTES:
        return 0
    return (
        CHAT_MESSAGE_CONVERT_BYTES * chat_messages
        + CONVERT_TOKEN_ID_BYTES * token_ids
        + JSON_BYTE_PARSE_BYTES * message_bytes
        + json_parse_bytes(extra_json)
    )
