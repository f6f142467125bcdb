"""Conversions between kvlb's gRPC messages and the OpenAI and admin JSON shapes (pure).

* :func:`openai_call`: a ``GenerateRequest`` as the OpenAI request the replica gets (chat messages →
  ``/v1/chat/completions``; token ids or text → ``/v1/completions``), and what routing reads of it.
  That is made from the fields the body is written from, by the HTTP face's checks
  (:func:`~balancer.api.parsing.parse_body`, :func:`~balancer.api.parsing.packed_completion`), so both
  transports validate alike without kvlb decoding the JSON it has just written. Token ids are read
  from the message once (a slice of the repeated field, about 135 µs for 8k ids: the ints are made
  there), packed as ``array('I')`` for routing (``uint32`` ids need no range check) and written as
  JSON by ``msgspec`` (about 40 µs; ``json.dumps``: 480), the rest of the body by
  :func:`balancer.strict_json.dumps`: the body is the bytes one ``strict_json.dumps`` of it all gives.
  With a memo, ids sent before are not read as ints at all: runs of their packed varints give their
  packed ids and JSON text (:func:`~balancer.tokenizer.token_ids.packed_token_ids`), the varints as
  the request's bytes hold them when they are at hand (``Generate``: :func:`received_ids`).
* :func:`read_chunk`: what a ``GenerateChunk`` carries besides the raw JSON of one event payload
  (the replica's stream is split into payloads by :class:`balancer.upstream.sse.SseEvents`).
* :func:`decision_message`, :func:`policy_message`, :func:`struct_of`: kvlb's objects (and the
  admin API's JSON views of them) as messages (a replica's view:
  :mod:`balancer.api.grpc.replica_messages`).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, struct_pb2

from balancer import strict_json
from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.errors import ApiError
from balancer.api.parsing import (
    ParsedRequest,
    RequestKind,
    packed_completion,
    parse_body,
    refuse_lone_surrogates,
)
from balancer.service.policy_control import PolicyView
from balancer.tokenizer.token_ids import TokenIdMemo, packed_start, packed_token_ids
from balancer.types import CostTerms, Decision

MAX_ERROR_CHARS = 512
"""Longest replica error message passed on to a client."""
RESERVED_EXTRA_KEYS = frozenset(
    {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "user"}
    | {"stream", "stream_options"}
)
"""OpenAI fields ``extra_json`` may not set: the request's own fields (or kvlb) set them."""


@dataclass(frozen=True, slots=True)
class OpenAICall:
    """The OpenAI request a ``GenerateRequest`` stands for."""

    kind: RequestKind
    path: str
    body: bytes
    parsed: ParsedRequest
    """What routing reads of ``body``: what :func:`~balancer.api.parsing.parse_request` of it gives
    (a token-id prompt already packed), made without decoding it."""


def openai_call(
    request: pb.GenerateRequest, *, stream: bool, memo: TokenIdMemo | None = None, raw: bytes = b""
) -> OpenAICall:
    """The OpenAI body for ``request`` (400 naming the field when it is incomplete or invalid).
    ``stream`` asks the replica for an event stream that ends with a usage chunk. Token ids are read
    through ``memo`` (:func:`~balancer.tokenizer.token_ids.packed_token_ids`; none: read whole), their
    varints as ``raw`` (the bytes ``request`` was parsed from) holds them when it does
    (:func:`received_ids`), else as ``request`` serializes them."""
    if not request.model:
        raise ApiError(400, "'model' is required and must be a non-empty string")
    extra = _extra(request.extra_json)
    body = {**extra, "model": request.model}
    kind: RequestKind = "completions"
    ids: pb.TokenIds | None = None
    which = request.WhichOneof("input")
    if which == "chat_messages":
        if not request.chat_messages.messages:
            raise ApiError(400, "'chat_messages.messages' must not be empty")
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.chat_messages.messages]
        kind = "chat"
    elif which == "prompt_token_ids":
        ids = request.prompt_token_ids
        if not ids.ids:
            raise ApiError(400, "'prompt_token_ids.ids' must not be empty")
    elif which == "prompt_text":
        body["prompt"] = request.prompt_text
    else:
        raise ApiError(400, "one of 'chat_messages', 'prompt_token_ids' or 'prompt_text' is required")
    after: dict[str, Any] = {}  # the fields written after the prompt
    if request.max_tokens:
        after["max_tokens"] = request.max_tokens
    if request.HasField("temperature"):
        if not (math.isfinite(request.temperature) and request.temperature >= 0):
            raise ApiError(400, f"'temperature' must be a finite number >= 0, got {request.temperature}")
        after["temperature"] = request.temperature
    if request.HasField("session_key"):
        after["user"] = request.session_key
    if stream:
        after["stream"] = True
        after["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    refuse_lone_surrogates(extra)  # only there can one be (a "\\ud800" escape): protobuf strings are UTF-8
    if ids is None:
        body.update(after)
        return OpenAICall(kind, path, _dumps(body), parse_body(body, kind))
    packed, ids_json = packed_token_ids(ids.ids, functools.partial(received_ids, raw, ids), memo)
    raw = _ids_body(body, ids_json, after)
    body.update(after)  # the fields routing checks (the prompt is not among them)
    return OpenAICall(kind, path, raw, packed_completion(body, packed))


def received_ids(raw: bytes, ids: pb.TokenIds) -> bytes:
    """The serialized ``TokenIds`` of a ``GenerateRequest`` whose bytes are ``raw``: the bytes of its
    field 3 as they came, when that field occurs once and holds one packed field (as protobuf writes
    it: then they are what ``ids`` was parsed from, nothing merged into it); else ``ids`` serialized
    again (about 40 µs for 8k ids)."""
    field = _only_field(raw, 3)
    if field is not None and packed_start(field) is not None:
        return field
    return ids.SerializeToString()


def _only_field(raw: bytes, number: int) -> bytes | None:
    """The value of length-delimited field ``number`` of the serialized message ``raw`` (its
    top-level fields walked, the others skipped), if it occurs exactly once; else, or if ``raw``
    holds anything this walk does not read (groups, a truncated field), ``None``."""
    found: bytes | None = None
    position, end = 0, len(raw)
    while position < end:
        key, position = _varint(raw, position)
        wire_type = key & 7
        if wire_type == 0:
            _, position = _varint(raw, position)
        elif wire_type == 1:
            position += 8
        elif wire_type == 5:
            position += 4
        elif wire_type == 2:
            length, start = _varint(raw, position)
            position = start + length
            if key >> 3 == number:
                if found is not None:
                    return None
                found = raw[start:position]
        else:
            return None
    return found if position == end else None


def _varint(raw: bytes, position: int) -> tuple[int, int]:
    """The varint at ``position`` and the position after it (past the end if it is cut short)."""
    value = shift = 0
    for byte in raw[position : position + 10]:
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
    return value, len(raw) + 1


def _ids_body(before: dict[str, Any], ids_json: bytes, after: dict[str, Any]) -> bytes:
    """The compact JSON object of ``before``'s fields, ``"prompt"`` (``ids_json``: the ids' JSON
    array) and ``after``'s fields: the bytes :func:`_dumps` gives of them as one dict with the ids
    as a list (``msgspec`` writes integers as ``json`` does), at ``msgspec``'s speed for the ids.
    ``before`` is never empty (it holds ``model``)."""
    head = _dumps(before)[:-1]  # without its closing brace
    tail = b"," + _dumps(after)[1:] if after else b"}"
    return b"".join((head, b',"prompt":', ids_json, tail))


def _dumps(value: dict[str, Any]) -> bytes:
    return strict_json.dumps(value, separators=(",", ":")).encode("utf-8")


def _extra(text: str) -> dict[str, Any]:
    """The ``extra_json`` object as the body written from it reads: a number too large for a float
    (``1e400``), which the body says is ``null``, is ``None`` here too, so routing reads the fields the
    replica gets (a chat's ``tools``)."""
    if not text:
        return {}
    try:
        value = strict_json.loads(text, overflow_to_null=True)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"'extra_json' is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"'extra_json' must be a JSON object, got {type(value).__name__}")
    reserved = sorted(RESERVED_EXTRA_KEYS & set(value))
    if reserved:
        raise ApiError(400, f"'extra_json' may not set {reserved}: use the request's own fields")
    return value


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """What one OpenAI stream chunk says besides its raw JSON."""

    text: str = ""
    """``choices[0].delta.content`` (chat) or ``choices[0].text`` (completions)."""
    finish_reason: str | None = None
    usage: pb.Usage | None = None
    error: str | None = None
    """The message of an ``{"error": ...}`` event."""


def read_chunk(data: bytes) -> ChunkInfo:
    """Read one chunk; anything not shaped as expected reads as empty (it is still relayed raw)."""
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError):
        return ChunkInfo()
    if not isinstance(payload, dict):
        return ChunkInfo()
    if payload.get("error") is not None:
        return ChunkInfo(error=error_text(payload))
    text = ""
    finish: str | None = None
    choices = payload.get("choices")
    if isinstance(choices, list):
        for position, choice in enumerate(c for c in choices if isinstance(c, dict)):
            if isinstance(choice.get("finish_reason"), str):
                finish = choice["finish_reason"]
            if position == 0:
                delta = choice.get("delta")
                content = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                text = content if isinstance(content, str) else ""
    return ChunkInfo(text, finish, _usage(payload.get("usage")))


def _usage(value: object) -> pb.Usage | None:
    if not isinstance(value, dict):
        return None
    usage = pb.Usage(
        prompt_tokens=_count(value.get("prompt_tokens")),
        completion_tokens=_count(value.get("completion_tokens")),
        total_tokens=_count(value.get("total_tokens")),
    )
    details = value.get("prompt_tokens_details")
    if isinstance(details, dict) and _is_count(details.get("cached_tokens")):
        usage.cached_tokens = details["cached_tokens"]
    return usage


def _is_count(value: object) -> bool:
    return type(value) is int and 0 <= value < 2**32


def _count(value: object) -> int:
    return value if isinstance(value, int) and _is_count(value) else 0


def error_text(payload: Mapping[str, Any]) -> str:
    """The message of an OpenAI/FastAPI-style error body, shortened for a status detail."""
    error = payload.get("error")
    message: object = error.get("message") if isinstance(error, dict) else error
    for key in ("message", "detail"):
        if message is None:
            message = payload.get(key)
    return str(message if message is not None else payload)[:MAX_ERROR_CHARS]


def error_body_text(body: bytes) -> str:
    """The message of a replica's error answer (JSON or plain text)."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return body.decode("utf-8", "replace").strip()[:MAX_ERROR_CHARS]
    if isinstance(payload, dict):
        return error_text(payload)
    return str(payload)[:MAX_ERROR_CHARS]


def decision_message(decision: Decision) -> pb.Decision:
    return pb.Decision(
        replica=decision.replica,
        policy=decision.policy,
        overlap_blocks=decision.overlap_blocks,
        request_blocks=decision.request_blocks,
        cached_tokens=decision.cached_tokens,
        terms=[_terms_message(t) for t in decision.terms],
        dp_rank=decision.dp_rank,
        reason=decision.reason,
        ramp_share=decision.ramp_share,
        busy_share=decision.busy_share,
    )


def _terms_message(terms: CostTerms) -> pb.CostTerms:
    return pb.CostTerms(
        replica=terms.replica,
        overlap_blocks=terms.overlap_blocks,
        request_blocks=terms.request_blocks,
        pending_prefill_blocks=terms.pending_prefill_blocks,
        active_decode_blocks=terms.active_decode_blocks,
        waiting_requests=terms.waiting_requests,
        kv_usage=terms.kv_usage,
        prefill_term=terms.prefill_term,
        decode_term=terms.decode_term,
        queue_term=terms.queue_term,
        cost=terms.cost,
        probability=terms.probability,
        excluded=terms.excluded or "",
        shared_pending_blocks=terms.shared_pending_blocks,
        duplication_term=terms.duplication_term,
        cache_pressure=terms.cache_pressure,
        interference_term=terms.interference_term,
        admission_term=terms.admission_term,
        root_term=terms.root_term,
        held_roots=terms.held_roots,
        overlap_survival=terms.overlap_survival,
        overlap_credit=terms.overlap_credit,
    )


def policy_message(view: PolicyView, choices: Mapping[str, Any] | None = None) -> pb.Policy:
    """The policy in force; with ``choices`` (``GET /admin/policy``'s additions,
    :func:`~balancer.api.admin.policy_choices`) its ``policies`` and ``ranges`` too."""
    message = pb.Policy(
        name=view.name,
        weights=struct_of(view.weights.to_dict()),
        version=view.version,
        updated_by=view.updated_by,
        updated_at=view.updated_at_wall,
    )
    if choices is not None:
        message.policies.extend(choices["policies"])
        for name, weight_range in choices["ranges"].items():
            message.ranges[name].CopyFrom(pb.WeightRange(**weight_range))
    return message


def struct_of(data: Mapping[str, Any]) -> struct_pb2.Struct:
    """A JSON-like mapping as a ``google.protobuf.Struct`` (numbers become doubles): the message
    ``json_format.ParseDict`` makes of ``json.loads(strict_json.dumps(data))`` (a non-finite float
    is a null, a tuple a list), set field by field without that round trip (a quarter of its
    time or less: it took most of a ``ListReplicas`` answer, 2026-12-01, h-grpclist). Whatever the direct
    way does not take (a key that is not a string, a value of no JSON type, a string protobuf
    refuses) goes the JSON way, which converts or refuses it as it always did."""
    struct = struct_pb2.Struct()
    fill_struct(struct, data)
    return struct


def fill_struct(struct: struct_pb2.Struct, data: Mapping[str, Any]) -> None:
    """Set ``struct`` (empty: a message's field, filled where it is instead of copied into it) to
    what :func:`struct_of` gives of ``data``."""
    try:
        _fill_struct(struct, data)
    except Exception:  # the JSON way gives the answer (or the error) it always gave
        struct.Clear()
        json_format.ParseDict(json.loads(strict_json.dumps(data)), struct)


class _NotPlain(Exception):
    """A key or value :func:`_fill_value` leaves to the JSON way."""


def _fill_struct(struct: struct_pb2.Struct, data: Mapping[str, Any]) -> None:
    """The scalars most views hold set here (a call a leaf less), the rest by :func:`_fill_value`."""
    fields = struct.fields
    for key, value in data.items():
        if not isinstance(key, str):  # json writes 1, 1.5, True, None as keys: the JSON way
            raise _NotPlain(key)
        kind = type(value)
        if value is None:
            fields[key].null_value = struct_pb2.NULL_VALUE
        elif kind is int:
            fields[key].number_value = value
        elif kind is str:
            fields[key].string_value = value
        else:
            _fill_value(fields[key], value)


def _fill_value(target: struct_pb2.Value, value: Any) -> None:
    """Set ``target`` as ``json_format`` sets it from ``value`` written and read back as JSON. The
    exact types first (the common case); subclasses in the order ``json``'s encoder checks them."""
    kind = type(value)
    if kind is str:
        target.string_value = value
    elif kind is float:
        if math.isfinite(value):
            target.number_value = value
        else:
            target.null_value = struct_pb2.NULL_VALUE
    elif kind is int:
        target.number_value = value
    elif value is None:
        target.null_value = struct_pb2.NULL_VALUE
    elif kind is bool:
        target.bool_value = value
    elif kind is dict:
        struct = target.struct_value
        struct.SetInParent()  # an empty one is an empty Struct, not an unset value
        _fill_struct(struct, value)
    elif kind is list or kind is tuple:
        _fill_list(target, value)
    else:
        _fill_subclass(target, value)


def _fill_list(target: struct_pb2.Value, items: list[Any] | tuple[Any, ...]) -> None:
    values = target.list_value
    values.SetInParent()
    add = values.values.add
    for item in items:
        _fill_value(add(), item)


def _fill_subclass(target: struct_pb2.Value, value: Any) -> None:
    """A subclass of a JSON type, as ``json`` writes it: a ``str``'s characters, an ``int``'s or a
    ``float``'s number (an ``IntEnum`` is its number), a ``dict``'s items, a ``list``'s or a
    ``tuple``'s items; anything else is the JSON way's to refuse."""
    if isinstance(value, str):
        target.string_value = str.__str__(value)
    elif isinstance(value, int):
        target.number_value = int.__int__(value)
    elif isinstance(value, float):
        _fill_value(target, float.__float__(value))
    elif isinstance(value, list | tuple):
        _fill_list(target, value)
    elif isinstance(value, dict):
        struct = target.struct_value
        struct.SetInParent()
        _fill_struct(struct, value)
    else:
        raise _NotPlain(type(value).__name__)


def value_of(data: object) -> struct_pb2.Value:
    """A JSON-like value as a ``google.protobuf.Value``."""
    return struct_of({"value": data}).fields["value"]


def dict_of(struct: struct_pb2.Struct, where: str) -> dict[str, Any]:
    """A client's ``Struct`` as a dict; 400 naming ``where`` if it holds no JSON (NaN, infinity)."""
    try:
        result: dict[str, Any] = json_format.MessageToDict(struct)
    except ValueError as exc:
        raise ApiError(400, f"'{where}' is not valid JSON: {exc}") from None
    return result
