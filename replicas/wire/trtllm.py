"""TRT-LLM KV-cache event JSON and V1 block-key hash, for the emulator (pure).

The events are the dicts ``tensorrt_llm._utils.KVCacheEventSerializer`` produces and ``trtllm-serve``
returns, drained, as the JSON array body of ``POST /kv_cache_events``::

    {"event_id": int, "data": {...}, "window_size": int [, "attention_dp_rank": int]}

with ``data`` one of ``created``, ``stored`` (a chain of ``stored_block`` dicts with ``unique_token``
tokens), ``removed`` and ``updated`` (``event_diff`` values). ``attention_dp_rank`` is present only with
attention data parallelism. Hashes are u64 and may exceed 2**63 - 1.

The block hash is the default ("v1_block_key") ``BlockKeyHasher::hash`` of ``blockKey.cpp`` for an
unsalted, non-LoRA, text-only block (``usesExtraIds`` false)::

    seed = len(tokens) ^ (parent * 0xbf58476d1ce4e5b9)             # u64; parent 0 for the first block
    for t in tokens: seed = mix32(u32(t), seed)
    mix32(a, seed): a = ((a >> 16) ^ a) * 0x45d9f3b (twice, u32); a = (a >> 16) ^ a
                    return seed ^ (u32(a + 0x9e3779b9) + (seed << 6) + (seed >> 2))   # u64

The ``u32(a + 0x9e3779b9)`` wrap follows C++ promotion (``uint32_t + unsigned int`` stays 32-bit); the
unit tests check it against a compiled C++ transcription. No golden value from a live TRT-LLM exists
here, so the hash is **unvalidated against a real engine**. Older TRT-LLM releases always mixed
``tokenExtraId`` and the LoRA id too and so produce different values.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

JsonDict = dict[str, Any]

DEFAULT_PRIORITY: Final = 35
"""TRT-LLM's default block retention priority (``KvCacheRetentionConfig``)."""
PRIMARY_LEVEL: Final = 0
"""``cache_level`` of GPU memory; 1 is the secondary (host) tier."""

_U32_MASK: Final = (1 << 32) - 1
_U64_MASK: Final = (1 << 64) - 1
_MIX32_MULTIPLIER: Final = 0x045D9F3B
_COMBINE_CONSTANT: Final = 0x9E3779B9
_PARENT_MULTIPLIER: Final = 0xBF58476D1CE4E5B9


def _mix32(value: int, seed: int) -> int:
    """Fold one 32-bit value into the 64-bit seed (``hash32Mix``)."""
    mixed = value & _U32_MASK
    mixed = (((mixed >> 16) ^ mixed) * _MIX32_MULTIPLIER) & _U32_MASK
    mixed = (((mixed >> 16) ^ mixed) * _MIX32_MULTIPLIER) & _U32_MASK
    mixed = (mixed >> 16) ^ mixed
    mixed = (mixed + _COMBINE_CONSTANT) & _U32_MASK
    return seed ^ ((mixed + (seed << 6) + (seed >> 2)) & _U64_MASK)


def block_key_hash(token_ids: Sequence[int], parent_hash: int | None) -> int:
    """TRT-LLM's u64 V1 block hash of one block chained to its parent's hash (``None``: first block)."""
    parent = 0 if parent_hash is None else parent_hash & _U64_MASK
    seed = (len(token_ids) ^ (parent * _PARENT_MULTIPLIER)) & _U64_MASK
    for token in token_ids:
        seed = _mix32(token, seed)
    return seed


def trtllm_block_hashes(tokens: Sequence[int], tokens_per_block: int) -> list[tuple[int, list[int]]]:
    """``(hash, block tokens)`` for every block of ``tokens``, chained; the last block may be partial.

    The engine caches a request's blocks over the tokens it has computed KV for; callers pass exactly
    those (for a prompt alone that is ``prompt[:-1]``).
    """
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
    blocks: list[tuple[int, list[int]]] = []
    parent: int | None = None
    for start in range(0, len(tokens), tokens_per_block):
        block = [int(token) for token in tokens[start : start + tokens_per_block]]
        parent = block_key_hash(block, parent)
        blocks.append((parent, block))
    return blocks


def _event(event_id: int, data: JsonDict, window_size: int, dp_rank: int | None) -> JsonDict:
    event: JsonDict = {"event_id": event_id, "data": data, "window_size": window_size}
    if dp_rank is not None:
        event["attention_dp_rank"] = dp_rank
    return event


def created(
    event_id: int, num_blocks_per_cache_level: Sequence[int], window_size: int, dp_rank: int | None = None
) -> JsonDict:
    """The ``created`` event a KV manager emits once per window size at start-up (``event_id`` 0)."""
    data = {"type": "created", "num_blocks_per_cache_level": list(num_blocks_per_cache_level)}
    return _event(event_id, data, window_size, dp_rank)


def _stored_block(
    block_hash: int, tokens: Sequence[int], cache_level: int, priority: int, cache_salt: str | None
) -> JsonDict:
    return {
        "type": "stored_block",
        "block_hash": block_hash & _U64_MASK,
        "tokens": [{"type": "unique_token", "token_id": int(token), "token_extra_id": 0} for token in tokens],
        "cache_salt": cache_salt,
        "cache_level": cache_level,
        "priority": priority,
        "mm_keys": [],
    }


def stored(
    event_id: int,
    parent_hash: int | None,
    blocks: Sequence[tuple[int, Sequence[int]]],
    window_size: int,
    *,
    dp_rank: int | None = None,
    cache_level: int = PRIMARY_LEVEL,
    priority: int = DEFAULT_PRIORITY,
    cache_salt: str | None = None,
) -> JsonDict:
    """A ``stored`` event: ``blocks`` is a chain of ``(hash, tokens)``, block 0 under ``parent_hash``."""
    if not blocks:
        raise ValueError("a stored event needs at least one block")
    data = {
        "type": "stored",
        "parent_hash": None if parent_hash is None else parent_hash & _U64_MASK,
        "blocks": [
            _stored_block(block_hash, tokens, cache_level, priority, cache_salt)
            for block_hash, tokens in blocks
        ],
    }
    return _event(event_id, data, window_size, dp_rank)


def removed(
    event_id: int, block_hashes: Sequence[int], window_size: int, dp_rank: int | None = None
) -> JsonDict:
    """A ``removed`` event (evictions; consecutive removals of one window coalesce into one event)."""
    data = {"type": "removed", "block_hashes": [value & _U64_MASK for value in block_hashes]}
    return _event(event_id, data, window_size, dp_rank)


def _diff(change: tuple[int, int] | None) -> JsonDict | None:
    if change is None:
        return None
    old_value, new_value = change
    return {"type": "event_diff", "new_value": new_value, "old_value": old_value}


def updated(
    event_id: int,
    block_hash: int,
    window_size: int,
    *,
    cache_level: tuple[int, int] | None = None,
    priority: tuple[int, int] | None = None,
    dp_rank: int | None = None,
) -> JsonDict:
    """An ``updated`` event; ``cache_level`` and ``priority`` are ``(old, new)`` changes or ``None``."""
    data = {
        "type": "updated",
        "block_hash": block_hash & _U64_MASK,
        "cache_level": _diff(cache_level),
        "priority": _diff(priority),
    }
    return _event(event_id, data, window_size, dp_rank)


def encode_drain(events: Sequence[JsonDict]) -> bytes:
    """The ``POST /kv_cache_events`` response body: a compact JSON array, as Starlette renders it."""
    return json.dumps(list(events), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
        "utf-8"
    )
