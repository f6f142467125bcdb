"""The block-level cache of the fast replica model against the emulator's PrefixCache, op for op.

Both caches pin the node an insertion's walk ended on while they evict for its new pages. Before
that fix the emulator could evict that very node, hang the new pages under it and later fail with a
``KeyError`` evicting it again (about 1 random replay in 1,000); 2,000 replays now run clean and
identical (seeds 0..1999, 2026-11-22).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.types import BlockKey
from loadtests.simulate.block_cache import BlockCache, BlockLease
from loadtests.simulate.step_model import kv_events
from replicas.sim.cache import Lease, PrefixCache


@dataclass
class _Request:
    tokens: list[int]
    sequence: list[int]
    """prompt + output[:-1]"""
    stage: int = 0
    ours: Lease | None = None
    theirs: BlockLease | None = None
    cut: int = 0
    keys: list[BlockKey] = field(default_factory=list)


class _Pair:
    """The emulator's cache and the block cache, driven alike and compared after every call."""

    def __init__(self, page_size: int, capacity: int) -> None:
        self.size = page_size
        self.ref = PrefixCache(page_size=page_size, capacity_blocks=capacity)
        self.block = BlockCache(page_size=page_size, capacity_blocks=capacity)
        self.hasher = BlockHasher("m", page_size)
        self.refused = 0

    def keys(self, tokens: list[int]) -> list[BlockKey]:
        return self.hasher.request_keys(tokens)

    def check(self) -> None:
        ref, block = self.ref, self.block
        assert kv_events(ref.take_records(), self.size) == block.take_events()
        assert (ref.tree_blocks, ref.private_blocks, ref.evictable_blocks, ref.active_blocks) == (
            block.tree_blocks,
            block.private_blocks,
            block.evictable_blocks,
            block.active_blocks,
        )
        assert (ref.stats.evictions, ref.stats.evicted_blocks, ref.stats.stored_blocks) == (
            block.stats.evictions,
            block.stats.evicted_blocks,
            block.stats.stored_blocks,
        )

    def acquire(self, request: _Request, reserve: int, now: float) -> None:
        match = request.tokens[:-1]
        request.ours = self.ref.acquire(match, reserve, now)
        request.theirs = self.block.acquire(request.keys, len(match) // self.size, reserve, now)
        assert (request.ours is None) == (request.theirs is None)
        if request.ours is not None and request.theirs is not None:
            assert request.ours.cached_tokens == request.theirs.cached_tokens
            assert request.ours.private_blocks == request.theirs.private_blocks
        else:
            self.refused += 1
        self.check()

    def insert(self, request: _Request, tokens: list[int], now: float) -> None:
        assert request.ours is not None and request.theirs is not None
        self.ref.insert(request.ours, tokens, now)
        keys = self.keys(tokens)
        self.block.insert(request.theirs, keys, len(keys), pack_tokens(tokens), now)
        assert request.ours.private_blocks == request.theirs.private_blocks
        self.check()

    def release(self, request: _Request, now: float) -> None:
        assert request.ours is not None and request.theirs is not None
        self.ref.release(request.ours, now)
        self.block.release(request.theirs, now)
        self.check()

    def match(self, tokens: list[int]) -> None:
        keys = self.keys(tokens)
        assert self.ref.match_tokens(tokens) == self.block.match_blocks(keys, len(keys)) * self.size


def _prompt(rng: random.Random, bases: list[list[int]], size: int) -> list[int]:
    """A prompt sharing a random prefix with one of ``bases`` (divergence anywhere, inside pages too)."""
    base = rng.choice(bases)
    shared = base[: rng.randrange(0, len(base) + 1)]
    return shared + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 3 * size))]


@pytest.mark.parametrize("seed", range(12))
def test_block_cache_replays_the_emulator_cache_exactly(seed: int) -> None:
    pair = _replay(random.Random(seed))
    assert pair.block.stats.evictions > 0 and pair.refused > 0  # both paths were exercised


def _replay(rng: random.Random) -> _Pair:
    size = rng.choice([1, 2, 4])
    pair = _Pair(size, capacity=rng.choice([10, 16, 32]))
    bases = [[rng.randrange(1, 4) for _ in range(rng.randrange(4, 12 * size))] for _ in range(4)]
    running: list[_Request] = []
    now = 0.0
    for _ in range(400):
        now += rng.choice([0.0, 0.0, 0.5, 1.0])  # equal times: ties broken by node age
        if not running or (len(running) < 8 and rng.random() < 0.35):
            tokens = _prompt(rng, bases, size)
            output = [100 + i for i in range(rng.randrange(0, 2 * size))]
            request = _Request(tokens, tokens + output)
            request.keys = pair.keys(tokens)
            pair.acquire(request, len(request.sequence) + 1, now)
            if request.ours is not None:
                request.cut = rng.randrange(0, len(tokens) + 1)
                running.append(request)
            continue
        request = rng.choice(running)
        if request.stage == 0:  # a chunk of the prefill cached, as the fast model does at admission
            pair.insert(request, request.tokens[: request.cut], now)
        elif request.stage == 1:  # prefill done
            pair.insert(request, request.tokens, now)
        else:  # finished
            pair.insert(request, request.sequence, now)
            pair.release(request, now)
            running.remove(request)
        request.stage += 1
        pair.match(_prompt(rng, bases, size))
    return pair


def test_block_cache_takes_keys_of_any_sequence_type() -> None:
    cache = BlockCache(page_size=2, capacity_blocks=16)
    lease = cache.acquire([], 0, 6, 0.0)
    assert lease is not None
    cache.insert(lease, [11, 12, 13], 3, pack_tokens([1, 2, 3, 4, 5, 6]), 0.0)
    assert cache.match_blocks((11, 12, 13), 3) == 3  # a tuple compares element by element
    assert cache.match_blocks([11, 12, 99], 3) == 2
    assert cache.match_blocks([11, 12, 13], 2) == 2
    [stored] = cache.take_events()
    assert stored.tokens == pack_tokens([1, 2, 3, 4, 5, 6])  # type: ignore[union-attr]


def test_block_cache_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        BlockCache(page_size=0, capacity_blocks=4)
    with pytest.raises(ValueError):
        BlockCache(page_size=4, capacity_blocks=0)
