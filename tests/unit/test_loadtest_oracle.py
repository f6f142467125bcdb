"""The load-test oracle: Belady MIN over a pooled cache bounds prefix reuse (pure)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from loadtests.oracle import belady_hits, prefix_reuse_bound, request_blocks, unbounded_hits


def lru_hits(stream: Sequence[Sequence[int]], capacity: int) -> int:
    """A plain LRU cache of ``capacity`` blocks fed the same stream (a lower reference)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for keys in stream:
        for key in keys:
            if key in cache:
                hits += 1
                cache.move_to_end(key)
            else:
                cache[key] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def test_counts_full_blocks_of_prompt_without_its_last_token() -> None:
    # block size 2: [1,2,3,4,5] has prompt[:-1] = [1,2,3,4], two blocks; [1,2,3] has one.
    blocks, total = request_blocks([[1, 2, 3, 4, 5], [1, 2, 3]], 2)
    assert [len(b) for b in blocks] == [2, 1]
    assert total == 8
    assert blocks[1][0] == blocks[0][0]  # same first block, same chained key


def test_shared_prefix_hits_up_to_the_divergence() -> None:
    a, b = [1, 2, 3, 4, 5], [1, 2, 9, 9, 9]
    result = prefix_reuse_bound([a, a, b], block_size=2, replicas=1, blocks_per_replica=100)
    # a: 2 misses; a again: 2 hits; b: (1,2) hit, (9,9) miss (its key chains from (1,2), new)
    assert result.hit_blocks == 3
    assert result.unbounded_hit_blocks == 3
    assert result.hit_rate == 3 * 2 / 15
    assert result.distinct_blocks == 3


def test_capacity_limits_reuse_and_pooling_restores_it() -> None:
    x, y = list(range(100, 109)), list(range(200, 209))  # 4 blocks of 2 each
    stream = [x, y] * 5
    exact = prefix_reuse_bound(stream, block_size=2, replicas=1, blocks_per_replica=4)
    small = prefix_reuse_bound(stream, block_size=2, replicas=1, blocks_per_replica=6)
    pooled = prefix_reuse_bound(stream, block_size=2, replicas=2, blocks_per_replica=4)
    assert pooled.hit_blocks == pooled.unbounded_hit_blocks == 8 * 4
    # 4 blocks hold only the prompt being served: alternating prompts never hit
    assert exact.hit_blocks == 0
    # 6 blocks keep 2 blocks of the other prompt each time: 2 hits per request after the first two
    assert small.hit_blocks == 2 * 8


streams = st.lists(
    st.lists(st.integers(0, 30), min_size=0, max_size=12).map(lambda keys: list(dict.fromkeys(keys))),
    min_size=1,
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(stream=streams, spare=st.integers(0, 20))
def test_min_is_between_lru_and_the_infinite_cache(stream: list[list[int]], spare: int) -> None:
    capacity = max(1, max(len(keys) for keys in stream)) + spare  # a request always fits, as in an engine
    best = belady_hits(stream, capacity)
    free, _ = unbounded_hits(stream)
    assert lru_hits(stream, capacity) <= best <= free
    assert belady_hits(stream, capacity + 1) >= best
