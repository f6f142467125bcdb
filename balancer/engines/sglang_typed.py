"""The typed msgpack schema of the common SGLang/vLLM ``EventBatch`` (pure: no I/O, no clock).

:class:`~balancer.engines.sglang.SglangDecoder` first decodes a payload with this schema, in one
C-level pass (``msgspec``), into an :class:`Envelope` of tagged structs; only what the schema does
not fit goes through the generic ``msgpack`` decode and its per-field Python checks. The schema is
the shape real engines publish (``tests/golden/real``): an array ``[ts, events, dp_rank]`` of tagged
maps (``{"type": "BlockStored", ...}``) whose block hashes are ints and whose ``token_ids`` are
ints. Only fields that may hold no other type are typed, so that a value the generic path would
report (with its ``repr``) never reaches it in another form. A payload of any other shape (a map
envelope, positional events, an unknown tag, ``bytes`` or hex hashes, EAGLE bigram pairs, a field of
an unexpected type) makes :func:`decode_typed` return ``None``, and the decoder takes the generic
path for the whole message, so the outcome never depends on which path ran. A map key the schema
does not name, or a trailing item of the envelope, also sends the message to the generic path (which
ignores it, once it has decoded it); a repeated key keeps its last value in both.
"""

from __future__ import annotations

from typing import Any

import msgspec

_STRICT: dict[str, Any] = {"frozen": True, "forbid_unknown_fields": True}
"""An unknown key (or trailing array item) is not skipped but sends the message to the generic path,
which decodes every value (msgspec skips an unknown one unread, e.g. a string of invalid UTF-8)."""


class TypedStored(msgspec.Struct, tag_field="type", tag="BlockStored", **_STRICT):
    """A tagged-map ``BlockStored``; fields the fast path does not read stay untyped (``Any``)."""

    block_hashes: list[int]
    token_ids: list[int]
    block_size: int
    parent_block_hash: int | None = None
    lora_id: Any = None
    medium: Any = None
    lora_name: Any = None
    cache_salt: Any = None
    metadata: Any = None
    extra_keys: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None


class TypedRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", **_STRICT):
    """A tagged-map ``BlockRemoved``."""

    block_hashes: list[int]
    medium: Any = None
    group_idx: Any = None


class TypedCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", **_STRICT):
    """A tagged-map ``AllBlocksCleared``."""

    medium: Any = None


TypedEvent = TypedStored | TypedRemoved | TypedCleared


class Envelope(msgspec.Struct, array_like=True, **_STRICT):
    """``[ts, events, dp_rank]`` (``dp_rank`` optional)."""

    ts: float | None
    events: list[TypedEvent]
    dp_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(Envelope)


def decode_typed(payload: bytes) -> Envelope | None:
    """``payload`` in the common shape, or ``None`` when it has another (or is not msgpack)."""
    try:
        return _DECODER.decode(payload)
    except Exception:  # not the shape, or not msgpack (msgspec raises more than its own errors,
        return None  # e.g. UnicodeDecodeError): the generic path decides, and reports, what it is


def fields_of(event: TypedEvent) -> dict[str, Any]:
    """A typed event as the tagged map the generic path reads (an absent key is ``None`` here, as
    ``get`` gives it there)."""
    fields = msgspec.structs.asdict(event)
    fields["type"] = event.__struct_config__.tag
    return fields
