"""The emulator cache's vLLM-like eviction (``evict_whole_nodes=False``): only the pages needed go,
tail first, so the head of a long prefix stays cached (measured on real vLLM, docs/real-engines.md)."""

from __future__ import annotations

from replicas.sim.cache import PagesRemoved, PrefixCache


def run(cache: PrefixCache, seq: list[int], now: float) -> None:
    lease = cache.acquire(seq, len(seq), now)
    assert lease is not None
    cache.insert(lease, seq, now)
    cache.release(lease, now)


def removed(cache: PrefixCache) -> list[list[tuple[int, ...]]]:
    return [[p.tokens for p in r.pages] for r in cache.take_records() if isinstance(r, PagesRemoved)]


def test_block_eviction_keeps_the_head_of_the_lru_prefix() -> None:
    cache = PrefixCache(page_size=2, capacity_blocks=8, evict_whole_nodes=False)
    run(cache, [1, 1, 2, 2, 3, 3, 4, 4, 5, 5], now=1.0)  # A: 5 pages, least recently used
    run(cache, [7, 7, 8, 8], now=2.0)  # B: 2 pages; 1 page left free
    cache.take_records()
    run(cache, [9, 9, 6, 6], now=3.0)  # needs 2 pages: 1 free + 1 evicted from A's tail
    assert removed(cache) == [[(5, 5)]]
    assert cache.match_tokens([1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 0]) == 8  # A keeps 4 of its 5 pages
    assert cache.match_tokens([7, 7, 8, 8, 0]) == 4
    assert cache.tree_blocks == 8


def test_node_eviction_drops_the_whole_lru_leaf() -> None:
    cache = PrefixCache(page_size=2, capacity_blocks=8)
    run(cache, [1, 1, 2, 2, 3, 3, 4, 4, 5, 5], now=1.0)
    run(cache, [7, 7, 8, 8], now=2.0)
    cache.take_records()
    run(cache, [9, 9, 6, 6], now=3.0)
    assert removed(cache) == [[(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]]
    assert cache.match_tokens([1, 1, 2, 2, 0]) == 0


def test_block_eviction_empties_a_leaf_tail_first_then_moves_to_its_parent() -> None:
    cache = PrefixCache(page_size=2, capacity_blocks=6, evict_whole_nodes=False)
    run(cache, [1, 1, 2, 2], now=1.0)  # shared head
    run(cache, [1, 1, 2, 2, 3, 3, 4, 4], now=2.0)  # child leaf (3,3),(4,4) under it
    cache.take_records()
    run(cache, [9, 9, 8, 8, 7, 7, 6, 6, 5, 5], now=3.0)  # needs 5 pages: 2 free + 3 evicted
    assert removed(cache) == [[(4, 4), (3, 3)], [(2, 2)]]
    assert cache.match_tokens([1, 1, 2, 2, 0]) == 2
