"""SGLang and vLLM KV-event wire encoding and SGLang's page hash, for the emulator (pure).

Produces the bytes a real publisher sends on its ZMQ PUB socket: three frames ``[topic, seq8, payload]``
(and on its ROUTER replay socket ``[b"", topic, seq8, payload]`` per batch, then :data:`REPLAY_END`)
where ``payload`` is msgpack of the envelope ``[ts, events, dp_rank]`` and each event is either a tagged
map (``{"type": "BlockStored", ...}``, SGLang 0.5.23 and vLLM 0.32.0 as captured) or a positional array
(``["BlockStored", f1, f2, ...]``, the older msgspec ``array_like`` era). Plain ``msgpack.packb`` with
``use_bin_type=True`` gives the same bytes as msgspec for these payloads (float64 timestamps, smallest
integer forms, str8 for 32..255-byte strings); the unit tests prove it on every real capture frame.

SGLang's page hash, reproduced from the captures' tokens: ``digest_i = SHA-256([LE u32
len(extra_key) || extra_key] || digest_{i-1} || LE u32 tokens)``, event hash = first 8 digest bytes,
big-endian, **signed** i64. Bigram (EAGLE) pages hash token pairs. A salted request's chain (SGLang
0.5.23's published event hashes) starts from :func:`salt_seed` instead of no prior digest, with no
``extra_key`` framing. (Whole-prompt chains, which only the tests need, are in ``tests/wire_hashes.py``.)

SGLang 0.5.23's events are msgspec structs with ``omit_defaults``: a ``BlockStored`` map always carries
``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size`` and ``lora_id`` (no default),
and ``medium`` and ``cache_salt`` only when set (docs/reference/engine-events.md §1.3).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, Final, Literal

import msgpack

Flavor = Literal["sglang", "vllm"]
Encoding = Literal["map", "array"]
TokenUnits = Sequence[int] | Sequence[tuple[int, int]]

SEQ_BYTES: Final = 8
"""Width of the big-endian sequence number frame."""
EPOCH_MARKER: Final = b"\x00sgl-kv-epoch="
"""Appended to the topic frame, then the epoch, by SGLang publishers that serve snapshots."""
REPLAY_END_SEQ: Final = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
"""The seq frame of the replay end marker: ``ff`` × 8."""
REPLAY_END: Final[list[bytes]] = [b"", b"", REPLAY_END_SEQ, b""]
"""The frames a replay server sends after the last replayed batch (as a DEALER sees them): an empty
topic, seq ``-1`` and an empty payload (SGLang 0.5.23 and vLLM 0.32, docs/reference/engine-events.md §1.2)."""

SALT_SEED_DOMAIN: Final = b"sglang-cache-salt-v1\x00"
"""What SGLang 0.5.23 hashes before a request's cache salt to seed that request's page-hash chain."""

_U64_MASK: Final = (1 << 64) - 1
_I64_SIGN_BIT: Final = 1 << 63
_DIGEST_BYTES: Final = 32
_VLLM_SPEC_KIND: Final = "full_attention"


# ---------------------------------------------------------------------------------------------- hashes


def _flat_units(units: TokenUnits) -> list[int]:
    """Tokens in the order SGLang feeds them to SHA-256 (a pair contributes both of its tokens)."""
    flat: list[int] = []
    for unit in units:
        if isinstance(unit, int):
            flat.append(unit)
        else:
            first, second = unit
            flat.extend((first, second))
    return flat


def page_digest(prior: bytes | None, units: TokenUnits, extra_key: str | None = None) -> bytes:
    """SGLang's SHA-256 digest of one page chained to the previous page's digest (``None``: root).

    ``units`` are token ids, or ``(t_j, t_j+1)`` pairs in bigram mode; each token is fed as LE u32.
    ``extra_key`` (a LoRA or cache-salt namespace) is fed first as LE u32 byte length + UTF-8 bytes.
    """
    if prior is not None and len(prior) != _DIGEST_BYTES:
        raise ValueError(f"prior digest must be {_DIGEST_BYTES} bytes, got {len(prior)}")
    sha = hashlib.sha256()
    if extra_key is not None:
        key = extra_key.encode("utf-8")
        sha.update(struct.pack("<I", len(key)))
        sha.update(key)
    if prior is not None:
        sha.update(prior)
    flat = _flat_units(units)
    sha.update(struct.pack(f"<{len(flat)}I", *flat))
    return sha.digest()


def salt_seed(cache_salt: str) -> bytes:
    """The prior digest of a salted request's root page in SGLang 0.5.23's event hashes:
    ``SHA-256(b"sglang-cache-salt-v1\\0" || UTF-8 salt)``. Unsalted chains start from no prior digest."""
    return hashlib.sha256(SALT_SEED_DOMAIN + cache_salt.encode("utf-8")).digest()


def digest_to_i64(digest: bytes) -> int:
    """SGLang's event hash of a page digest: its first 8 bytes as a big-endian signed i64."""
    return int.from_bytes(digest[:8], "big", signed=True)


# --------------------------------------------------------------------------------------------- events


def _wire_tokens(token_ids: TokenUnits) -> tuple[list[int] | list[list[int]], bool]:
    """Token ids as msgpack-ready lists, and whether they are bigram pairs."""
    flat: list[int] = []
    pairs: list[list[int]] = []
    for unit in token_ids:
        if isinstance(unit, int):
            flat.append(unit)
        else:
            first, second = unit
            pairs.append([first, second])
    if flat and pairs:
        raise ValueError("token_ids mixes plain tokens and bigram pairs")
    if pairs:
        return pairs, True
    return flat, False


def _check_shape(block_count: int, unit_count: int, block_size: int) -> None:
    """One hash per ``block_size`` units; only the last block may be short."""
    if block_count <= 0 or block_size <= 0:
        raise ValueError(f"need at least one block hash and a positive block_size, got {block_size}")
    if not (block_count - 1) * block_size < unit_count <= block_count * block_size:
        raise ValueError(
            f"{unit_count} token units do not fill {block_count} blocks of {block_size} (last may be short)"
        )


class KvEventEncoder:
    """Builds KV events and batch payloads shaped exactly as one engine flavour publishes them.

    ``flavor`` selects the field set: SGLang (``lora_id``, ``medium``; hashes as signed i64) or vLLM
    (adds ``lora_name``, ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``; hashes as unsigned
    u64). ``encoding`` selects tagged maps (current engines) or positional arrays (msgspec
    ``array_like``, where every declared field is always present).
    ``envelope`` is ``"array"`` (every release seen) or ``"map"`` (an unreleased vLLM main).

    SGLang maps are 0.5.23's: a salt is the top-level ``cache_salt`` field, and ``medium`` and
    ``cache_salt`` are left out when ``None`` (``omit_defaults``). SGLang arrays are the older
    positional era, where a salt is the trailing ``metadata: {cache_salt}`` of
    ``BlockStoredWithMetadata`` and ``medium`` is always present.

    Not confirmed by a capture: vLLM's ``extra_keys`` with a LoRA or salt (LoRA name, then salt on
    block 0).
    """

    def __init__(
        self, *, flavor: Flavor = "sglang", encoding: Encoding = "map", envelope: Encoding = "array"
    ) -> None:
        if flavor not in ("sglang", "vllm"):
            raise ValueError(f"unknown flavor {flavor!r}")
        if encoding not in ("map", "array") or envelope not in ("map", "array"):
            raise ValueError(f"unknown encoding {encoding!r} / envelope {envelope!r}")
        self.flavor: Flavor = flavor
        self.encoding: Encoding = encoding
        self.envelope: Encoding = envelope

    def _wire_hash(self, value: int) -> int:
        """A hash as this flavour puts it on the wire: SGLang signed i64, vLLM unsigned u64."""
        unsigned = value & _U64_MASK
        if self.flavor == "sglang" and unsigned >= _I64_SIGN_BIT:
            return unsigned - (1 << 64)
        return unsigned

    def _shape(self, tag: str, fields: dict[str, Any]) -> object:
        if self.encoding == "map":
            return {"type": tag, **fields}
        return [tag, *fields.values()]

    def block_stored(
        self,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: TokenUnits,
        block_size: int,
        *,
        medium: str | None = "GPU",
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> object:
        """A ``BlockStored`` event for a chain of blocks (block 0's parent is ``parent_block_hash``).

        ``token_ids`` concatenates the blocks' tokens (pairs in SGLang bigram mode, where ``block_size``
        counts pairs). SGLang carries no ``lora_name`` (its LoRA namespace lives in the hash only).
        """
        tokens, bigram = _wire_tokens(token_ids)
        _check_shape(len(block_hashes), len(tokens), block_size)
        fields: dict[str, Any] = {
            "block_hashes": [self._wire_hash(value) for value in block_hashes],
            "parent_block_hash": None if parent_block_hash is None else self._wire_hash(parent_block_hash),
            "token_ids": tokens,
            "block_size": block_size,
            "lora_id": None,
            "medium": medium,
        }
        if self.flavor == "sglang":
            if lora_name is not None:
                raise ValueError("SGLang BlockStored has no lora_name field")
            if self.encoding == "array":
                if cache_salt is not None:
                    fields["metadata"] = {"cache_salt": cache_salt}
                return self._shape("BlockStored", fields)
            if medium is None:
                del fields["medium"]  # 0.5.23: omit_defaults
            if cache_salt is not None:
                fields["cache_salt"] = cache_salt
            return self._shape("BlockStored", fields)
        if bigram:
            raise ValueError("vLLM BlockStored carries plain token ids, not bigram pairs")
        fields["lora_name"] = lora_name
        fields["extra_keys"] = _vllm_extra_keys(
            len(block_hashes), root=parent_block_hash is None, cache_salt=cache_salt, lora_name=lora_name
        )
        fields["group_idx"] = 0
        fields["kv_cache_spec_kind"] = _VLLM_SPEC_KIND
        if self.encoding == "array":
            fields["kv_cache_spec_sliding_window"] = None
        return self._shape("BlockStored", fields)

    def block_removed(self, block_hashes: Sequence[int], *, medium: str | None = "GPU") -> object:
        """A ``BlockRemoved`` event (evictions, by engine hash)."""
        if not block_hashes:
            raise ValueError("BlockRemoved needs at least one hash")
        fields: dict[str, Any] = {
            "block_hashes": [self._wire_hash(value) for value in block_hashes],
            "medium": medium,
        }
        if self.flavor == "vllm":
            fields["group_idx"] = 0
        elif self.encoding == "map" and medium is None:
            del fields["medium"]  # SGLang 0.5.23: omit_defaults
        return self._shape("BlockRemoved", fields)

    def all_blocks_cleared(self) -> object:
        """An ``AllBlocksCleared`` event (cache flush or reset)."""
        return self._shape("AllBlocksCleared", {})

    def batch(self, ts: float, events: Sequence[object], dp_rank: int | None) -> bytes:
        """The msgpack payload (frame 3) of one batch; ``ts`` in seconds since the epoch."""
        body: object
        if self.envelope == "array":
            body = [float(ts), list(events), dp_rank]
        else:
            rank_key = "attn_dp_rank" if self.flavor == "sglang" else "data_parallel_rank"
            body = {"ts": float(ts), "events": list(events), rank_key: dp_rank}
        payload: bytes = msgpack.packb(body, use_bin_type=True)
        return payload


def _vllm_extra_keys(
    block_count: int, *, root: bool, cache_salt: str | None, lora_name: str | None
) -> list[list[str] | None]:
    """vLLM's per-block ``extra_keys``: LoRA name on every block, cache salt on the request's first."""
    keys: list[list[str] | None] = []
    for index in range(block_count):
        block_keys = [lora_name] if lora_name is not None else []
        if index == 0 and root and cache_salt is not None:
            block_keys.append(cache_salt)
        keys.append(block_keys or None)
    return keys


# -------------------------------------------------------------------------------------------- framing


def _seq_bytes(seq: int) -> bytes:
    if not 0 <= seq <= _U64_MASK:
        raise ValueError(f"sequence number out of u64 range: {seq}")
    return seq.to_bytes(SEQ_BYTES, "big")


def frames(topic: str, seq: int, payload: bytes, *, epoch: str | None = None) -> list[bytes]:
    """The three PUB frames of one batch; ``epoch`` adds SGLang's ``\\x00sgl-kv-epoch=`` topic suffix."""
    head = topic.encode("utf-8")
    if epoch is not None:
        head += EPOCH_MARKER + epoch.encode("utf-8")
    return [head, _seq_bytes(seq), payload]


def replay_reply(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """One replayed batch as a ROUTER sends it after the client identity: ``[b"", topic, seq8,
    payload]`` (SGLang 0.5.23 and vLLM 0.32 carry the topic frame; older notes showed 3 frames)."""
    return [b"", topic.encode("utf-8"), _seq_bytes(seq), payload]


def parse_replay_request(request_frames: Sequence[bytes]) -> int:
    """Start sequence of a replay request as a ROUTER receives it: ``[identity, b"", seq8]``.

    Raises ``ValueError`` on any other framing (missing delimiter, wrong frame count, seq not 8 bytes).
    """
    if len(request_frames) != 3:
        raise ValueError(f"replay request needs 3 frames [identity, b'', seq8], got {len(request_frames)}")
    identity, delimiter, seq = (bytes(frame) for frame in request_frames)
    if not identity:
        raise ValueError("replay request has an empty identity frame")
    if delimiter != b"":
        raise ValueError("replay request lacks the empty delimiter frame")
    if len(seq) != SEQ_BYTES:
        raise ValueError(f"replay start seq must be {SEQ_BYTES} bytes, got {len(seq)}")
    return int.from_bytes(seq, "big")
