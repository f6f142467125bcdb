"""TensorRT-LLM: the ``POST /kv_cache_events`` JSON decoder and TRT-LLM's :data:`SPEC` (pure).

One message is one frame: the JSON body of a drain, a list of event objects (``[]`` when idle). The
decoder keeps per-stream state (known windows, last ``event_id`` and partial-block hashes per
attention-DP rank), does no I/O and reads no clock. What it decides, and why:

* **Ordering.** ``event_id`` counts per rank and is shared by every window of that rank, so it is
  checked before any filtering. The first event seen on a rank sets its baseline (a balancer that
  starts late sees ``N > 0``; that is no gap), unless :meth:`TrtllmDecoder.resume_after` gave the
  rank the last ``event_id`` a previous consumer applied (a fleet lease takeover: the positions stored
  in Redis): then the first event is checked against it like any later one. Each decoded drain gives
  the last ``event_id`` per rank it held (``DecodedBatch.positions``), which a fleet writer stores with
  the batch. Then ``Resync(rank, reason)`` is emitted *before* the
  event, which is applied afterwards: ``"gap"`` when ids skip ahead (the engine's buffer overflowed and
  dropped its oldest events), ``"regression"`` when an id does not increase (a restart whose
  ``created`` was lost), ``"restart"`` for a ``created`` that opens a new start-up burst. A ``created``
  as the very first event of a stream also yields ``"restart"``: a rebuilt decoder may face an index
  still holding the previous incarnation's blocks, and clearing an empty rank is harmless. Further
  ``created`` events of the same burst (one per window) only add windows.
* **Windows.** Only events of the largest attention window count (VSWA models emit one stream per
  window). The maximum is learned from ``created`` events; an event with a larger window than any
  seen (or the first event of a stream that never showed its ``created``) raises it, and every rank
  that already had blocks applied from the smaller window gets ``Resync(rank, "stale")``. The maximum
  never shrinks: an engine restarted with a smaller window needs a new decoder. Events without
  ``window_size`` are kept.
* **Stored.** Blocks chain from ``parent_hash`` (``None``: the root). The chain stops at the first
  block that cannot be keyed from its tokens, and that block and every later one are dropped: a
  partial block (fewer than ``tokens_per_block`` tokens; its hash is remembered per rank so its later
  removal is dropped too), a block not on the GPU (``cache_level`` ≠ 0), or a multimodal block (a hex
  ``token_id`` from KV manager V2, or non-empty ``mm_keys``: token ids alone would alias different
  images). The text blocks before it are kept. A block with more tokens than ``tokens_per_block``
  makes the whole event malformed, and so does a block with fewer that is not the event's last
  (only a sequence's last block can be partial): both mean the engine's block size differs from the
  replica's, and the reason says so. A non-zero ``lora_id`` drops the event (no LoRA name to key it).
  ``cache_salt`` of the first block names the namespace.
* **Removed / updated.** Hashes of remembered partial blocks are forgotten, the rest become
  ``Removed``. ``updated`` with ``cache_level`` 0 → non-zero means the block left the GPU: ``Removed``.
  A move back to the GPU cannot be keyed (no tokens) and priority-only updates change nothing: both
  are ignored and counted.
* **Hashes** are u64; signed i64 values are normalised; a hex digest (``hash_algo: "v2_sha256"``)
  becomes the int of its first 16 hex digits, as ``v2_sha256_64`` would (first 8 bytes, big-endian).
* **Ranks.** ``attention_dp_rank`` absent means 0, except in a stream that has shown ranks (older
  engines left it out of ``removed`` events): there the event goes to the one rank whose next
  ``event_id`` it is, when exactly one is (counted in ``inferred_ranks``), else to rank 0.
* **Errors.** A body that is not JSON or not a list raises ``EventDecodeError``. A malformed event is
  skipped with its reason in ``DecodedBatch.errors``; its ``event_id``, when valid, still counts, so it
  causes no false gap. ``ignored`` counts empty ``{}`` events, events of other windows or unknown types,
  dropped blocks, removed partial hashes and ignored updates, one each.

**Block hashes.** :func:`v1_block_hashes` reproduces the engine's default (``v1_block_key``) block
hash of a plain text chain (no LoRA, no ``cache_salt``, no multimodal keys, ``token_extra_id`` 0):
``BlockKeyHasher::hash`` of ``blockKey.cpp``, transcribed in ``replicas/wire/trtllm.py``. No golden
value from a live TRT-LLM exists in this repository, so kvlb never trusts it blindly: the router uses
it only for a replica whose own events agreed with it (:meth:`PoolRouter.settle_receipt
<balancer.routing.router.PoolRouter.settle_receipt>`).

TRT-LLM's spec: blocks over ``prompt[:-1]``, 32 tokens per block by default, events from the HTTP
drain (one consumer; the drained events cannot be replayed, so a lease takeover checks the first
``event_id`` of each rank against the stored one and resyncs the rank on a gap), and
load from the ``/metrics`` iteration-stats drain, else Prometheus ``/prometheus/metrics`` (both
parsed in :mod:`balancer.engines.trtllm_load`).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from balancer.engines import DecodedBatch
from balancer.engines.spec import EngineSpec
from balancer.engines.trtllm_load import SCRAPE_TARGETS
from balancer.errors import ConfigError, EventDecodeError
from balancer.events import KvEvent, Removed, Resync, ResyncReason, Stored
from balancer.index.hashing import pack_tokens
from balancer.types import U64_MASK, EngineHash, to_u64

_HEX = re.compile(r"[0-9a-fA-F]{1,128}")
_I64_MIN = -(1 << 63)
_U32_MAX = (1 << 32) - 1


_MIX32_MULTIPLIER = 0x045D9F3B
_COMBINE_CONSTANT = 0x9E3779B9
_PARENT_MULTIPLIER = 0xBF58476D1CE4E5B9


def v1_block_hashes(token_ids: Sequence[int], tokens_per_block: int) -> list[EngineHash]:
    """TRT-LLM's u64 ``v1_block_key`` hashes of the full blocks of a plain text sequence, chained
    from the root (``seed = len ^ parent * C``, then ``hash32Mix`` of each u32 token into the seed)."""
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be > 0, got {tokens_per_block}")
    hashes: list[EngineHash] = []
    parent = 0
    for start in range(0, len(token_ids) - tokens_per_block + 1, tokens_per_block):
        seed = (tokens_per_block ^ (parent * _PARENT_MULTIPLIER)) & U64_MASK
        for token in token_ids[start : start + tokens_per_block]:
            mixed = token & _U32_MAX
            mixed = (((mixed >> 16) ^ mixed) * _MIX32_MULTIPLIER) & _U32_MAX
            mixed = (((mixed >> 16) ^ mixed) * _MIX32_MULTIPLIER) & _U32_MAX
            mixed = (((mixed >> 16) ^ mixed) + _COMBINE_CONSTANT) & _U32_MAX
            seed ^= (mixed + (seed << 6) + (seed >> 2)) & U64_MASK
        parent = seed
        hashes.append(EngineHash(seed))
    return hashes


class _Malformed(Exception):
    """One event cannot be used; the message says why (internal: becomes a ``DecodedBatch`` error)."""


@dataclass(slots=True)
class _RankState:
    last_event_id: int
    creating: bool
    """Every event since the last ``created`` was a ``created``: the rank is in its start-up burst."""
    restart_window: int | None = None
    """After a restart, the largest window its ``created`` burst announced; when the burst ends, a
    smaller one than ``max_window_size`` replaces it (the engine came back with a shorter context)."""


@dataclass(slots=True)
class _Out:
    events: list[KvEvent] = field(default_factory=list)
    ignored: int = 0
    ranks: set[int] = field(default_factory=set)
    """The ranks whose ``event_id`` this drain advanced."""


@dataclass(slots=True)
class _Chain:
    """What a ``stored`` event yields: the keyable blocks and what was dropped."""

    hashes: list[EngineHash]
    token_ids: list[int]
    partial: EngineHash | None
    dropped_blocks: int


def _int(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        got = value if type(value) is int else type(value).__name__
        raise _Malformed(f"{what} must be a non-negative integer, got {got}")
    return value


def _hash(value: object, what: str) -> EngineHash:
    if type(value) is int:
        if _I64_MIN <= value <= U64_MASK:
            return EngineHash(to_u64(value))
        raise _Malformed(f"{what} is outside the i64/u64 range")
    if isinstance(value, str) and _HEX.fullmatch(value):
        return EngineHash(int(value[:16], 16))
    raise _Malformed(f"{what} must be an integer or a hex digest, got {type(value).__name__}")


def _token_ids(tokens: object, what: str) -> tuple[list[int], bool]:
    """A block's token ids and whether one of them is a multimodal digest (a string)."""
    if not isinstance(tokens, list):
        raise _Malformed(f"{what}.tokens must be a list")
    try:  # fast path: plain u32 ids (set() makes one C-level pass; bools and floats are not int)
        ids = [token["token_id"] for token in tokens]
        if {type(i) for i in ids} <= {int} and (not ids or (min(ids) >= 0 and max(ids) <= _U32_MAX)):
            return ids, False
    except (TypeError, KeyError):
        pass
    ids = []
    digest = False
    for token in tokens:
        token_id = token.get("token_id") if isinstance(token, dict) else None
        if type(token_id) is int and 0 <= token_id <= _U32_MAX:
            ids.append(token_id)
        elif isinstance(token_id, str):
            digest = True
        else:
            raise _Malformed(f"{what}.tokens holds a token without a u32 or digest token_id")
    return ids, digest


def _parse_body(frames: Sequence[bytes]) -> list[Any]:
    try:
        count = len(frames)
    except TypeError:
        raise EventDecodeError("frame", "frames must be a sequence of byte strings") from None
    if count != 1:
        raise EventDecodeError("frame", f"expected one frame (the HTTP body), got {count}")
    frame = frames[0]
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise EventDecodeError("frame", f"frame must be bytes, got {type(frame).__name__}")
    try:
        body = json.loads(bytes(frame))
    except (ValueError, RecursionError) as exc:
        raise EventDecodeError("json", f"body is not JSON: {exc}") from None
    if not isinstance(body, list):
        raise EventDecodeError("schema", f"body must be a JSON list of events, got {type(body).__name__}")
    return body


def _block_size_hint(engine_tokens: int, configured: int) -> str:
    """What a block of another size than the replica's means, and the fix (for ``errors``)."""
    return (
        f": the engine's tokens_per_block looks {engine_tokens}, this replica's block_size is {configured}; "
        "set the replica's block_size to the engine's kv_cache_config tokens_per_block"
    )


class TrtllmDecoder:
    """Decodes the drains of one TRT-LLM engine, in order (one decoder per event stream)."""

    engine = "trtllm"

    def __init__(
        self, tokens_per_block: int = 32, max_partial_hashes: int = 65536, max_dp_ranks: int = 1024
    ) -> None:
        """``tokens_per_block`` must equal the engine's; ``max_partial_hashes`` caps the remembered
        partial-block hashes over all ranks (the oldest is forgotten first, counted in
        ``partial_overflow`` and in each batch's ``forgotten``, exported as
        ``kvlb_events_decoder_forgotten_total``; a forgotten one's removal then reaches the index as
        an unknown hash, which it ignores); ``max_dp_ranks`` bounds ``attention_dp_rank`` (larger is
        malformed)."""
        for name, value in (
            ("tokens_per_block", tokens_per_block),
            ("max_partial_hashes", max_partial_hashes),
            ("max_dp_ranks", max_dp_ranks),
        ):
            if value <= 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        self.tokens_per_block = tokens_per_block
        self.max_partial_hashes = max_partial_hashes
        self.max_dp_ranks = max_dp_ranks
        self.max_window_size: int | None = None
        self.partial_overflow = 0
        self.inferred_ranks = 0
        self._ranks: dict[int, _RankState] = {}
        self._partials: OrderedDict[tuple[int, EngineHash], None] = OrderedDict()
        self._window_ranks: set[int] = set()
        self._shows_ranks = False

    def decode(self, frames: Sequence[bytes]) -> DecodedBatch:
        """Decode one drain; raises ``EventDecodeError`` when the body is not a JSON list."""
        body = _parse_body(frames)
        overflow_before = self.partial_overflow
        out = _Out()
        errors: list[str] = []
        for index, raw in enumerate(body):
            try:
                self._decode_event(raw, out)
            except _Malformed as exc:
                errors.append(f"event {index}: {exc}")
        positions = {rank: self._ranks[rank].last_event_id for rank in out.ranks}
        return DecodedBatch(
            events=out.events,
            ignored=out.ignored,
            errors=tuple(errors),
            positions=positions,
            forgotten=self.partial_overflow - overflow_before,
        )

    def resume_after(self, positions: Mapping[int, int]) -> None:
        """Rank → the last ``event_id`` a previous consumer of this engine's drain applied: that
        rank's next event must be the one after (a later one means events were drained and never
        applied: ``Resync(rank, "gap")``). Call before the first :meth:`decode`; ranks absent here
        take their first event as the baseline, as usual."""
        for rank, event_id in positions.items():
            if 0 <= rank < self.max_dp_ranks and event_id >= 0:
                self._ranks[rank] = _RankState(event_id, creating=False)

    def _decode_event(self, raw: object, out: _Out) -> None:
        if not isinstance(raw, dict):
            raise _Malformed(f"an event must be an object, got {type(raw).__name__}")
        if not raw:
            out.ignored += 1  # the serializer writes {} for a None event
            return
        event_id = _int(raw.get("event_id"), "event_id")
        rank = self._rank_of(raw.get("attention_dp_rank"), event_id)
        data = raw.get("data")
        kind = data.get("type") if isinstance(data, dict) else None
        self._check_order(rank, event_id, kind == "created", out)
        if not isinstance(data, dict) or not isinstance(kind, str):
            raise _Malformed("data must be an object with a string type")
        window = raw.get("window_size")
        if window is not None:
            window = _int(window, "window_size")
        self._track_restart(rank, kind == "created", window)
        if kind == "created":
            if window is not None and (self.max_window_size is None or window > self.max_window_size):
                self._raise_window(window, out)
        elif kind not in ("stored", "removed", "updated") or not self._in_max_window(window, out):
            out.ignored += 1
        elif kind == "stored":
            self._on_stored(rank, data, out)
        elif kind == "removed":
            self._on_removed(rank, data, out)
        else:
            self._on_updated(rank, data, out)

    def _rank_of(self, value: object, event_id: int) -> int:
        if value is not None:
            rank = _int(value, "attention_dp_rank")
            if rank >= self.max_dp_ranks:
                raise _Malformed(f"attention_dp_rank {rank} is not below max_dp_ranks {self.max_dp_ranks}")
            self._shows_ranks = True
            return rank
        if not self._shows_ranks:
            return 0
        matches = [r for r, state in self._ranks.items() if state.last_event_id + 1 == event_id]
        if len(matches) == 1:
            self.inferred_ranks += 1
            return matches[0]
        return 0

    def _check_order(self, rank: int, event_id: int, created: bool, out: _Out) -> None:
        out.ranks.add(rank)
        state = self._ranks.get(rank)
        if state is None:
            self._ranks[rank] = _RankState(event_id, created)
            if created:
                out.events.append(Resync(rank, "restart"))
            return
        reason: ResyncReason | None = None
        if created and (not state.creating or event_id <= state.last_event_id):
            reason = "restart"
        elif event_id <= state.last_event_id:
            reason = "regression"
        elif event_id > state.last_event_id + 1:
            reason = "gap"
        if reason is not None:
            state.restart_window = 0 if reason == "restart" else None
            out.events.append(Resync(rank, reason))
            self._window_ranks.discard(rank)  # the index clears the rank: nothing stale is left
            if reason != "gap":  # a restarted engine's partial blocks are gone
                self._forget_partials(rank)
        state.last_event_id = event_id
        state.creating = created

    def _track_restart(self, rank: int, created: bool, window: int | None) -> None:
        state = self._ranks[rank]
        if state.restart_window is None:
            return
        if created:
            state.restart_window = max(state.restart_window, window or 0)
            return
        if 0 < state.restart_window < (self.max_window_size or 0):
            self.max_window_size = state.restart_window
        state.restart_window = None

    def _in_max_window(self, window: int | None, out: _Out) -> bool:
        if window is None:
            return True
        if self.max_window_size is None or window > self.max_window_size:
            self._raise_window(window, out)
            return True
        return window == self.max_window_size

    def _raise_window(self, window: int, out: _Out) -> None:
        self.max_window_size = window
        out.events.extend(Resync(rank, "stale") for rank in sorted(self._window_ranks))
        self._window_ranks.clear()

    def _on_stored(self, rank: int, data: dict[str, Any], out: _Out) -> None:
        parent_raw = data.get("parent_hash")
        parent = None if parent_raw is None else _hash(parent_raw, "parent_hash")
        blocks = data.get("blocks")
        if not isinstance(blocks, list):
            raise _Malformed("stored.blocks must be a list")
        first = blocks[0] if blocks and isinstance(blocks[0], dict) else {}
        salt = first.get("cache_salt", data.get("cache_salt"))
        if salt is not None and not isinstance(salt, str):
            raise _Malformed("cache_salt must be a string or null")
        if first.get("lora_id", data.get("lora_id")) not in (None, 0):
            out.ignored += max(len(blocks), 1)
            return
        chain = self._chain(parent, blocks)
        if chain.hashes:
            tokens = pack_tokens(chain.token_ids)
            out.events.append(
                Stored(rank, parent, tuple(chain.hashes), tokens, self.tokens_per_block, cache_salt=salt)
            )
            self._window_ranks.add(rank)
            for engine_hash in chain.hashes:
                self._partials.pop((rank, engine_hash), None)
        if chain.partial is not None:
            self._remember_partial(rank, chain.partial)
        out.ignored += chain.dropped_blocks if blocks else 1

    def _chain(self, parent: EngineHash | None, blocks: list[Any]) -> _Chain:
        """Parse blocks up to the first one that cannot be keyed; raises ``_Malformed``."""
        chain = _Chain([], [], None, 0)
        seen = {parent}
        for index, block in enumerate(blocks):
            what = f"stored.blocks[{index}]"
            if not isinstance(block, dict):
                raise _Malformed(f"{what} must be an object")
            engine_hash = _hash(block.get("block_hash"), f"{what}.block_hash")
            if engine_hash in seen:
                raise _Malformed(f"{what}.block_hash repeats its parent or an earlier block")
            seen.add(engine_hash)
            level = block.get("cache_level")
            level = 0 if level is None else _int(level, f"{what}.cache_level")
            ids, digest = _token_ids(block.get("tokens"), what)
            count = len(block["tokens"])
            if count > self.tokens_per_block:
                raise _Malformed(
                    f"{what} has {count} tokens > tokens_per_block {self.tokens_per_block}"
                    + _block_size_hint(count, self.tokens_per_block)
                )
            if count < self.tokens_per_block and index + 1 < len(blocks):
                # Only a sequence's last block may be partial: a short block with a child means
                # the engine's blocks are smaller than this replica's (silently all partial before).
                raise _Malformed(
                    f"{what} has {count} tokens < tokens_per_block {self.tokens_per_block} and is "
                    f"not the last block" + _block_size_hint(count, self.tokens_per_block)
                )
            if count < self.tokens_per_block or level != 0 or digest or block.get("mm_keys"):
                chain.partial = engine_hash if count < self.tokens_per_block else None
                chain.dropped_blocks = len(blocks) - index
                return chain
            chain.hashes.append(engine_hash)
            chain.token_ids.extend(ids)
        return chain

    def _on_removed(self, rank: int, data: dict[str, Any], out: _Out) -> None:
        raw_hashes = data.get("block_hashes")
        if not isinstance(raw_hashes, list):
            raise _Malformed("removed.block_hashes must be a list")
        hashes = [_hash(value, "removed.block_hashes[]") for value in raw_hashes]
        kept: list[EngineHash] = []
        for engine_hash in hashes:
            if (rank, engine_hash) in self._partials:
                del self._partials[(rank, engine_hash)]
                out.ignored += 1
            else:
                kept.append(engine_hash)
        if kept:
            out.events.append(Removed(rank, tuple(kept)))
            self._window_ranks.add(rank)
        elif not hashes:
            out.ignored += 1

    def _on_updated(self, rank: int, data: dict[str, Any], out: _Out) -> None:
        engine_hash = _hash(data.get("block_hash"), "updated.block_hash")
        level = data.get("cache_level")
        if level is None:  # a priority-only update: nothing the index tracks
            out.ignored += 1
            return
        if not isinstance(level, dict):
            raise _Malformed("updated.cache_level must be an event_diff object or null")
        old = _int(level.get("old_value"), "updated.cache_level.old_value")
        new = _int(level.get("new_value"), "updated.cache_level.new_value")
        if old == 0 and new != 0 and (rank, engine_hash) not in self._partials:
            out.events.append(Removed(rank, (engine_hash,)))  # offloaded: no longer on the GPU
            self._window_ranks.add(rank)
        else:
            out.ignored += 1  # back to the GPU (no tokens to key it), or a partial block

    def _remember_partial(self, rank: int, engine_hash: EngineHash) -> None:
        key = (rank, engine_hash)
        self._partials[key] = None
        self._partials.move_to_end(key)
        while len(self._partials) > self.max_partial_hashes:
            self._partials.popitem(last=False)
            self.partial_overflow += 1

    def _forget_partials(self, rank: int) -> None:
        for key in [key for key in self._partials if key[0] == rank]:
            del self._partials[key]


SPEC = EngineSpec(
    name="trtllm",
    decoder=TrtllmDecoder,
    align_mode="trtllm",
    bigram_align_mode="trtllm",
    default_block_size=32,
    transport="http_drain",
    drain_path="/kv_cache_events",
    scrape_targets=SCRAPE_TARGETS,
    resync_on_unclean_takeover=True,
    block_hashes=v1_block_hashes,
)
