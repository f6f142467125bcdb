"""The emulator's paged prefix cache: hits, misses, reference counts, LRU eviction order, records."""

from __future__ import annotations

import pytest

from replicas.sim.cache import (
    CacheCleared,
    PagesRemoved,
    PagesStored,
    PrefixCache,
    coalesce_removals,
)


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def cached_run(cache: PrefixCache, seq: list[int], now: float) -> None:
    """One request that reserves, caches ``seq`` and finishes."""
    lease = cache.acquire(seq, len(seq), now)
    assert lease is not None
    cache.insert(lease, seq, now)
    cache.release(lease, now)


def test_miss_then_hit_counts_full_pages_only() -> None:
    cache = PrefixCache(page_size=4, capacity_blocks=16)
    seq = tokens(0, 10)  # two full pages and a partial one
    assert cache.match_tokens(seq) == 0
    cached_run(cache, seq, now=1.0)
    assert cache.tree_blocks == 2  # the partial tail is not cached (SGLang)
    assert cache.match_tokens(seq) == 8
    assert cache.match_tokens(tokens(0, 6)) == 4
    assert cache.match_tokens([0, 1, 2, 99, 4]) == 0
    lease = cache.acquire(seq, len(seq) + 4, now=2.0)
    assert lease is not None and lease.cached_tokens == 8
    assert lease.private_blocks == 4 - 2  # 14 tokens need 4 pages, 2 already cached


def test_records_chain_parents_and_split_keeps_page_identity() -> None:
    cache = PrefixCache(page_size=2, capacity_blocks=32)
    cached_run(cache, [1, 2, 3, 4, 5, 6], now=1.0)
    [first] = cache.take_records()
    assert isinstance(first, PagesStored) and first.parent is None
    assert [p.tokens for p in first.pages] == [(1, 2), (3, 4), (5, 6)]
    cached_run(cache, [1, 2, 3, 4, 9, 9, 8, 8], now=2.0)  # diverges inside the first node
    [second] = cache.take_records()
    assert isinstance(second, PagesStored)
    assert second.parent is first.pages[1]  # parent is the shared page (3, 4): same object after split
    assert [p.tokens for p in second.pages] == [(9, 9), (8, 8)]
    assert cache.tree_blocks == 5


def test_eviction_is_lru_by_whole_leaf_nodes_and_skips_locked() -> None:
    cache = PrefixCache(page_size=2, capacity_blocks=6)
    cached_run(cache, [1, 1, 2, 2], now=1.0)  # A: 2 pages, oldest
    cached_run(cache, [3, 3, 4, 4], now=2.0)  # B
    held = cache.acquire([5, 5, 6, 6], 4, now=3.0)  # C: running, pages private
    assert held is not None
    cache.insert(held, [5, 5, 6, 6], now=3.0)
    cache.take_records()
    assert cache.free_blocks == 0
    # A is older than B but locked by a running request: B is evicted instead
    assert cache.acquire([1, 1, 2, 2, 0], 0, now=4.0) is not None
    assert cache.acquire([7, 7], 4, now=5.0) is not None
    [removed] = cache.take_records()
    assert isinstance(removed, PagesRemoved)
    assert [p.tokens for p in removed.pages] == [(3, 3), (4, 4)]
    assert cache.evictable_blocks == 0
    assert cache.acquire([8, 8], 2, now=6.0) is None  # everything left is referenced


def test_eviction_order_and_removed_records() -> None:
    cache = PrefixCache(page_size=2, capacity_blocks=6)
    cached_run(cache, [1, 1, 2, 2], now=1.0)
    cached_run(cache, [3, 3, 4, 4], now=2.0)
    cached_run(cache, [5, 5, 6, 6], now=3.0)
    stored = {r.pages[0].tokens: r for r in cache.take_records() if isinstance(r, PagesStored)}
    cached_run(cache, [1, 1, 2, 2], now=4.0)  # a full hit on A refreshes it
    assert cache.take_records() == []
    lease = cache.acquire([8, 8, 8, 8], 4, now=5.0)  # needs 2 pages: evicts B, the LRU
    assert lease is not None
    [removed] = cache.take_records()
    assert isinstance(removed, PagesRemoved)
    assert removed.pages == stored[(3, 3)].pages
    assert cache.match_tokens([3, 3, 4, 4]) == 0
    assert cache.match_tokens([1, 1, 2, 2]) == 4
    assert cache.match_tokens([5, 5, 6, 6]) == 4


def test_evicting_a_leaf_exposes_its_parent_and_removals_coalesce() -> None:
    cache = PrefixCache(page_size=1, capacity_blocks=4)
    cached_run(cache, [1, 2], now=1.0)
    cached_run(cache, [1, 2, 3, 4], now=2.0)  # child node (3, 4) under (1, 2)
    cache.take_records()
    lease = cache.acquire([7, 7, 7], 3, now=3.0)
    assert lease is not None
    records = coalesce_removals(cache.take_records())
    assert len(records) == 1 and isinstance(records[0], PagesRemoved)
    assert [p.tokens for p in records[0].pages] == [(3,), (4,), (1,), (2,)]  # leaf first, then parent
    assert cache.tree_blocks == 0


def test_reference_counts_block_eviction_until_release() -> None:
    cache = PrefixCache(page_size=2, capacity_blocks=4)
    lease = cache.acquire([1, 1, 2, 2], 4, now=1.0)
    assert lease is not None
    cache.insert(lease, [1, 1, 2, 2], now=1.0)
    assert cache.active_blocks == 2 and cache.evictable_blocks == 0
    assert cache.acquire([5, 5, 6, 6, 7, 7], 6, now=2.0) is None  # 3 pages, only 2 free
    cache.release(lease, now=3.0)
    assert cache.active_blocks == 0 and cache.evictable_blocks == 2
    assert cache.acquire([5, 5, 6, 6, 7, 7], 6, now=4.0) is not None


def test_insert_reuses_pages_another_request_cached_meanwhile() -> None:
    cache = PrefixCache(page_size=2, capacity_blocks=8)
    first = cache.acquire([1, 1, 2, 2], 4, now=1.0)
    second = cache.acquire([1, 1, 2, 2], 4, now=1.0)
    assert first is not None and second is not None
    assert cache.private_blocks == 4
    cache.insert(first, [1, 1, 2, 2], now=2.0)
    cache.insert(second, [1, 1, 2, 2], now=2.0)  # duplicates: its private pages are freed
    assert cache.tree_blocks == 2 and cache.private_blocks == 0
    assert len([r for r in cache.take_records() if isinstance(r, PagesStored)]) == 1


def test_partial_pages_are_cached_as_leaves_when_enabled() -> None:
    cache = PrefixCache(page_size=4, capacity_blocks=8, store_partial=True)
    lease = cache.acquire([1, 2, 3, 4, 5, 6], 10, now=1.0)
    assert lease is not None
    cache.insert(lease, [1, 2, 3, 4, 5, 6], now=1.0)
    cache.insert(lease, [1, 2, 3, 4, 5, 6, 7, 8, 9], now=2.0)
    records = cache.take_records()
    assert [[p.tokens for p in r.pages] for r in records if isinstance(r, PagesStored)] == [
        [(1, 2, 3, 4), (5, 6)],
        [(5, 6, 7, 8), (9,)],
    ]
    second = records[1]
    assert isinstance(second, PagesStored) and second.parent is not None
    assert second.parent.tokens == (1, 2, 3, 4)  # the full page is a sibling of the partial one
    assert cache.match_tokens([1, 2, 3, 4, 5, 6, 7, 8]) == 8


def test_flush_refused_while_running_then_records_clear() -> None:
    cache = PrefixCache(page_size=2, capacity_blocks=8)
    lease = cache.acquire([1, 1], 2, now=1.0)
    assert lease is not None
    assert cache.flush() is False
    cache.insert(lease, [1, 1], now=1.0)
    cache.release(lease, now=1.0)
    cache.take_records()
    assert cache.flush() is True
    assert cache.take_records() == [CacheCleared()]
    assert cache.tree_blocks == 0 and cache.match_tokens([1, 1]) == 0


def test_reset_invalidates_old_leases() -> None:
    cache = PrefixCache(page_size=2, capacity_blocks=8)
    lease = cache.acquire([1, 1, 2, 2], 4, now=1.0)
    assert lease is not None
    cache.reset()
    cache.insert(lease, [1, 1, 2, 2], now=2.0)
    cache.release(lease, now=2.0)
    assert cache.tree_blocks == 0 and cache.private_blocks == 0 and cache.take_records() == []


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        PrefixCache(page_size=0, capacity_blocks=4)


def chains(listed: list[tuple[int, tuple[int, ...]]]) -> set[tuple[tuple[int, ...], ...]]:
    """Each listed page as the chain of pages from its root (checks every parent comes first)."""
    paths: list[tuple[tuple[int, ...], ...]] = []
    for parent, page in listed:
        assert parent < len(paths)
        paths.append((*paths[parent], page) if parent >= 0 else (page,))
    return set(paths)


def test_listing_names_every_cached_page_under_its_parent_and_follows_evictions() -> None:
    cache = PrefixCache(page_size=2, capacity_blocks=7)
    cached_run(cache, [1, 2, 3, 4, 5, 6], now=1.0)
    cached_run(cache, [1, 2, 3, 4, 9, 9, 8, 8], now=2.0)  # splits the first node after (3, 4)
    cached_run(cache, [7, 7], now=3.0)
    listed, truncated = cache.listing(100)
    assert not truncated and len(listed) == cache.tree_blocks == 6
    a, b, c = (1, 2), (3, 4), (7, 7)
    assert chains(listed) == {(a,), (a, b), (a, b, (5, 6)), (a, b, (9, 9)), (a, b, (9, 9), (8, 8)), (c,)}
    cached_run(cache, [6, 6, 5, 5], now=4.0)  # evicts the least recently used leaf, (5, 6)
    listed, _ = cache.listing(100)
    assert (a, b, (5, 6)) not in chains(listed) and (a, b, (9, 9), (8, 8)) in chains(listed)
    assert len(listed) == cache.tree_blocks
    capped, truncated = cache.listing(3)
    assert truncated and len(capped) == 3
    assert chains(capped) <= chains(listed)  # a prefix of the listing: parents still come first
    assert cache.listing(0) == ([], True)
    cache.reset()
    assert cache.listing(100) == ([], False)
