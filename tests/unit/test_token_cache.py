"""The segment cache is exact: cached tokenizing equals a plain encode, and it stays bounded."""

from __future__ import annotations

import functools
import random
import threading
import time
from array import array
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken as RustAddedToken
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from balancer.tokenizer.chat_template import ChatTemplate
from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.segments import (
    AddedToken,
    SegmentCache,
    build_splitter,
    encode_segmented,
    encode_segmented_packed,
)
from balancer.tokenizer.tokenizer import HfTokenizer, TokenizeLimits

CHAT_TOKENS = [
    "<\uff5cUser\uff5c>",
    "<\uff5cAssistant\uff5c>",
    "<\uff5ctool\u2581calls\u2581begin\uff5c>",
    "<|EOT|>",
    "<\uff5ctd\uff5c>",
]
"""Added tokens of DeepSeek-V3 with ``special: false`` (all but the last also ``normalized: true``),
on which the fast tokenizer splits all the same; the first two open and close every chat turn."""
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
    for _ in range(2):  # the request path's form: a u32 array of the same ids
        packed = tokenizer.encode_chat_if_cached(messages, {}, 4096)
        assert type(packed) is array and packed.typecode == "I" and list(packed) == second


@settings(max_examples=60, deadline=None)
@given(
    texts=st.lists(st.text(min_size=0, max_size=400), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_segmented_encoding_is_exact_for_arbitrary_text(texts: list[str], seed: int) -> None:
    tok = shared_tokenizer()
    splitter = tok._splitter
    assert splitter is not None
    names = [*sorted(splitter.ids)[:20], *CHAT_TOKENS]
    rng = random.Random(seed)
    text = "".join(t + rng.choice(names) for t in texts)
    cache = SegmentCache(min_chars=0)
    assert encode_segmented(text, splitter, cache, tok._raw) == plain(tok, text)
    assert encode_segmented(text, splitter, cache, tok._raw) == plain(tok, text)  # from cache
    packed = array("I", plain(tok, text))
    for _ in range(2):  # the first packed hits make the u32 copies, the second reads them
        assert encode_segmented_packed(text, splitter, cache, tok._raw) == packed
    fresh = SegmentCache(min_chars=0)  # misses first, on the packed path
    assert encode_segmented_packed(text, splitter, fresh, tok._raw) == packed
    assert encode_segmented(text, splitter, fresh, tok._raw) == plain(tok, text)


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


def test_packed_hits_keep_u32_copies_that_go_with_their_segments() -> None:
    """``packed_ids`` answers a hit with a ``u32`` copy of the segment's ids, made at its first packed
    hit and reused; ``ids`` keeps answering with the tuple; an evicted segment's copy goes with it."""
    cache = SegmentCache(max_tokens=100, min_chars=1)
    assert list(cache.packed_ids("first", lambda s: [1, 2, 3])) == [1, 2, 3]  # a miss: encoded
    assert not cache._arrays
    made = cache.packed_ids("first", lambda s: [9])
    assert made == array("I", [1, 2, 3]) and cache._arrays["first"] is made
    assert cache.packed_ids("first", lambda s: [9]) is made
    assert cache.ids("first", lambda s: [9]) == (1, 2, 3)
    assert (cache.hits, cache.misses) == (3, 1)
    for i in range(20):  # 200 ids through a cache of 100: "first" is evicted
        cache.ids(f"segment {i}", lambda s: list(range(10)))
    assert "first" not in cache._entries and not cache._arrays
    assert cache.cached_tokens <= 100


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


def fresh(tok: HfTokenizer, **limits: int) -> HfTokenizer:
    """``tok`` with a segment cache of its own (so hit and miss counts are this test's)."""
    return HfTokenizer(tok._tokenizer, tok._chat, name="fresh", limits=TokenizeLimits(**limits))


def test_non_special_chat_tokens_are_split_points(tokenizer: HfTokenizer) -> None:
    splitter = tokenizer._splitter
    assert splitter is not None
    assert set(CHAT_TOKENS) <= set(splitter.ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    pieces = splitter.split(tokenizer.render_chat(messages))
    assert pieces == [
        "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
        "Be brief.\n\n",  # the template ends the system prompt with a blank line
        CHAT_TOKENS[0],
        "Hi there",
        CHAT_TOKENS[1],
    ]


def test_shared_8k_system_prompt_hits_the_cache_and_ids_stay_exact(tokenizer: HfTokenizer) -> None:
    """A chat sharing an 8k-token system prompt and differing in the user message: the system
    prompt's segment comes from the cache, and the ids equal a plain encode of the whole text."""
    tok = fresh(tokenizer)
    cache = tok.segment_cache
    assert cache is not None
    rng = random.Random(8)
    system = " ".join(rng.choice(WORDS) for _ in range(7000))
    first = [{"role": "system", "content": system}, {"role": "user", "content": "What is a fox? " * 30}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "Why is a dog lazy? " * 30}]
    assert tok.encode_chat(first) == plain(tok, tok.render_chat(first))
    assert (cache.hits, cache.misses) == (0, 2)  # the system prompt and the user message
    ids = tok.encode_chat(second)
    assert len(ids) > 8000
    assert ids == plain(tok, tok.render_chat(second))
    assert (cache.hits, cache.misses) == (1, 3)  # the system prompt hit; the new question missed
    assert system + "\n\n" in cache._entries


def test_split_passes_follow_the_tokenizer_two_pass_order() -> None:
    """``tokenizers`` matches ``normalized: false`` tokens on the raw text before ``normalized: true``
    ones: in ``xabcx`` the raw ``bc`` wins over the normalised ``ab`` that starts first."""
    vocab = {ch: i for i, ch in enumerate("[abcxyz ")}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="["))
    rust.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    rust.normalizer = normalizers.Sequence([])
    rust.add_tokens([RustAddedToken("ab", normalized=True)])
    rust.add_tokens([RustAddedToken("bc", normalized=False)])
    tok = HfTokenizer(rust, ChatTemplate(None, {}), name="two-pass", limits=TokenizeLimits())
    splitter = tok._splitter
    assert splitter is not None and len(splitter.passes) == 2
    for text in ("xabcx", "ab bc abc bcab", "zabx ycbc", "abab cbcb"):
        expected = rust.encode(text, add_special_tokens=False).ids
        assert encode_segmented(text, splitter, SegmentCache(min_chars=0), tok._raw) == expected
    assert splitter.split("xabcx") == ["xa", "bc", "x"]


def test_normalised_tokens_are_not_split_points_under_a_real_normaliser() -> None:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.normalizer = normalizers.Lowercase()
    rust.add_tokens([RustAddedToken("<turn>", normalized=True), RustAddedToken("<raw>", normalized=False)])
    tok = HfTokenizer(rust, ChatTemplate(None, {}), name="lower", limits=TokenizeLimits())
    splitter = tok._splitter
    assert splitter is not None and set(splitter.ids) == {"<raw>"}
    text = "Hello <TURN> world <raw> HELLO <turn>"
    assert (
        tok.encode_prompt(text, add_special_tokens=False) == rust.encode(text, add_special_tokens=False).ids
    )


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=600), add_special_tokens=st.booleans())
def test_gil_free_encode_gives_the_ids_of_encode(text: str, add_special_tokens: bool) -> None:
    """``encode_batch_fast`` (used because it releases the GIL) returns ``encode``'s ids exactly."""
    tok = shared_tokenizer()
    expected = tok._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    assert tok._ids(text, add_special_tokens) == expected


def test_gil_free_encode_gives_the_ids_of_encode_on_long_chats(tokenizer: HfTokenizer) -> None:
    rng = random.Random(11)
    for _ in range(20):
        text = tokenizer.render_chat(chat(rng, rng.randint(100, 3000)))
        assert tokenizer._ids(text, False) == plain(tokenizer, text)
        assert tokenizer._ids(text, True) == tokenizer._tokenizer.encode(text).ids


def test_a_long_encode_in_a_thread_lets_other_threads_run(tokenizer: HfTokenizer) -> None:
    """While a worker thread encodes a ~200k-token prompt, this thread keeps running Python code:
    the encode does not hold the GIL (``Tokenizer.encode`` would: this thread would wake only after it).
    """
    rng = random.Random(3)
    text = " ".join(rng.choice(WORDS) for _ in range(150_000))
    started, done = threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        tokenizer.encode_prompt(text)
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    started.wait()
    ran_meanwhile = 0
    while not done.is_set():
        time.sleep(0.001)
        ran_meanwhile += 1 if not done.is_set() else 0
    worker.join()
    assert ran_meanwhile >= 20


def reference_split(text: str, passes: list[list[str]]) -> list[str]:
    """Leftmost-longest matching, pass by pass, written the slow obvious way."""
    pieces, tokens_so_far = [text], set[str]()
    for tokens in passes:
        out: list[str] = []
        for piece in pieces:
            if piece in tokens_so_far:
                out.append(piece)
                continue
            start = position = 0
            while position < len(piece):
                hits = [t for t in tokens if piece.startswith(t, position)]
                if not hits:
                    position += 1
                    continue
                longest = max(hits, key=len)
                out += [piece[start:position], longest] if position > start else [longest]
                start = position = position + len(longest)
            if start < len(piece):
                out.append(piece[start:])
        pieces, tokens_so_far = out, tokens_so_far | set(tokens)
    return pieces


PASS_TOKENS = [["<a>", "<ab>", "<abc>", "<b", "|x|"], ["<ab", "<abd>", "b<", "|x", "<a>"]]


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="<>abcdx| ", max_size=300))
def test_splitter_is_leftmost_longest_per_pass(text: str) -> None:
    """Tokens sharing prefixes, one in both passes, texts full of ``<`` (past ``MAX_PROBES``, the
    regex fallback): the pieces of :meth:`Splitter.split` are those of the obvious algorithm."""
    added = [
        AddedToken(token, index, special=False, verbatim=True, normalized=bool(number))
        for number, tokens in enumerate(PASS_TOKENS)
        for index, token in enumerate(tokens)
    ]
    splitter = build_splitter(added, identity_normalizer=True)
    assert splitter is not None
    expected_passes = [PASS_TOKENS[0], [t for t in PASS_TOKENS[1] if t not in PASS_TOKENS[0]]]
    assert splitter.split(text) == reference_split(text, expected_passes)
    assert splitter.split(text * 8) == reference_split(text * 8, expected_passes)


def test_a_longest_first_pass_token_is_kept_whole_in_the_second_pass() -> None:
    """Only pieces no longer than the longest token are looked up as tokens (a longer one would be
    hashed whole for nothing): the longest token, matched in the first pass, is still a token in the
    second, whose own token would otherwise cut it."""
    added = [
        AddedToken("<abc>", 0, special=False, verbatim=True),
        AddedToken("<ab", 1, special=False, verbatim=True, normalized=True),
    ]
    splitter = build_splitter(added, identity_normalizer=True)
    assert splitter is not None and splitter.longest == len("<abc>")
    assert splitter.split("x<abc>y<abz") == ["x", "<abc>", "y", "<ab", "z"]
    assert splitter.split("<abc>") == ["<abc>"]


def test_cached_ids_point_at_the_shared_ints() -> None:
    """A miss stores the encoded ids as the cache's shared int objects (equal values, one object per
    id); ids past the shared ones are kept as they are, and so are one id or none."""
    ints = tuple(range(1000))  # past 256 each its own object, so identity is visible
    cache = SegmentCache(max_tokens=1000, min_chars=1, ints=ints)
    fresh = [int(text) for text in ("700", "999", "700", "0")]  # equal values, other objects
    assert fresh[0] is not ints[700]
    got = cache.ids("abc", lambda s: fresh)
    assert got == (700, 999, 700, 0) and all(value is ints[value] for value in got)
    assert cache.ids("abc", lambda s: [1]) is got  # a hit: the stored tuple
    assert cache.ids("past", lambda s: [500, 1000, 2]) == (500, 1000, 2)  # 1000 is past ints
    one = cache.ids("one", lambda s: [int("300")])
    assert one == (300,) and one[0] is ints[300]
    assert cache.ids("none", lambda s: []) == ()
