"""An SGLang/vLLM ZMQ event *encoder* and SGLang's reference page hash (test-only, pure).

Written from docs/reference/engine-events.md §1.3–§1.4 and §2.4 independently of
``balancer.engines.sglang``, so that the golden tests catch drift between what the engines send and
what the decoder reads. The golden cases built with it live in ``sglang_cases.py``.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

TOPIC = b"kv-events"
MASK64 = (1 << 64) - 1

# docs/reference/engine-events.md §1.4: frame 2 of the SGLang example (array era, medium + attn_dp_rank)
SPEC_SGLANG_HEX = (
    "93cb41d954fc402000009497ab426c6f636b53746f72656491d3cf97adeedb59e05bc0940102030404c0a3475055"
    "97ab426c6f636b53746f72656491d3cb701dbfc2cfd592d3cf97adeedb59e05b940506070804c0a347505593ac426c"
    "6f636b52656d6f76656491d3cb701dbfc2cfd592a347505591b0416c6c426c6f636b73436c656172656400"
)
SPEC_SGLANG_HASHES = (-3488128144981237669, -3787494577174227566)
SPEC_VLLM_TOKENS = [
    151644,
    872,
    198,
    9064,
    374,
    279,
    6722,
    315,
    5616,
    30,
    151645,
    198,
    151644,
    77091,
    198,
    151667,
]
SPEC_VLLM_HASH = 15760518052499183552


# --------------------------------------------------------------------------- reference hashes


SGLANG_SALT_DOMAIN = b"sglang-cache-salt-v1\x00"
"""§1.3, checked against SGLang 0.5.23: a salted request's event-hash chain is seeded with
SHA-256(this || UTF-8 salt) as the root page's prior digest (no extra-key framing)."""


def sglang_salt_seed(cache_salt: str) -> bytes:
    return hashlib.sha256(SGLANG_SALT_DOMAIN + cache_salt.encode("utf-8")).digest()


def sglang_page_digests(
    tokens: list[int],
    page_size: int,
    *,
    extra_key: str | None = None,
    bigram: bool = False,
    prior: bytes | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """SGLang's chained SHA-256 page digests (§2.4); full pages and a trailing partial one.

    ``cache_salt`` seeds a root chain as SGLang 0.5.23 does (:func:`sglang_salt_seed`)."""
    if cache_salt is not None:
        assert prior is None, "a salt seeds a root chain"
        prior = sglang_salt_seed(cache_salt)
    units: list[tuple[int, ...]] = (
        [(tokens[j], tokens[j + 1]) for j in range(len(tokens) - 1)] if bigram else [(t,) for t in tokens]
    )
    digests: list[bytes] = []
    for start in range(0, len(units), page_size):
        sha = hashlib.sha256()
        if extra_key is not None:
            raw = extra_key.encode("utf-8")
            sha.update(struct.pack("<I", len(raw)) + raw)
        if prior is not None:
            sha.update(prior)
        for unit in units[start : start + page_size]:
            for token in unit:
                sha.update(struct.pack("<I", token))
        prior = sha.digest()
        digests.append(prior)
    return digests


def sglang_i64(digest: bytes) -> int:
    """SGLang's event hash: the first 8 digest bytes as a signed big-endian int."""
    return int.from_bytes(digest[:8], "big", signed=True)


def sglang_page_hashes(tokens: list[int], page_size: int, **kwargs: Any) -> list[int]:
    return [sglang_i64(d) for d in sglang_page_digests(tokens, page_size, **kwargs)]


def u64(value: int | bytes | str) -> int:
    """What every engine hash means once normalised (§1.3): ints wrap, bytes/hex keep 64 bits."""
    if isinstance(value, bytes):
        return int.from_bytes(value[len(value) - 8 :], "big")
    if isinstance(value, str):
        return int(value[:16], 16)
    return value % (1 << 64)


# --------------------------------------------------------------------------- encoder


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)


def live_frames(payload: bytes, seq: int, topic: bytes = TOPIC) -> list[bytes]:
    """A PUB message: ``[topic, seq, payload]``."""
    return [topic, seq_frame(seq), payload]


def batch_array(ts: float, events: list[Any], dp_rank: int | None = 0, *, legacy: bool = False) -> bytes:
    """``EventBatch`` with ``array_like``: ``[ts, events, rank]`` (``[ts, events]`` when legacy)."""
    return msgpack.packb([ts, events] if legacy else [ts, events, dp_rank])


def batch_map(ts: float, events: list[Any], dp_rank: int | None, rank_field: str) -> bytes:
    """``EventBatch`` without ``array_like`` (vLLM main): a map envelope."""
    return msgpack.packb({"ts": ts, "events": events, rank_field: dp_rank})


def sglang_stored(
    hashes: list[Any],
    parent: Any,
    token_ids: list[Any],
    block_size: int,
    *,
    medium: str | None = "GPU",
    salt: str | None = None,
    legacy: bool = False,
) -> list[Any]:
    """SGLang positional ``BlockStored``; ``legacy`` predates ``medium``; a salt adds ``metadata``."""
    event: list[Any] = ["BlockStored", hashes, parent, token_ids, block_size, None]
    if not legacy:
        event.append(medium)
    if salt is not None:
        event.append({"cache_salt": salt})
    return event


def vllm_stored(
    hashes: list[Any],
    parent: Any,
    token_ids: list[int],
    block_size: int,
    *,
    lora_id: int | None = None,
    lora_name: str | None = None,
    extra_keys: list[Any] | None = None,
    group_idx: int = 0,
    kind: str = "full_attention",
    medium: str = "GPU",
) -> list[Any]:
    """vLLM positional ``BlockStored`` (12 elements with the tag, vLLM ~0.11–0.23)."""
    keys = extra_keys if extra_keys is not None else [None] * len(hashes)
    return [
        "BlockStored",
        hashes,
        parent,
        token_ids,
        block_size,
        lora_id,
        medium,
        lora_name,
        keys,
        group_idx,
        kind,
        None,
    ]


def tagged(tag: str, **fields: Any) -> dict[str, Any]:
    """A map-encoded event (SGLang 0.5.23, vLLM ≥ 0.26): the tag under ``type``."""
    return {"type": tag, **fields}


def sglang_map_stored(
    hashes: list[Any],
    parent: Any,
    token_ids: list[Any],
    block_size: int,
    *,
    medium: str | None = "GPU",
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """SGLang 0.5.23's ``BlockStored`` map (§1.3): ``lora_id`` always, ``medium`` and the top-level
    ``cache_salt`` only when set (msgspec ``omit_defaults``)."""
    event = tagged(
        "BlockStored",
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=None,
    )
    if medium is not None:
        event["medium"] = medium
    if cache_salt is not None:
        event["cache_salt"] = cache_salt
    return event


# --------------------------------------------------------------------------- expectations


def exp_stored(
    hashes: list[Any],
    parent: Any,
    tokens: list[int],
    block_size: int,
    *,
    dp_rank: int = 0,
    lookahead: int = 0,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    return {
        "kind": "stored",
        "dp_rank": dp_rank,
        "parent": None if parent is None else u64(parent),
        "engine_hashes": [u64(h) for h in hashes],
        "tokens": tokens,
        "block_size": block_size,
        "lookahead_tokens": lookahead,
        "lora_name": lora_name,
        "cache_salt": cache_salt,
    }


def exp_removed(hashes: list[Any], dp_rank: int = 0) -> dict[str, Any]:
    return {"kind": "removed", "dp_rank": dp_rank, "engine_hashes": [u64(h) for h in hashes]}


def exp_cleared(dp_rank: int = 0) -> dict[str, Any]:
    return {"kind": "cleared", "dp_rank": dp_rank}


def expect(
    events: list[dict[str, Any]],
    *,
    seq: int,
    ts: float,
    dp_rank: int | None = 0,
    epoch: str | None = None,
    ignored: int = 0,
    errors: int = 0,
) -> dict[str, Any]:
    return {
        "seq": seq,
        "timestamp": ts,
        "dp_rank": dp_rank,
        "epoch": epoch,
        "ignored": ignored,
        "errors": errors,
        "events": events,
    }


@dataclass(frozen=True)
class Case:
    name: str
    description: str
    frames: list[bytes]
    expected: dict[str, Any]
