"""The segment cache answers by shape (a stored key found by length and ends) exactly as by hash.

A model of the LRU (what ``SegmentCache`` did before it kept shapes: every lookup by the segment's
own hash) runs beside the real cache on segments made to share shapes: the same length and the same
:data:`SHAPE_CHARS` characters at both ends, different middles, each sent as a new string object.
Every answer, counter, the LRU order and the ``u32`` copies must agree, and the shapes must only
name stored keys.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.tokenizer.segments import SHAPE_CHARS, SegmentCache

VOCAB = 64
EDGE = "e" * SHAPE_CHARS


def _encode(segment: str) -> list[int]:
    return [ord(char) % VOCAB for char in segment]


class Model:
    """The cache's contract, looked up by hash only."""

    def __init__(self, max_tokens: int, min_chars: int) -> None:
        self.max_tokens, self.min_chars = max_tokens, min_chars
        self.entries: OrderedDict[str, list[int]] = OrderedDict()
        self.tokens = self.hits = self.misses = self.evictions = 0

    def eligible(self, segment: str) -> bool:
        return self.max_tokens > 0 and len(segment) >= self.min_chars

    def ids(self, segment: str) -> list[int]:
        if not self.eligible(segment):
            return _encode(segment)
        if segment in self.entries:
            self.entries.move_to_end(segment)
            self.hits += 1
            return self.entries[segment]
        self.misses += 1
        encoded = _encode(segment)
        if len(encoded) > self.max_tokens // 4:
            return encoded
        self.entries[segment] = encoded
        self.tokens += len(encoded)
        while self.tokens > self.max_tokens:
            _, old = self.entries.popitem(last=False)
            self.tokens -= len(old)
            self.evictions += 1
        return encoded

    def peek(self, segment: str) -> list[int] | None:
        if not self.eligible(segment) or segment not in self.entries:
            return None
        self.entries.move_to_end(segment)
        return self.entries[segment]


def _fresh(text: str) -> str:
    """An equal string that is another object (as each request's decoded body gives)."""
    return "".join([text[:1], text[1:]])


# Segments in few shapes: a length, the same ends, a middle that differs (or not)
middles = st.text(alphabet="abc", min_size=0, max_size=3)
segments = st.builds(lambda middle, pad: EDGE + middle + "x" * pad + EDGE, middles, st.integers(0, 2))
operations = st.lists(
    st.tuples(st.sampled_from(["ids", "packed_ids", "peek_packed", "cached"]), segments),
    min_size=1,
    max_size=60,
)


def _check(cache: SegmentCache, model: Model) -> None:
    assert list(cache._entries) == list(model.entries)
    assert (cache.hits, cache.misses, cache.evictions) == (model.hits, model.misses, model.evictions)
    assert cache.cached_tokens == model.tokens
    stored = {id(key) for key in cache._entries}
    assert all(id(key) in stored for key in cache._shapes.values())  # shapes name stored keys only
    assert len(cache._shapes) <= len(cache._entries)
    for key, packed in cache._arrays.items():
        assert key in cache._entries and list(packed) == list(cache._entries[key])


@settings(max_examples=300, deadline=None)
@given(operations, st.sampled_from([0, 150, 400, 10_000]), st.sampled_from([1, 2 * SHAPE_CHARS + 2]))
def test_lookups_by_shape_answer_as_lookups_by_hash(
    steps: Sequence[tuple[str, str]], max_tokens: int, min_chars: int
) -> None:
    cache = SegmentCache(max_tokens=max_tokens, min_chars=min_chars, ints=tuple(range(VOCAB)))
    model = Model(max_tokens, min_chars)
    for operation, text in steps:
        segment = _fresh(text)
        if operation == "ids":
            assert list(cache.ids(segment, _encode)) == model.ids(text)
        elif operation == "packed_ids":
            got = cache.packed_ids(segment, _encode)
            assert list(got) == model.ids(text)
        elif operation == "peek_packed":
            peeked = cache.peek_packed(segment)
            expected = model.peek(text)
            assert (None if peeked is None else list(peeked)) == expected
            assert peeked is None or isinstance(peeked, array)
        else:
            assert cache.cached(segment) == (model.eligible(text) and text in model.entries)
        _check(cache, model)


def test_a_segment_of_a_stored_shape_but_other_text_is_not_taken_for_it() -> None:
    cache = SegmentCache(max_tokens=10_000, min_chars=1, ints=tuple(range(VOCAB)))
    first, other = EDGE + "a" + EDGE, EDGE + "b" + EDGE  # one shape
    assert list(cache.packed_ids(first, _encode)) == _encode(first)
    assert cache.peek_packed(_fresh(other)) is None and not cache.cached(_fresh(other))
    assert list(cache.packed_ids(_fresh(other), _encode)) == _encode(other)
    assert list(cache.peek_packed(_fresh(first)) or ()) == _encode(first)
    assert list(cache.peek_packed(_fresh(other)) or ()) == _encode(other)
    assert (cache.hits, cache.misses) == (0, 2)  # peeks count nothing


def test_an_equal_segment_is_found_by_its_stored_key() -> None:
    cache = SegmentCache(max_tokens=10_000, min_chars=1, ints=tuple(range(VOCAB)))
    text = EDGE + "middle" + EDGE
    cache.packed_ids(text, _encode)
    (stored,) = cache._entries
    assert cache._stored(_fresh(text)) is stored  # so every dict finds it by identity
    assert cache._stored(_fresh(EDGE + "muddle" + EDGE)) is not stored
