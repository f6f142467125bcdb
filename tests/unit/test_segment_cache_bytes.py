"""The segment cache is bounded in bytes as well as in ids (``limits.segment_cache_bytes``).

Its ids cap alone let texts of few ids fill it: a run of spaces is 128 characters an id with
DeepSeek-V3, and a string holding one emoji is 4 bytes a character, so 2,000,000 cached ids could
hold about 1 GiB of text. These tests fill a real tokenizer's cache with such chats and see the bytes
held (``tracemalloc``) stay within the bound and the overflow counted in ``/metrics``' families.
"""

from __future__ import annotations

import gc
import tracemalloc
from array import array

import pytest

from balancer.errors import ConfigError
from balancer.metrics import Metrics
from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.segments import SEGMENT_ENTRY_BYTES, SegmentCache, segment_bytes
from balancer.tokenizer.tokenizer import HfTokenizer, TokenizeLimits

BOUND_BYTES = 2 * 1024 * 1024
SEGMENT_CHARS = 16_384


def _sparse_chat(number: int) -> list[dict[str, str]]:
    """A chat whose system prompt is a run of spaces with one emoji (4 bytes a character, about 130
    ids for 64 KiB of string) and a number that makes it new."""
    system = f"😀 {number} " + " " * (SEGMENT_CHARS - 16)
    return [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() walks only what it made
def test_chats_of_few_ids_fill_the_cache_by_bytes_and_the_bound_holds() -> None:
    tokenizer = default_tokenizer(TokenizeLimits(segment_cache_bytes=BOUND_BYTES))
    assert isinstance(tokenizer, HfTokenizer)
    cache = tokenizer.segment_cache
    assert cache is not None and cache.max_bytes == BOUND_BYTES
    metrics = Metrics.create()
    metrics.segment_caches.source = lambda: {tokenizer.name: cache}
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for number in range(80):  # 80 × 64 KiB of system prompt: 5 MiB through a 2 MiB cache
            tokenizer.encode_chat(_sparse_chat(number))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.cached_tokens < 80 * 200  # the ids cap (2,000,000) is nowhere near
    assert 0 < cache.cached_bytes <= BOUND_BYTES
    assert cache.byte_evictions > 0 and cache.evictions == 0
    assert held <= BOUND_BYTES * 1.05, f"{held} bytes traced for a bound of {BOUND_BYTES}"
    assert held >= BOUND_BYTES * 0.5  # the cache was filled (and kept what it may)
    tokens = tokenizer.encode_chat(_sparse_chat(79))  # the newest is still cached: a hit
    assert cache.hits >= 1 and len(tokens) > 100
    sample = metrics.registry.get_sample_value
    labels = {"tokenizer": tokenizer.name}
    assert sample("kvlb_tokenizer_segment_cache_evictions_total", {**labels, "bound": "bytes"}) == (
        cache.byte_evictions
    )
    assert sample("kvlb_tokenizer_segment_cache_evictions_total", {**labels, "bound": "tokens"}) == 0
    assert sample("kvlb_tokenizer_segment_cache_bytes", labels) == cache.cached_bytes
    assert sample("kvlb_tokenizer_segment_cache_tokens", labels) == cache.cached_tokens


def test_counted_bytes_cover_the_traced_ones_with_u32_copies() -> None:
    """:func:`segment_bytes` and the ``u32`` copies count at least what ``tracemalloc`` sees the
    cache hold (text, ids, entry), and the bytes bound holds once copies are made too."""
    ints = tuple(range(1000))
    texts = [f"{number:04d}" + "中" * 1000 for number in range(200)]  # 2 bytes a character
    cache = SegmentCache(max_tokens=10**9, max_bytes=10**12, min_chars=1, ints=ints)
    ids = [[number % 1000] * 250 for number in range(200)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for text, made in zip(texts, ids, strict=True):
            cache.ids(text, lambda s, made=made: made)
        for text in texts:
            assert isinstance(cache.packed_ids(text, lambda s: []), array)
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    text_bytes = sum(map(segment_bytes, texts, [0] * 200)) - 200 * SEGMENT_ENTRY_BYTES
    assert traced + text_bytes <= cache.cached_bytes <= 1.5 * (traced + text_bytes)
    small = SegmentCache(max_tokens=10**9, max_bytes=cache.cached_bytes // 3, min_chars=1, ints=ints)
    for text, made in zip(texts, ids, strict=True):
        small.ids(text, lambda s, made=made: made)
        small.packed_ids(text, lambda s: [])  # its copy adds 4 bytes an id, within the bound
        assert small.cached_bytes <= small.max_bytes
    assert small.byte_evictions > 0 and small.evictions == 0


def test_a_segment_over_a_quarter_of_the_bytes_is_encoded_not_cached() -> None:
    cache = SegmentCache(max_bytes=4 * 4096, min_chars=1)
    huge = "x" * 4096  # over 4 KiB with its entry
    assert cache.ids(huge, lambda s: [1, 2]) == (1, 2)
    assert cache.refused == 1 and cache.cached_bytes == 0 and not cache.cached(huge)
    off = SegmentCache(max_bytes=0, min_chars=1)
    assert off.ids("short", lambda s: [3]) == [3] and off.cached_bytes == 0


def test_the_tokenizer_limit_is_checked() -> None:
    assert TokenizeLimits().segment_cache_bytes == 128 * 1024 * 1024
    with pytest.raises(ConfigError, match="segment cache's limits must be >= 0"):
        TokenizeLimits(segment_cache_bytes=-1)
