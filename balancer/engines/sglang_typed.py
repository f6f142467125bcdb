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

from collections.abc import Iterator
from typing import Any

import msgspec

from balancer.types import U64_MASK

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


def plain(event: TypedStored) -> bool:
    """A store on the GPU tier without LoRA, salt, extra keys or KV-cache group (the common one)."""
    return (
        event.lora_id is None
        and event.lora_name is None
        and event.cache_salt is None
        and event.metadata is None
        and event.extra_keys is None
        and event.group_idx is None
        and event.kv_cache_spec_kind is None
        and (event.medium is None or event.medium == "GPU")
    )


Run = tuple[int, int, list[int], list[int]]
"""``(start, end, engine hashes, token ids)``: the events ``[start, end)`` of an envelope."""


def chain_runs(events: list[TypedEvent], pool_size: int | None) -> Iterator[Run]:
    """``events`` cut into runs, in order: a run of several events is plain one-block stores of one
    full block of one size (the pool's, if given), each the parent of the next, with their engine
    hashes (as u64) and tokens gathered; any other event is a run of its own (hashes and tokens
    empty). A run's tokens are not checked: they may not pack."""
    start = 0  # the open run is events[start:position]
    hashes: list[int] = []
    tokens: list[int] = []
    run_size = 0
    for position, event in enumerate(events):
        if type(event) is TypedStored and len(event.block_hashes) == 1 and plain(event):
            block_size = event.block_size
            if len(event.token_ids) == block_size > 0 and pool_size in (None, block_size):
                parent = event.parent_block_hash
                if (
                    hashes
                    and block_size == run_size
                    and parent is not None
                    and parent & U64_MASK == hashes[-1]
                ):
                    hashes.append(event.block_hashes[0] & U64_MASK)
                    tokens += event.token_ids
                    continue
                if hashes:
                    yield start, position, hashes, tokens
                start, run_size = position, block_size
                hashes, tokens = [event.block_hashes[0] & U64_MASK], list(event.token_ids)
                continue
        if hashes:
            yield start, position, hashes, tokens
            hashes = []
        yield position, position + 1, [], []
    if hashes:
        yield start, len(events), hashes, tokens
