"""The blocks an emulated engine caches and the blocks kvlb's index holds for it, as sets of kvlb's
block keys that compare one for one (pure: no I/O).

The emulator lists its cached pages (``GET /admin/blocks``: per DP rank, each page's parent position
and tokens, parents first). kvlb names a block by the XXH3 chain of its tokens from the namespace
seed of the pool's model (:mod:`balancer.index.hashing`), which :func:`engine_keys` recomputes, so
the listing compares key for key with what kvlb lists (``GET /admin/replicas/{id}/blocks``,
:func:`index_keys`). Only full pages get a key: kvlb indexes no partial block (a TRT-LLM page
shorter than the block size, and anything under it, is left out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from balancer.index.hashing import chain_keys, namespace_seed, pack_tokens

Blocks = dict[int, frozenset[int]]
"""DP rank → the block keys that rank holds (ranks holding none are left out)."""


@dataclass(frozen=True, slots=True)
class Listed:
    """One side's reading of one replica: its block count and, when the listing was whole, its keys."""

    count: int
    """Blocks in all (the engine's cached pages; the index's held blocks), over its DP ranks."""
    blocks: Blocks | None
    """``None`` when a rank's listing was cut by its cap: the keys cannot be compared then."""


def engine_keys(listing: Mapping[str, Any], model: str) -> Listed:
    """The emulator's ``GET /admin/blocks`` answer as kvlb's keys of its full pages."""
    seed = namespace_seed(model)
    block_size = int(listing["block_size"])
    blocks: Blocks = {}
    truncated = False
    count = 0
    for rank in listing["ranks"]:
        count += int(rank["blocks"])
        truncated = truncated or bool(rank["truncated"])
        keys = page_keys(rank["pages"], seed, block_size)
        if keys:
            blocks[int(rank["dp_rank"])] = keys
    return Listed(count, None if truncated else blocks)


def page_keys(pages: Sequence[Sequence[Any]], seed: int, block_size: int) -> frozenset[int]:
    """kvlb's keys of ``[parent, tokens]`` pages (parents first; -1: a root page) of one rank."""
    keys: list[int | None] = []
    for parent, tokens in pages:
        base = seed if parent < 0 else keys[parent]
        if base is None or len(tokens) != block_size:
            keys.append(None)  # a partial page, or under one: kvlb never keys it
            continue
        keys.append(chain_keys(base, pack_tokens(tokens), block_size, 1)[0])
    return frozenset(key for key in keys if key is not None)


def index_keys(view: Mapping[str, Any]) -> Listed:
    """kvlb's ``GET /admin/replicas/{id}/blocks`` answer as keys per rank."""
    blocks: Blocks = {}
    truncated = False
    count = 0
    for rank in view["ranks"]:
        count += int(rank["blocks"])
        truncated = truncated or bool(rank["truncated"])
        keys = frozenset(int(key, 16) for key in rank["keys"])
        if keys:
            blocks[int(rank["dp_rank"])] = keys
    return Listed(count, None if truncated else blocks)


def same_blocks(index: Listed, engine: Listed) -> bool:
    """Whether the index holds exactly the engine's blocks, rank for rank."""
    return index.blocks is not None and index.blocks == engine.blocks


def blocks_within(index: Listed, engine: Listed) -> bool:
    """Whether the index holds no block the engine lacks (on the same rank)."""
    if index.blocks is None or engine.blocks is None:
        return False
    return all(keys <= engine.blocks.get(rank, frozenset()) for rank, keys in index.blocks.items())


def difference(index: Listed, engine: Listed) -> str:
    """``-lacked/+extra``: blocks of the engine the index lacks, and blocks the index holds that the
    engine does not (``?`` when a listing was cut)."""
    if index.blocks is None or engine.blocks is None:
        return "?"
    ranks = set(index.blocks) | set(engine.blocks)
    empty: frozenset[int] = frozenset()
    lacked = sum(len(engine.blocks.get(r, empty) - index.blocks.get(r, empty)) for r in ranks)
    extra = sum(len(index.blocks.get(r, empty) - engine.blocks.get(r, empty)) for r in ranks)
    return f"-{lacked}/+{extra}"
