"""A chat's new text encoded word by word (``balancer.tokenizer.words``) gives a plain encode's ids.

``HfTokenizer.encode_chat_if_cached`` encodes the pieces its segment cache misses (a new user
message) through a :class:`WordMemo`: cut at the safe cuts of ``balancer.tokenizer.cuts`` and
answered from the memo, the missing words encoded together. These tests hold it to a plain encode on
the default tokenizer, hold the memo to its bounds, and check that a system prompt joined to the
template's text after it is found in the segment cache without being joined.
"""

from __future__ import annotations

import random
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.tokenizer import HfTokenizer, TokenizeLimits
from balancer.tokenizer.words import WordMemo, split_words, word_bytes

_TOKENIZER = default_tokenizer(TokenizeLimits())
assert isinstance(_TOKENIZER, HfTokenizer)
TOKENIZER: HfTokenizer = _TOKENIZER
SYSTEM = " ".join(f"rule {n}: answer briefly, cite sources." for n in range(60))
ALPHABET = "ab Z \n\t9é漢😀.,!?-'\"<>|"


def _plain(text: str) -> list[int]:
    return list(TOKENIZER._tokenizer.encode(text, add_special_tokens=False).ids)


def _chat(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def test_the_default_tokenizer_has_a_word_memo() -> None:
    assert TOKENIZER.word_memo is not None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet=ALPHABET, max_size=40), min_size=1, max_size=6))
def test_texts_word_by_word_match_a_plain_encode(texts: list[str]) -> None:
    memo = WordMemo(TOKENIZER._encode_offsets)
    for text in texts + texts:  # each text missing some words, then found whole
        assert "".join(split_words(text)) == text
        ids = memo.ids(text)
        assert ids is None or ids == _plain(text), text


def test_a_new_user_message_of_known_words_is_found_in_the_memo() -> None:
    memo = TOKENIZER.word_memo
    assert memo is not None
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "sigma", "omega", "kappa"]
    TOKENIZER.encode_chat(_chat("warm up"))  # the system prompt into the segment cache
    for round_ in range(40):
        user = f"Question {round_}: " + " ".join(rng.choice(words) for _ in range(30)) + "?"
        hits = memo.hits
        ids = TOKENIZER.encode_chat_if_cached(_chat(user), {}, 4096)
        assert ids is not None and list(ids) == TOKENIZER.encode_chat(_chat(user))
        if round_ >= 5:  # only " {round_}:" can be new: encoded with the rest, or found
            assert memo.hits > hits or memo.misses > 0


def test_words_are_cut_after_any_character_but_whitespace_before_a_space() -> None:
    """The space cut after punctuation, digits, CJK and emoji too (before h-perf19 only after an
    ASCII letter, so ``" 199: result"`` was one piece): a message whose only new text is its number
    encodes just that, and a known word behind new punctuation is found."""
    text = "Question 199: result, (sic) 漢 😀 x  two\t end"
    assert split_words(text) == ["Question", " 199:", " result,", " (sic)", " 漢", " 😀", " x", "  two\t end"]
    encoded: list[str] = []

    def encode_offsets(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoded.append(text)
        return TOKENIZER._encode_offsets(text)

    memo = WordMemo(encode_offsets)
    assert memo.ids("Question 198: result, early. autumn!") == _plain("Question 198: result, early. autumn!")
    assert memo.ids("Question 199: early. result, autumn!") == _plain("Question 199: early. result, autumn!")
    assert encoded[1:] == [" 199:"] and memo.hits == 0 and memo.misses == 2


def test_the_memo_keeps_to_its_bounds_and_counts_what_it_drops() -> None:
    memo = WordMemo(TOKENIZER._encode_offsets, max_words=50, max_bytes=10**9)
    text = " ".join(f"w{n}x" for n in range(200))
    assert memo.ids(text) == _plain(text)
    assert len(memo) == 50 and memo.evictions == 150
    by_bytes = WordMemo(TOKENIZER._encode_offsets, max_words=10**6, max_bytes=2_000)
    assert by_bytes.ids(text) == _plain(text)
    assert 0 < by_bytes.held_bytes <= 2_000 and by_bytes.evictions == 200 - len(by_bytes)
    assert by_bytes.held_bytes == sum(
        word_bytes(w, len(i)) for w, i in by_bytes._memo.items()
    )  # what it counts is what it holds
    long_word = "x" * 60
    memo.ids(f"a {long_word} b")
    assert long_word not in memo._memo and f" {long_word}" not in memo._memo  # over max_word_chars


def test_a_cached_system_prompt_and_the_text_after_it_are_found_without_a_join() -> None:
    """The template writes ``"\\n\\n"`` after the system prompt: the segment cache's piece is both,
    found by their parts (a join would allocate the prompt again)."""
    system = " ".join(f"rule {n}: be brief." for n in range(40_000))  # about 800,000 characters
    tokenizer = default_tokenizer(TokenizeLimits())
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "hi there"}]
    first = tokenizer.encode_chat(chat)
    assert tokenizer.encode_chat_if_cached(chat, {}, 4096) is not None  # makes the ids' u32 copy
    tracemalloc.start()
    try:
        ids = tokenizer.encode_chat_if_cached(chat, {}, 4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ids is not None and list(ids) == first
    assert peak - ids.itemsize * len(ids) < len(system) // 2, peak
