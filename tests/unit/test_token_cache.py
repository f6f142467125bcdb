"""The segment cache is exact: cached tokenizing equals a plain encode, and it stays bounded."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken as RustAddedToken
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers

from balancer.tokenizer.chat_template import ChatTemplate
from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.segments import AddedToken, SegmentCache, build_splitter, encode_segmented
from balancer.tokenizer.tokenizer import HfTokenizer, TokenizeLimits

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "kvlb", "42", "ü", "中文"]


@functools.cache
def shared_tokenizer() -> HfTokenizer:
    tok = default_tokenizer()
    assert isinstance(tok, HfTokenizer)
    return tok


@pytest.fixture(scope="module")
def tokenizer() -> HfTokenizer:
    return shared_tokenizer()


def plain(tok: HfTokenizer, text: str) -> list[int]:
    ids: list[int] = tok._tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def chat(rng: random.Random, system_words: int) -> list[dict[str, str]]:
    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    return [
        {"role": "system", "content": text(system_words)},
        {"role": "user", "content": text(rng.randint(1, 60))},
        {"role": "assistant", "content": text(rng.randint(1, 30))},
        {"role": "user", "content": text(rng.randint(1, 60)) + "\n\n  trailing  "},
    ]


def test_default_tokenizer_uses_the_cache(tokenizer: HfTokenizer) -> None:
    assert tokenizer.segment_cache is not None


def test_cached_chat_ids_equal_plain_encode_and_repeat_hits(tokenizer: HfTokenizer) -> None:
    rng = random.Random(5)
    messages = chat(rng, 400)
    text = tokenizer.render_chat(messages)
    cache = tokenizer.segment_cache
    assert cache is not None
    hits = cache.hits
    first = tokenizer.encode_chat(messages)
    assert first == plain(tokenizer, text)
    messages[-1]["content"] = "a different last question"
    second = tokenizer.encode_chat(messages)
    assert second == plain(tokenizer, tokenizer.render_chat(messages))
    assert cache.hits > hits  # the long system prompt was tokenized once


@settings(max_examples=60, deadline=None)
@given(
    texts=st.lists(st.text(min_size=0, max_size=400), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_segmented_encoding_is_exact_for_arbitrary_text(texts: list[str], seed: int) -> None:
    tok = shared_tokenizer()
    assert tok._splitter is not None
    pattern, specials = tok._splitter
    names = sorted(specials)[:20]
    rng = random.Random(seed)
    text = "".join(t + rng.choice(names) for t in texts)
    cache = SegmentCache(min_chars=0)
    assert encode_segmented(text, pattern, specials, cache, tok._raw) == plain(tok, text)
    assert encode_segmented(text, pattern, specials, cache, tok._raw) == plain(tok, text)  # from cache


def test_lru_is_bounded_by_tokens() -> None:
    cache = SegmentCache(max_tokens=100, min_chars=1)
    for i in range(50):
        cache.ids(f"segment {i}", lambda s: list(range(10)))
    assert cache.cached_tokens <= 100
    assert cache.evictions == 40
    assert cache.misses == 50
    cache.ids("segment 49", lambda s: [999])  # still cached: the encoder is not called
    assert cache.hits == 1
    huge = cache.ids("huge", lambda s: list(range(60)))  # > max_tokens // 4: returned, not cached
    assert len(huge) == 60 and cache.cached_tokens <= 100


def test_disabled_cache_and_unverbatim_specials() -> None:
    assert SegmentCache(max_tokens=0).ids("abc" * 200, lambda s: [1, 2]) == [1, 2]
    stripped = [AddedToken("<s>", 0, special=True, verbatim=False)]
    assert build_splitter(stripped) is None


def test_tokenizer_with_stripping_specials_falls_back(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.add_special_tokens([RustAddedToken("<sep>", lstrip=True, rstrip=True)])
    tok = HfTokenizer(rust, ChatTemplate(None, {}), name="tiny", limits=TokenizeLimits())
    assert tok.segment_cache is None
    assert tok.encode_prompt("hello <sep> world", add_special_tokens=False) == [1, 3, 2]
