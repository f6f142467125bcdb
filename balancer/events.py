"""Engine-neutral KV-cache events (pure).

Decoders in :mod:`balancer.engines` turn engine bytes into these; the index applies them in order.
Stored blocks carry their tokens, never a router key: the key of a block chains over its parent's key,
which only the index knows (through the per-cache engine-hash map), so the index computes keys with
:class:`balancer.index.hashing.BlockHasher`.

Only **full** blocks appear here: decoders drop partial blocks (and, for TRT-LLM, their later removal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from balancer.types import EngineHash


@dataclass(frozen=True, slots=True)
class Stored:
    """A chain of full blocks stored on one DP rank.

    ``engine_hashes[i]`` is the engine's handle of block ``i``; block 0's parent is ``parent``
    (``None``: the root) and block ``i``'s parent is block ``i - 1``.

    ``tokens`` holds the blocks' token ids as little-endian u32, concatenated: block ``i`` covers
    tokens ``[i * block_size, (i + 1) * block_size + lookahead_tokens)``. ``lookahead_tokens`` is 1 for
    SGLang EAGLE bigram pages (a page of ``block_size`` pairs spans ``block_size + 1`` tokens), else 0.

    ``lora_name`` and ``cache_salt`` select the key namespace of the root block; a child inherits its
    parent's namespace through the chained key.

    ``chained``: the engine published each block as an event of its own, the parent of the next (as
    SGLang publishes one ``BlockStored`` per page), and the decoder merged the run into this one
    event, which costs one event to queue and apply instead of one per block. The index must apply
    it exactly as it would apply those events in order (:func:`split_chained` gives them back).
    """

    dp_rank: int
    parent: EngineHash | None
    engine_hashes: tuple[EngineHash, ...]
    tokens: bytes
    block_size: int
    lookahead_tokens: int = 0
    lora_name: str | None = None
    cache_salt: str | None = None
    chained: bool = False

    @property
    def block_count(self) -> int:
        return len(self.engine_hashes)


def split_chained(event: Stored, max_blocks: int = 1) -> list[Stored]:
    """The events a ``chained`` store stands for, in order, merged back into chained runs of at most
    ``max_blocks`` blocks (1: the one-block events themselves). Applying the pieces in order gives
    what applying the event gives."""
    width = 4 * event.block_size
    hashes = event.engine_hashes
    pieces: list[Stored] = []
    step = max(1, max_blocks)
    for start in range(0, len(hashes), step):
        end = min(len(hashes), start + step)
        parent = event.parent if start == 0 else hashes[start - 1]
        pieces.append(
            Stored(
                event.dp_rank,
                parent,
                hashes[start:end],
                event.tokens[start * width : end * width + 4 * event.lookahead_tokens],
                event.block_size,
                event.lookahead_tokens,
                event.lora_name,
                event.cache_salt,
                end - start > 1,
            )
        )
    return pieces


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks evicted from one DP rank, by engine hash (unknown hashes are ignored and counted)."""

    dp_rank: int
    engine_hashes: tuple[EngineHash, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    """The engine emptied the cache of one DP rank (SGLang/vLLM ``AllBlocksCleared``)."""

    dp_rank: int


ResyncReason = Literal[
    "restart", "gap", "regression", "overflow", "epoch", "lease", "stale", "disconnect", "oversize"
]


@dataclass(frozen=True, slots=True)
class Resync:
    """What the index knows of one DP rank can no longer be trusted: clear it and let it refill (a
    ``"gap"``, events lost while the engine went on, only marks the rank's blocks suspect in a table
    with a gap hold: ``TableLimits.gap_hold_s``).

    Raised by decoders and sources for an engine restart (TRT-LLM ``created``, a new epoch), an
    ``event_id``/seq regression, a gap that replay cannot fill, a queue overflow, or an event
    dropped for carrying more blocks than ``limits.max_event_blocks`` (``oversize``).
    """

    dp_rank: int
    reason: ResyncReason


KvEvent = Stored | Removed | Cleared | Resync


def event_blocks(event: KvEvent) -> int:
    """Blocks an event carries: its engine hashes, or for a ``Stored`` its whole token blocks if
    more (what bounds its cost to decode, hash, store and stream); 0 for ``Cleared``/``Resync``."""
    if type(event) is Stored:
        return max(len(event.engine_hashes), len(event.tokens) // (4 * max(1, event.block_size)))
    if type(event) is Removed:
        return len(event.engine_hashes)
    return 0
