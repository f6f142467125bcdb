"""SGLang: the ZMQ KV-event decoder vLLM shares, and SGLang's :data:`SPEC` (pure: no I/O, no clock).

One message is ``[topic, seq, payload]`` from a PUB socket, or ``[seq, payload]`` from a replay
reply once the DEALER's empty delimiter is stripped. ``seq`` is 8 bytes big-endian; ``payload`` is a
msgpack ``EventBatch``: an array ``[ts, events]`` / ``[ts, events, dp_rank]`` or a map ``{"ts",
"events", "data_parallel_rank" | "attn_dp_rank"}``. Newer SGLang appends ``\\0sgl-kv-epoch=<hex>``
(and ``\\0sgl-kv-snapshot=<id>``) to the topic; the epoch is reported in ``DecodedBatch.epoch``.

Events are positional arrays ``["BlockStored", ...]`` (older builds) or tagged maps ``{"type": ...}``
(SGLang 0.5.23, vLLM ≥ 0.26). What is kept:

* hashes: signed i64 (SGLang) or u64 (vLLM) ints, vLLM ``bytes`` digests (last 8 bytes, big-endian)
  and hex strings (first 16 hex digits), all normalised to u64;
* ``token_ids``: ints, or SGLang EAGLE bigram pairs ``[[t0, t1], [t1, t2], ...]`` that become raw
  tokens plus one look-ahead token;
* only the GPU tier (``medium`` ``None``/``"GPU"``) and only vLLM's main full-attention KV-cache
  group (the first group seen with ``kv_cache_spec_kind == "full_attention"``, else group 0);
* a trailing partial block is dropped; so are blocks the router cannot namespace (a LoRA named only
  by ``lora_id``, vLLM ``extra_keys`` other than the LoRA name or the salt, e.g. multimodal).

Index 7 of a positional ``BlockStored`` is vLLM's ``lora_name`` (a string) or SGLang's salted
``metadata`` map (``{"cache_salt": ...}``): the type decides. A map carries the salt as SGLang 0.5.23's
top-level ``cache_salt`` or, in older maps, as that ``metadata`` map (which wins when both are there).
The only state is the learned vLLM main group, so one decoder serves one replica.

Messages of the common shape decode through a typed ``msgspec`` schema first
(:mod:`balancer.engines.sglang_typed`), with the same outcome as the generic path. The sources'
decoder (:func:`chain_decoder`) also merges each run of one-block stores, each the parent of the
next (SGLang publishes one per page), into one ``Stored(chained=True)``.

SGLang's spec: plain alignment (EAGLE: bigram pages), 16 tokens per page by default, ZMQ events per DP
rank with replay, load from ``/v1/loads`` (else Prometheus ``/metrics``, else ``/get_load``: parsed
in :mod:`balancer.engines.sglang_load`), and its page hashes (:func:`page_hashes`), with which
receipts teach the index pages whose events were lost.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from string import hexdigits
from typing import Any, cast

import msgpack

from balancer.engines import DecodedBatch
from balancer.engines.sglang_load import SCRAPE_TARGETS
from balancer.engines.sglang_typed import TypedEvent, TypedStored, chain_runs, decode_typed, fields_of
from balancer.engines.spec import EngineSpec
from balancer.errors import EventDecodeError
from balancer.events import Cleared, KvEvent, Removed, Stored
from balancer.index.hashing import pack_tokens
from balancer.types import U64_MASK, EngineHash

SEQ_BYTES = 8
REPLAY_END_SEQ = b"\xff" * SEQ_BYTES
"""A replay reply ends with seq ``-1`` (signed) and an empty payload."""

_EPOCH_PREFIX = b"sgl-kv-epoch="
_I64_MIN = -(1 << 63)
_HEX = frozenset(hexdigits)
_GPU_MEDIA = (None, "GPU")
_FULL_ATTENTION = "full_attention"

# Positional field names after the tag; index 7 (``None`` here) is resolved by type.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    None,
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_STORED_MIN_FIELDS = 4
_REMOVED_MIN_FIELDS = 1


class _Malformed(Exception):
    """One event is unusable; the message says why (it ends up in ``DecodedBatch.errors``)."""


class SglangDecoder:
    """Decodes SGLang and vLLM ZMQ messages into engine-neutral events.

    ``block_size``: the pool's tokens per block, when known. A single-page ``BlockStored`` with a
    smaller ``block_size`` is SGLang's short trailing page and is ignored; any other mismatch is a
    malformed event. ``None`` accepts every block size (the index checks it against the pool).
    """

    engine: str = "sglang"

    def __init__(self, block_size: int | None = None, *, typed: bool = True, chain: bool = False) -> None:
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.typed = typed
        """Decode the common shape with the typed schema first (:mod:`.sglang_typed`); ``False``:
        every message takes the generic path (the same outcome, slower: the tests compare them)."""
        self.chain = chain
        """Merge each run of plain one-block stores that chain into one ``chained`` ``Stored``
        (typed path only; :func:`balancer.events.split_chained` gives the events back). Off by
        default: the decoder contract is one event per engine event."""
        self._main_group: int | None = None

    def decode(self, frames: Sequence[bytes]) -> DecodedBatch:
        """Decode one ZMQ message; raises ``EventDecodeError`` when the message as a whole is unusable."""
        topic, seq_frame, payload = _split_frames(frames)
        if len(seq_frame) != SEQ_BYTES:
            raise EventDecodeError("frame", f"sequence frame is {len(seq_frame)} bytes, expected 8")
        if seq_frame == REPLAY_END_SEQ and not payload:
            raise EventDecodeError("replay_end", "replay END marker, not a batch")
        typed = decode_typed(payload) if self.typed else None
        if typed is not None and typed.dp_rank is not None and typed.dp_rank < 0:
            typed = None  # the generic checks report it
        handle: Callable[[Any, int], tuple[KvEvent | None, int]]
        if typed is not None:
            timestamp, raw_events, dp_rank = typed.ts, typed.events, typed.dp_rank
            handle = self._typed_event
        else:  # another shape: the generic decode, whose checks raise for a bad envelope
            timestamp, raw_events, dp_rank = _envelope(_unpack(payload))
            handle = self._event
        rank = 0 if dp_rank is None else dp_rank
        events: list[KvEvent] = []
        errors: list[str] = []
        if typed is not None and self.chain:
            ignored = self._chained_events(typed.events, rank, events, errors)
        else:
            ignored = self._events(raw_events, handle, rank, events, errors)
        return DecodedBatch(
            events=events,
            seq=int.from_bytes(seq_frame, "big"),
            dp_rank=dp_rank,
            timestamp=timestamp,
            epoch=_epoch(topic),
            ignored=ignored,
            errors=tuple(errors),
        )

    def _events(
        self,
        raw_events: Sequence[Any],
        handle: Callable[[Any, int], tuple[KvEvent | None, int]],
        rank: int,
        events: list[KvEvent],
        errors: list[str],
        offset: int = 0,
    ) -> int:
        """Decode ``raw_events`` (the envelope's from ``offset`` on) one by one into ``events`` and
        ``errors``; returns how many things they dropped on purpose."""
        ignored = 0
        for position, raw in enumerate(raw_events, offset):
            try:
                decoded, dropped = handle(raw, rank)
            except _Malformed as exc:
                errors.append(f"event {position}: {exc}")
                continue
            ignored += dropped
            if decoded is not None:
                events.append(decoded)
        return ignored

    def _chained_events(
        self, raw_events: list[TypedEvent], rank: int, events: list[KvEvent], errors: list[str]
    ) -> int:
        """:meth:`_events` of a typed envelope, but each run of plain one-block stores, each the
        parent of the next (:func:`chain_runs`), becomes one ``chained`` :class:`Stored` (what
        :func:`split_chained` turns back into the events decoded one by one). Its tokens are packed
        once, for the run; if they do not pack, its events are decoded one by one (their errors are
        theirs to report)."""
        ignored = 0
        for start, end, hashes, tokens in chain_runs(raw_events, self.block_size):
            if end - start > 1:
                try:
                    packed = pack_tokens(tokens)
                except (OverflowError, TypeError):
                    pass
                else:
                    first = cast(TypedStored, raw_events[start])
                    parent = first.parent_block_hash
                    root = None if parent is None else EngineHash(parent & U64_MASK)
                    chain = cast("tuple[EngineHash, ...]", tuple(hashes))
                    events.append(Stored(rank, root, chain, packed, first.block_size, 0, None, None, True))
                    continue
            ignored += self._events(raw_events[start:end], self._typed_event, rank, events, errors, start)
        return ignored

    def _event(self, raw: object, rank: int) -> tuple[KvEvent | None, int]:
        """One event and how many things it dropped on purpose (unknown tag, partial page, ...)."""
        if isinstance(raw, dict):
            tag = raw.get("type")
            fields: Mapping[Any, Any] = raw
        elif isinstance(raw, list) and raw:
            tag = raw[0]
            fields = {}
        else:
            raise _Malformed(f"event is {type(raw).__name__}, expected a tagged array or map")
        if not isinstance(tag, str):
            raise _Malformed("event tag is not a string")
        if tag == "BlockStored":
            if isinstance(raw, list):
                fields = _positional_stored(raw)
            return self._stored(fields, rank)
        if tag == "BlockRemoved":
            if isinstance(raw, list):
                fields = _positional(raw, _REMOVED_FIELDS, _REMOVED_MIN_FIELDS)
            return self._removed(fields, rank)
        if tag == "AllBlocksCleared":
            return (Cleared(rank), 0) if _on_gpu(fields) else (None, 1)
        return None, 1

    def _typed_event(self, event: object, rank: int) -> tuple[KvEvent | None, int]:
        """One event of a typed envelope: a common ``BlockStored`` here (:meth:`_plain_stored`),
        every other through the generic checks, with the same outcome."""
        if type(event) is TypedStored:
            stored = self._plain_stored(event, rank)
            if stored is not None:
                return stored
        return self._event(fields_of(cast(TypedEvent, event)), rank)

    def _plain_stored(self, event: TypedStored, rank: int) -> tuple[Stored | None, int] | None:
        """What :meth:`_stored` gives for a store without LoRA or salt on the GPU tier (SGLang's,
        or vLLM's of the main KV-cache group, without extra keys) in fewer steps, its checks in its
        order; ``None`` for any other store, or one whose tokens do not pack: ``_stored`` decides
        those (the main-group check it repeats is idempotent)."""
        if not (
            event.lora_id is None
            and event.lora_name is None
            and event.cache_salt is None
            and event.metadata is None
            and (event.medium is None or event.medium == "GPU")
        ):
            return None
        group, kind = event.group_idx, event.kv_cache_spec_kind
        if (group is not None or kind is not None) and not self._in_main_group(group, kind, stored=True):
            return None, 1
        hashes, tokens, block_size = event.block_hashes, event.token_ids, event.block_size
        if not (hashes and tokens and block_size > 0) or (self.block_size not in (None, block_size)):
            return None
        count, dropped = _full_blocks(len(tokens), block_size, len(hashes))
        extra = event.extra_keys  # vLLM: None per block without extra keys
        if extra is not None and (type(extra) is not list or any(keys is not None for keys in extra[:count])):
            return None
        if count == 0:
            return None, 1
        used = count * block_size
        try:
            packed = pack_tokens(tokens if used == len(tokens) else tokens[:used])
        except (OverflowError, TypeError):
            return None
        parent = event.parent_block_hash
        stored = Stored(
            rank,
            None if parent is None else EngineHash(parent & U64_MASK),
            tuple([EngineHash(engine_hash & U64_MASK) for engine_hash in hashes[:count]]),
            packed,
            block_size,
        )
        return stored, dropped

    def _stored(self, fields: Mapping[Any, Any], rank: int) -> tuple[Stored | None, int]:
        group, kind = fields.get("group_idx"), fields.get("kv_cache_spec_kind")
        if not (_on_gpu(fields) and self._in_main_group(group, kind, stored=True)):
            return None, 1
        hashes = _hashes(fields.get("block_hashes"))
        parent_raw = fields.get("parent_block_hash")
        parent = None if parent_raw is None else _hash(parent_raw)
        block_size = fields.get("block_size")
        if type(block_size) is not int or block_size <= 0:
            raise _Malformed("block_size is not a positive int")
        tokens, lookahead = _tokens(fields.get("token_ids"))
        count, dropped = _full_blocks(len(tokens) - lookahead, block_size, len(hashes))
        if self.block_size is not None and block_size != self.block_size:
            if len(hashes) == 1 and block_size < self.block_size:
                return None, 1
            raise _Malformed(
                f"block_size {block_size} != this replica's block_size {self.block_size}: set the "
                f"replica's block_size to {block_size}, the engine's page size (SGLang --page-size, "
                "vLLM --block-size)"
            )
        lora_name, cache_salt = _namespace(fields)
        if fields.get("lora_id") is not None and lora_name is None:
            return None, 1  # a LoRA the router cannot name: its keys would alias the base model
        count = _namespaced_prefix(fields.get("extra_keys"), count, (lora_name, cache_salt))
        if count == 0:
            return None, 1
        used = count * block_size + lookahead
        try:
            packed = pack_tokens(tokens if used == len(tokens) else tokens[:used])
        except (OverflowError, TypeError) as exc:
            raise _Malformed("token_ids are not u32 ints") from exc
        # positional arguments: this runs once per event and keywords double its cost
        stored = Stored(rank, parent, hashes[:count], packed, block_size, lookahead, lora_name, cache_salt)
        return stored, dropped + (count < len(hashes) - dropped)

    def _removed(self, fields: Mapping[Any, Any], rank: int) -> tuple[Removed | None, int]:
        group, kind = fields.get("group_idx"), fields.get("kv_cache_spec_kind")
        if not (_on_gpu(fields) and self._in_main_group(group, kind, stored=False)):
            return None, 1
        hashes = _hashes(fields.get("block_hashes"))
        return Removed(rank, hashes), 0

    def _in_main_group(self, group: object, kind: object, *, stored: bool) -> bool:
        """vLLM hybrid models publish one event per KV-cache group; keep the main full-attention one.

        Groups share block hashes, so keeping a sliding-window group's removals would evict blocks
        the full-attention group still holds. Only ``BlockStored`` names the kind, so the main group
        is learned from it; before that, group 0 (or no group at all) is the main one. ``group``
        and ``kind``: the event's ``group_idx`` and ``kv_cache_spec_kind``.
        """
        if group is None and kind is None:
            return True
        if group is not None and type(group) is not int:
            raise _Malformed("group_idx is not an int")
        if kind is not None and not isinstance(kind, str):
            raise _Malformed("kv_cache_spec_kind is not a string")
        if stored and kind is not None:
            if kind != _FULL_ATTENTION:
                return False
            if group is not None and self._main_group is None:
                self._main_group = group
        if group is None:
            return True
        return group == (0 if self._main_group is None else self._main_group)


def _split_frames(frames: Sequence[bytes]) -> tuple[bytes | None, bytes, bytes]:
    if not isinstance(frames, Sequence) or isinstance(frames, bytes | bytearray | str):
        raise EventDecodeError("frame", "frames must be a sequence of byte strings")
    if not all(isinstance(frame, bytes | bytearray | memoryview) for frame in frames):
        raise EventDecodeError("frame", "every frame must be bytes")
    if len(frames) == 3:
        return bytes(frames[0]), bytes(frames[1]), bytes(frames[2])
    if len(frames) == 2:  # replay reply: [seq, payload]
        return None, bytes(frames[0]), bytes(frames[1])
    raise EventDecodeError("frame", f"{len(frames)} frames, expected [topic, seq, payload] or [seq, payload]")


def _epoch(topic: bytes | None) -> str | None:
    """The ``sgl-kv-epoch`` value in the NUL-separated topic metadata, if any."""
    if not topic or b"\x00" not in topic:
        return None
    for part in topic.split(b"\x00")[1:]:
        if part.startswith(_EPOCH_PREFIX):
            return part[len(_EPOCH_PREFIX) :].decode("utf-8", "replace") or None
    return None


def _unpack(payload: bytes) -> object:
    if not payload:
        raise EventDecodeError("msgpack", "empty payload")
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many unrelated types for corrupt input
        raise EventDecodeError("msgpack", f"{type(exc).__name__}: {exc}"[:200]) from exc


def _envelope(batch: object) -> tuple[float | None, list[Any], int | None]:
    """``(ts, events, dp_rank)`` from an array or map ``EventBatch``."""
    if isinstance(batch, list) and len(batch) >= 2:
        timestamp, events = batch[0], batch[1]
        dp_rank = batch[2] if len(batch) > 2 else None
    elif isinstance(batch, dict):
        timestamp, events = batch.get("ts"), batch.get("events")
        dp_rank = batch.get("data_parallel_rank", batch.get("attn_dp_rank"))
    else:
        raise EventDecodeError("schema", f"batch is {type(batch).__name__}, expected [ts, events, dp_rank]")
    if not isinstance(events, list):
        raise EventDecodeError("schema", "batch events are not an array")
    if timestamp is not None and (type(timestamp) not in (int, float)):
        raise EventDecodeError("schema", "batch timestamp is not a number")
    if dp_rank is not None and (type(dp_rank) is not int or dp_rank < 0):
        raise EventDecodeError("schema", f"bad dp_rank {dp_rank!r:.40}")
    return (None if timestamp is None else float(timestamp)), events, dp_rank


def _positional(raw: list[Any], names: tuple[str | None, ...], minimum: int) -> dict[Any, Any]:
    if len(raw) - 1 < minimum:
        raise _Malformed(f"{raw[0]} has {len(raw) - 1} fields, expected at least {minimum}")
    return dict(zip(names, raw[1:], strict=False))


def _positional_stored(raw: list[Any]) -> dict[Any, Any]:
    fields = _positional(raw, _STORED_FIELDS, _STORED_MIN_FIELDS)
    if len(raw) > 7:
        fields["metadata" if isinstance(raw[7], dict) else "lora_name"] = raw[7]
    return fields


def _hash(value: object) -> EngineHash:
    if type(value) is int:
        if _I64_MIN <= value <= U64_MASK:
            return EngineHash(value & U64_MASK)
    elif isinstance(value, bytes):
        if value:
            return EngineHash(int.from_bytes(value[-8:], "big"))
    elif isinstance(value, str):
        head = value[:16]
        if head and _HEX.issuperset(head):
            return EngineHash(int(head, 16))
    raise _Malformed(f"bad block hash {value!r:.40}")


def _hashes(value: object) -> tuple[EngineHash, ...]:
    if not isinstance(value, list) or not value:
        raise _Malformed("block_hashes is not a non-empty array")
    return tuple([_hash(item) for item in value])


def _tokens(value: object) -> tuple[list[Any], int]:
    """Raw token ids and the look-ahead count (1 for bigram pairs); types are checked when packing."""
    if not isinstance(value, list) or not value:
        raise _Malformed("token_ids is not a non-empty array")
    if not isinstance(value[0], list):
        return value, 0
    if not all(isinstance(pair, list) and len(pair) == 2 for pair in value):
        raise _Malformed("bigram token_ids are not all [t, t_next] pairs")
    firsts = [pair[0] for pair in value]
    seconds = [pair[1] for pair in value]
    if firsts[1:] != seconds[:-1]:
        raise _Malformed("bigram pairs do not chain")
    firsts.append(seconds[-1])
    return firsts, 1


def _full_blocks(units: int, block_size: int, hash_count: int) -> tuple[int, int]:
    """``(full blocks, partial blocks dropped)``; a count fitting neither is malformed."""
    if units == hash_count * block_size:
        return hash_count, 0
    if (hash_count - 1) * block_size < units < hash_count * block_size:
        return hash_count - 1, 1
    raise _Malformed(f"{units} token units do not fit {hash_count} blocks of {block_size}")


def _optional_str(value: object, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _Malformed(f"{name} is not a string")


def _namespace(fields: Mapping[Any, Any]) -> tuple[str | None, str | None]:
    """``(lora_name, cache_salt)`` from vLLM ``lora_name`` and SGLang ``metadata``/``cache_salt``."""
    lora_name = fields.get("lora_name")
    cache_salt = fields.get("cache_salt")
    metadata = fields.get("metadata")
    if lora_name is None and cache_salt is None and metadata is None:
        return None, None  # the common case, kept cheap
    lora_name = _optional_str(lora_name, "lora_name")
    cache_salt = _optional_str(cache_salt, "cache_salt")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise _Malformed("metadata is not a map")
        cache_salt = _optional_str(metadata.get("cache_salt"), "metadata.cache_salt") or cache_salt
    return lora_name or None, cache_salt or None


def _namespaced_prefix(extra_keys: object, count: int, known: tuple[str | None, str | None]) -> int:
    """How many leading blocks carry only extra keys the router models (the LoRA name, the salt).

    vLLM hashes multimodal inputs and other extras into a block; tokens alone would alias such a
    block with a text-only one, so the chain is cut before the first block the router cannot key.
    """
    if extra_keys is None:
        return count
    if not isinstance(extra_keys, list):
        raise _Malformed("extra_keys is not an array")
    for position, keys in enumerate(extra_keys[:count]):
        if keys is None:
            continue
        if not isinstance(keys, list) or not all(isinstance(k, str) and k in known for k in keys):
            return position
    return count


def _on_gpu(fields: Mapping[Any, Any]) -> bool:
    medium = fields.get("medium")
    if medium in _GPU_MEDIA:
        return True
    if isinstance(medium, str):
        return False
    raise _Malformed("medium is not a string")


def page_hashes(token_ids: Sequence[int], tokens_per_page: int) -> list[EngineHash]:
    """SGLang's event hashes of the full pages of a plain token sequence (no LoRA, no salt, not
    bigram), chained from the root: a page's digest is SHA-256(the previous page's digest || its
    tokens as LE u32), its hash the digest's first 8 bytes big-endian (published as a signed i64,
    normalised to u64 as the decoder does). Checked on every page of the real SGLang 0.5.23 captures
    (``tests/golden/test_real_captures.py``). Costs one SHA-256 of 32 + 4 × ``tokens_per_page``
    bytes per page."""
    if tokens_per_page <= 0:
        raise ValueError(f"tokens_per_page must be > 0, got {tokens_per_page}")
    pages = len(token_ids) // tokens_per_page
    data = pack_tokens(token_ids[: pages * tokens_per_page])
    step = 4 * tokens_per_page
    sha256 = hashlib.sha256
    hashes: list[EngineHash] = []
    prior = b""
    for start in range(0, pages * step, step):
        prior = sha256(prior + data[start : start + step]).digest()
        hashes.append(EngineHash(int.from_bytes(prior[:8], "big")))
    return hashes


def chain_decoder(block_size: int) -> SglangDecoder:
    """The decoder of a replica's event sources: one :class:`SglangDecoder` that merges chained runs."""
    return SglangDecoder(block_size, chain=True)


SPEC = EngineSpec(
    name="sglang",
    decoder=SglangDecoder,
    chain_decoder=chain_decoder,
    align_mode="plain",
    bigram_align_mode="bigram",
    default_block_size=16,
    transport="zmq",
    scrape_targets=SCRAPE_TARGETS,
    resync_on_unclean_takeover=False,
    block_hashes=page_hashes,
    unasked_stream_usage="null",
)
