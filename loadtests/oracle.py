"""The oracle: an upper bound on the prefix-cache hit rate a fleet can reach on a workload (pure).

How it is computed. Every prompt is cut into the blocks an engine can reuse: the full blocks of
``prompt[:-1]`` (engines always compute the last prompt token), each named by a chained key (the
key of block ``j`` stands for the whole prefix up to and including it, :mod:`balancer.index.hashing`). The
request stream is then played, in order, through **one pooled cache** holding ``replicas · K``
blocks (K = one replica's KV pool in blocks) that evicts with Belady's MIN rule: when full, drop the
block whose next use is farthest in the future (never a block of the request being served).

Why it bounds every router. Whatever the routing, the blocks the fleet holds at any moment are a
union of R pools of K blocks each, so at most R·K distinct blocks; a request's blocks must all be in
the pool of the replica that serves it (they are computed there); a hit needs the block in that
replica's pool, hence in the union. So the union behaves like one cache of R·K blocks fed the same
block stream, and for unit-sized blocks MIN hits at least as often as any such cache (Belady 1966;
Mattson et al. 1970). Three things make the bound loose, never wrong: MIN sees the future; it serves
requests one at a time, so two concurrent requests that share a new prefix both "hit" after the
first (a real engine computes both); and it keeps no room for running requests' private pages or
generated tokens (real pools do).

Also reported: the infinite-capacity bound (every block seen before is a hit), which depends only on
the workload.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from balancer.index.hashing import BlockHasher

NEVER = 1 << 62
"""Next-use position of a block that is never used again."""


@dataclass(frozen=True, slots=True)
class OracleResult:
    """The bound and what it was computed from; token counts are exact for the given prompts."""

    requests: int
    prompt_tokens: int
    """Σ prompt lengths (the hit rate's denominator, as in the measured hit rate)."""
    block_size: int
    capacity_blocks: int
    """Pooled capacity: replicas × blocks per replica."""
    hit_blocks: int
    """Blocks served from the MIN cache."""
    hit_rate: float | None
    """``hit_blocks · block_size / prompt_tokens``: the bound."""
    unbounded_hit_blocks: int
    """Blocks seen earlier in the stream (an infinite cache's hits)."""
    unbounded_hit_rate: float | None
    distinct_blocks: int
    """Distinct reusable blocks in the stream: the workload's prefix demand, in blocks."""

    def to_dict(self) -> dict[str, object]:
        return {
            "method": "Belady MIN over one pooled cache of replicas x KV blocks; blocks = full blocks "
            "of prompt[:-1], chained keys; hit rate = hit blocks x block size / prompt tokens",
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "block_size": self.block_size,
            "capacity_blocks": self.capacity_blocks,
            "hit_blocks": self.hit_blocks,
            "hit_rate": self.hit_rate,
            "unbounded_hit_blocks": self.unbounded_hit_blocks,
            "unbounded_hit_rate": self.unbounded_hit_rate,
            "distinct_blocks": self.distinct_blocks,
        }


def request_blocks(prompts: Iterable[Sequence[int]], block_size: int) -> tuple[list[list[int]], int]:
    """Chained keys of the reusable blocks of each prompt, and Σ prompt lengths."""
    hasher = BlockHasher("oracle", block_size, mode="trtllm")  # trtllm mode: full blocks of prompt[:-1]
    blocks: list[list[int]] = []
    total = 0
    for prompt in prompts:
        total += len(prompt)
        blocks.append([int(key) for key in hasher.request_keys(prompt)])
    return blocks, total


def _next_uses(stream: Sequence[Sequence[int]]) -> list[list[int]]:
    """For each request and block, the index of the next request using that block (or NEVER)."""
    later: dict[int, int] = {}
    result: list[list[int]] = [[] for _ in stream]
    for position in range(len(stream) - 1, -1, -1):
        keys = stream[position]
        result[position] = [later.get(key, NEVER) for key in keys]
        for key in keys:
            later[key] = position
    return result


def belady_hits(stream: Sequence[Sequence[int]], capacity_blocks: int) -> int:
    """Block hits of a MIN cache of ``capacity_blocks`` fed ``stream`` (one list of keys per request).

    Evicts the resident block with the farthest next use; blocks of the current request are pinned
    (if a request alone exceeds the capacity its deepest blocks are not kept). Ties on the next use
    are broken by deeper block first, so a prefix's tail goes before its head.
    """
    if capacity_blocks <= 0:
        raise ValueError(f"capacity_blocks must be > 0, got {capacity_blocks}")
    next_uses = _next_uses(stream)
    resident: dict[int, int] = {}  # key -> its next use (the live heap entry)
    heap: list[tuple[int, int, int]] = []  # (-next_use, -depth, key), stale entries skipped lazily
    hits = 0
    for position, keys in enumerate(stream):
        uses = next_uses[position]
        for depth, (key, next_use) in enumerate(zip(keys, uses, strict=True)):
            if key in resident:
                hits += 1
            resident[key] = next_use
            heapq.heappush(heap, (-next_use, -depth, key))
        pinned = set(keys)
        deferred: list[tuple[int, int, int]] = []
        while len(resident) > capacity_blocks and heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            if resident.get(key) != -entry[0]:
                continue  # stale: the block was reused (new next use) or already evicted
            if key in pinned:
                deferred.append(entry)
                continue
            del resident[key]
        for entry in deferred:
            heapq.heappush(heap, entry)
        _trim_pinned(resident, keys, capacity_blocks)
    return hits


def _trim_pinned(resident: dict[int, int], keys: Sequence[int], capacity_blocks: int) -> None:
    """A request bigger than the cache keeps only its first ``capacity_blocks`` blocks."""
    overflow = len(resident) - capacity_blocks
    for key in reversed(keys):
        if overflow <= 0:
            return
        if key in resident:
            del resident[key]
            overflow -= 1


def unbounded_hits(stream: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(hits of an infinite cache, distinct blocks) for ``stream``."""
    seen: set[int] = set()
    hits = 0
    for keys in stream:
        for key in keys:
            if key in seen:
                hits += 1
            else:
                seen.add(key)
    return hits, len(seen)


def prefix_reuse_bound(
    prompts: Iterable[Sequence[int]], *, block_size: int, replicas: int, blocks_per_replica: int
) -> OracleResult:
    """The oracle bound (module docstring) for ``prompts`` in arrival order."""
    if block_size <= 0 or replicas <= 0 or blocks_per_replica <= 0:
        raise ValueError("block_size, replicas and blocks_per_replica must be > 0")
    stream, prompt_tokens = request_blocks(prompts, block_size)
    capacity = replicas * blocks_per_replica
    hits = belady_hits(stream, capacity)
    free_hits, distinct = unbounded_hits(stream)

    def rate(blocks: int) -> float | None:
        return blocks * block_size / prompt_tokens if prompt_tokens else None

    return OracleResult(
        requests=len(stream),
        prompt_tokens=prompt_tokens,
        block_size=block_size,
        capacity_blocks=capacity,
        hit_blocks=hits,
        hit_rate=rate(hits),
        unbounded_hit_blocks=free_hits,
        unbounded_hit_rate=rate(free_hits),
        distinct_blocks=distinct,
    )
