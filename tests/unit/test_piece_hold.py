"""What a text encoded in pieces holds of the byte budget, and the thread's stop before a piece
longer than that hold.

A text prompt the tokenizer encodes in pieces (:mod:`balancer.tokenizer.cuts`) holds one piece's
work (:data:`~balancer.api.openai.PIECE_HOLD_FACTOR` times ``piece_chars``) plus its ids' list
(:func:`~balancer.api.openai.tokenizing_hold_bytes`); a piece that would be longer makes
``encode_prompt(max_piece_chars=...)`` raise :class:`~balancer.tokenizer.cuts.LongPiece` before it
encodes anything. Checked here: the windowed scan for cuts finds what one search over the whole
text finds, the stop comes exactly when a piece would be too long and never changes the ids, the
hold's terms (ids per character, the token limit) bound what a real tokenizer makes, and which
requests get the pieces' hold (text prompts and chats over ``piece_chars`` on a tokenizer the
proof covers; never a short text, token ids or another tokenizer), and a chat's: its rendering,
its ids at :data:`~balancer.api.openai.CHAT_TOKEN_ID_BYTES`, the thread's stop before a segment's
piece or a rendered chat longer than held, else the ids of the whole encode."""

from __future__ import annotations

import functools
import json
import random

import pytest
from fuzz_examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from balancer.api.openai import (
    CHAT_TOKEN_ID_BYTES,
    MAX_TOKENS_PER_CHAR,
    PIECE_HOLD_FACTOR,
    RENDER_BYTES_PER_ASCII_CHAR,
    RENDER_BYTES_PER_CHAR,
    TOKEN_ID_LIST_BYTES,
    TOKENIZER_BYTES_PER_ASCII_CHAR,
    TOKENIZER_BYTES_PER_CHAR,
    piece_hold_chars,
    tokenizing_hold_bytes,
)
from balancer.api.parsing import ParsedRequest, parse_request
from balancer.tokenizer.chat_template import ChatTemplate
from balancer.tokenizer.cuts import CUT, LongPiece, encode_pieces, next_cut
from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.tokenizer import HfTokenizer, LongRender, TokenIdTokenizer, TokenizeLimits

ALPHABET = list("ab Z\n\n  \t1.\u00e9\u4e2d")
TEXTS = st.text(alphabet=st.sampled_from(ALPHABET), max_size=200) | st.lists(
    st.sampled_from(["aaaa", "1111", "    ", "\n\n", "a ", "\na", "Zz", "\u4e2d\u4e2d"]), max_size=60
).map("".join)
"""Texts with cuts now and then, long runs without (digits, spaces, newlines, CJK) and the
characters beside a cut on either side."""


def reference_cut(text: str, start: int, min_chars: int) -> int | None:
    """The cut as the module found it before its scan was windowed: one search to the text's end."""
    found = CUT.search(text, start + max(min_chars, 1) - 1)
    if found is None:
        return None
    cut = found.end()
    return cut if cut < len(text) else None


def reference_pieces(text: str, min_chars: int) -> list[int]:
    """The pieces' lengths, cut as :func:`reference_cut` cuts."""
    lengths, start = [], 0
    while start < len(text):
        cut = reference_cut(text, start, min_chars)
        end = len(text) if cut is None else cut
        lengths.append(end - start)
        start = end
    return lengths


@settings(max_examples=examples(600), deadline=None)
@given(
    TEXTS,
    st.integers(0, 40),
    st.integers(1, 30),
    st.one_of(st.none(), st.integers(0, 40)),
    st.integers(1, 9),
)
def test_the_windowed_scan_finds_the_whole_search_s_cut_or_stops_at_max_chars(
    text: str, start: int, min_chars: int, extra: int | None, scan_chars: int
) -> None:
    start = min(start, len(text))
    expected = reference_cut(text, start, min_chars)
    assert next_cut(text, start, min_chars, scan_chars=scan_chars) == expected
    if extra is None:
        return
    max_chars = min_chars + extra
    piece = (len(text) if expected is None else expected) - start
    if piece > max_chars:
        with pytest.raises(LongPiece) as long:
            next_cut(text, start, min_chars, max_chars, scan_chars=scan_chars)
        assert (long.value.start, long.value.max_chars) == (start, max_chars)
    else:
        assert next_cut(text, start, min_chars, max_chars, scan_chars=scan_chars) == expected


@settings(max_examples=300, deadline=None)
@given(TEXTS, st.integers(1, 12), st.integers(0, 20))
def test_a_piece_too_long_stops_before_anything_is_encoded_and_else_the_ids_are_the_same(
    text: str, min_chars: int, extra: int
) -> None:
    max_chars = min_chars + extra
    encoded: list[str] = []

    def encode(piece: str) -> list[int]:
        encoded.append(piece)
        return [ord(c) for c in piece]

    if max(reference_pieces(text, min_chars), default=0) > max_chars:
        with pytest.raises(LongPiece):
            encode_pieces(text, encode, len(text), min_chars, max_chars)
        assert encoded == []  # every end was found first: nothing encoded, no CPU spent on it
    else:
        ids, count = encode_pieces(text, encode, len(text), min_chars, max_chars)
        assert ids == [ord(c) for c in text] and count == len(text)
        assert all(len(piece) <= max_chars for piece in encoded)


@functools.cache
def deepseek() -> HfTokenizer:
    return default_tokenizer()


def shaped(shape: str, chars: int, rng: random.Random) -> str:
    words = ["alpha", "river", "stone", "number", "quiet"]
    if shape == "words":
        return " ".join(rng.choice(words) for _ in range(chars // 5))[:chars]
    if shape == "random_ascii":
        return "".join(map(chr, rng.choices(range(0x20, 0x7F), k=chars)))
    if shape == "latin1":
        return rng.randbytes(chars).decode("latin-1")
    if shape == "emoji_lines":  # cuts at each newline before an emoji
        return "".join(
            chr(rng.randrange(0x1F600, 0x1F650)) + ("\n" if i % 50 == 49 else "") for i in range(chars)
        )
    if shape == "digits":
        return "".join(rng.choices("0123456789", k=chars))
    raise ValueError(shape)


@pytest.mark.parametrize("shape", ["words", "random_ascii", "latin1", "emoji_lines", "digits"])
def test_the_real_tokenizer_in_pieces_gives_the_same_ids_or_stops_and_never_more_tokens_than_held(
    shape: str,
) -> None:
    rng = random.Random(shape)
    tok = deepseek()
    tok.limits = TokenizeLimits(piece_chars=2_000)
    text = shaped(shape, 30_000, rng)
    whole = tok.encode_prompt(text)  # no bound: pieces however long
    assert tok.encodes_in_pieces(len(text))
    max_piece = PIECE_HOLD_FACTOR * tok.limits.piece_chars
    if max(reference_pieces(text, tok.limits.piece_chars)) > max_piece:
        assert shape == "digits"  # no cut at all
        with pytest.raises(LongPiece):
            tok.encode_prompt(text, max_piece_chars=max_piece)
    else:
        assert tok.encode_prompt(text, max_piece_chars=max_piece) == whole
    # what the hold counts of the ids: one a character of ASCII text, four of any other
    per_char = 1 if text.isascii() else MAX_TOKENS_PER_CHAR
    assert len(whole) <= per_char * len(text)


def completion(prompt: str | list[int]) -> ParsedRequest:
    return parse_request(json.dumps({"model": "m", "prompt": prompt}).encode(), "completions")


def chat_of(*contents: str, system: str | None = None) -> ParsedRequest:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages += [{"role": "user", "content": content} for content in contents]
    return parse_request(json.dumps({"model": "m", "messages": messages}).encode(), "chat")


def test_the_pieces_hold_is_one_piece_s_work_and_the_ids_list() -> None:
    tok = deepseek()
    tok.limits = TokenizeLimits(max_prompt_tokens=262_144)
    piece = PIECE_HOLD_FACTOR * tok.limits.piece_chars
    for text, rate, ids_per_char in (
        ("alpha river " * 87_382, TOKENIZER_BYTES_PER_ASCII_CHAR, 1),
        ("\u00e9t\u00e9 " * 262_144, TOKENIZER_BYTES_PER_CHAR, MAX_TOKENS_PER_CHAR),
    ):
        parsed = completion(text)
        assert piece_hold_chars(tok, parsed) == piece
        whole = tokenizing_hold_bytes(parsed)
        assert whole == parsed.parsed_bytes + rate * len(text)
        held = tokenizing_hold_bytes(parsed, piece, tok.limits.max_prompt_tokens)
        ids = min(ids_per_char * len(text), tok.limits.max_prompt_tokens + ids_per_char * piece)
        assert held == parsed.parsed_bytes + rate * piece + TOKEN_ID_LIST_BYTES * ids
        assert held < whole / 2
        # a higher token limit lets more ids accumulate before the stop: more is held, never more
        # than the ids one a character (or four) of the whole text could make
        higher = tokenizing_hold_bytes(parsed, piece, 10**9)
        assert (
            held
            < higher
            == parsed.parsed_bytes + rate * piece + TOKEN_ID_LIST_BYTES * ids_per_char * len(text)
        )
    # a text shorter than a piece holds its own length's work, not a whole piece's, and never more
    # than the whole encode's estimate (the ids' term would pass it for a text of a piece or two)
    short = completion("word " * 20_000)
    assert tok.encodes_in_pieces(short.text_chars)
    pieces = short.parsed_bytes + (TOKENIZER_BYTES_PER_ASCII_CHAR + TOKEN_ID_LIST_BYTES) * short.text_chars
    assert tokenizing_hold_bytes(short, piece, 10**9) == tokenizing_hold_bytes(short) < pieces


def test_only_a_long_text_prompt_or_chat_on_a_tokenizer_the_proof_covers_gets_the_pieces_hold() -> None:
    tok = deepseek()
    tok.limits = TokenizeLimits()
    long_text = "alpha river " * 10_000
    assert piece_hold_chars(tok, completion(long_text)) == PIECE_HOLD_FACTOR * tok.limits.piece_chars
    assert piece_hold_chars(tok, completion(long_text[: tok.limits.piece_chars])) is None  # encoded whole
    assert piece_hold_chars(tok, completion([1, 2, 3] * 30_000)) is None  # token ids
    # a chat whose text is over a piece: rendered and encoded in pieces in the thread (h-chathold;
    # it held the whole encode's estimate before), a short one is encoded whole
    assert piece_hold_chars(tok, chat_of(long_text)) == PIECE_HOLD_FACTOR * tok.limits.piece_chars
    assert piece_hold_chars(tok, chat_of(long_text[: tok.limits.piece_chars - 200])) is None
    assert piece_hold_chars(TokenIdTokenizer(), completion(long_text)) is None
    assert piece_hold_chars(TokenIdTokenizer(), chat_of(long_text)) is None
    # a tokenizer the proof does not cover (a normaliser that changes the text) encodes whole
    vocab = {"[UNK]": 0, "alpha": 1, "river": 2}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.normalizer = normalizers.Lowercase()
    other = HfTokenizer(rust, ChatTemplate(None, {}), name="lowercase", limits=TokenizeLimits())
    assert not other.encodes_in_pieces(len(long_text))
    assert piece_hold_chars(other, completion(long_text)) is None
    assert piece_hold_chars(other, chat_of(long_text)) is None
    # and one that encodes in pieces ignores no bound: a text without a cut for long stops
    with pytest.raises(LongPiece):
        tok.encode_prompt("7" * 200_000, max_piece_chars=PIECE_HOLD_FACTOR * tok.limits.piece_chars)


def test_a_chat_s_pieces_hold_adds_its_rendering_and_its_ids_through_the_segment_cache() -> None:
    tok = deepseek()
    tok.limits = TokenizeLimits(max_prompt_tokens=262_144)
    piece = PIECE_HOLD_FACTOR * tok.limits.piece_chars
    for text, rate, render, ids_per_char in (
        ("alpha river " * 87_382, TOKENIZER_BYTES_PER_ASCII_CHAR, RENDER_BYTES_PER_ASCII_CHAR, 1),
        ("\u00e9t\u00e9 " * 262_144, TOKENIZER_BYTES_PER_CHAR, RENDER_BYTES_PER_CHAR, MAX_TOKENS_PER_CHAR),
    ):
        parsed = chat_of(text)
        chars = parsed.text_chars
        assert chars > len(text)  # the per-message allowance and the role
        assert piece_hold_chars(tok, parsed) == piece
        whole = tokenizing_hold_bytes(parsed)
        assert whole == parsed.parsed_bytes + rate * chars
        held = tokenizing_hold_bytes(parsed, piece, tok.limits.max_prompt_tokens)
        ids = min(ids_per_char * chars, tok.limits.max_prompt_tokens + ids_per_char * piece)
        assert held == parsed.parsed_bytes + render * chars + rate * piece + CHAT_TOKEN_ID_BYTES * ids
        assert held < whole / 2
        # a text prompt of the same text holds less: no rendering, its ids not through the cache
        assert tokenizing_hold_bytes(completion(text), piece, 262_144) - completion(text).parsed_bytes < (
            held - parsed.parsed_bytes
        )
    # a chat of a piece or two holds no more than the whole encode's estimate
    short = chat_of("word " * 14_000)
    assert tok.encodes_in_pieces(short.text_chars, add_special_tokens=False)
    assert tokenizing_hold_bytes(short, piece, 10**9) == tokenizing_hold_bytes(short)


def test_a_chat_in_pieces_gives_the_whole_encode_s_ids_or_stops_before_encoding() -> None:
    rng = random.Random(7)
    choices = ["alpha", "river", "stone", "\u00e9t\u00e9", "7", "x.\ny", "<\uff5cUser\uff5c>"]
    words = " ".join(rng.choice(choices) for _ in range(9_000))
    chats = [
        [{"role": "user", "content": words}],
        [{"role": "system", "content": words[:20_000]}, {"role": "user", "content": words[20_000:]}],
        [
            {"role": "user", "content": words[:15_000]},
            {"role": "assistant", "content": words[15_000:30_000]},
            {"role": "user", "content": [{"type": "text", "text": words[30_000:]}]},
        ],
    ]
    digits = "".join(rng.choices("0123456789", k=12_000))
    no_cut = [{"role": "user", "content": "a question about these digits\n" + digits}]
    # with the segment cache (segments between added tokens, each over a piece in pieces) and
    # without (the rendered text in pieces), each a fresh tokenizer: nothing cached beforehand
    for cache_tokens in (2_000_000, 0):
        limits = TokenizeLimits(piece_chars=4_096, segment_cache_tokens=cache_tokens)
        tok = default_tokenizer(limits)
        assert (tok.segment_cache is None) == (cache_tokens == 0)
        piece = PIECE_HOLD_FACTOR * limits.piece_chars
        for messages in chats:
            parsed = parse_request(json.dumps({"model": "m", "messages": messages}).encode(), "chat")
            assert piece_hold_chars(tok, parsed) == piece
            rendered = tok.render_chat(messages)
            assert len(rendered) <= parsed.text_chars  # what the hold assumes (the thread checks)
            whole = tok._raw(rendered)  # one encode of the whole rendered chat
            assert tok.encode_chat_in_pieces(messages, {}, piece, parsed.text_chars) == whole
            assert len(whole) <= parsed.text_chars  # ASCII, a few é: within the ids' term
        # a message without a safe cut for two pieces' length stops the thread before its pieces
        # are encoded (LongPiece); the request then holds the whole estimate and encodes it whole
        parsed = parse_request(json.dumps({"model": "m", "messages": no_cut}).encode(), "chat")
        assert piece_hold_chars(tok, parsed) == piece
        with pytest.raises(LongPiece):
            tok.encode_chat_in_pieces(no_cut, {}, piece, parsed.text_chars)
        assert tok.encode_chat(no_cut) == tok._raw(tok.render_chat(no_cut))
        # a rendered chat longer than held (here: held for fewer characters than it has) stops too,
        # as a LongPiece, before anything is encoded
        with pytest.raises(LongRender):
            tok.encode_chat_in_pieces(chats[0], {}, piece, 1_000)


def test_a_chat_on_a_tokenizer_without_cuts_is_encoded_whole_and_holds_the_whole_estimate() -> None:
    vocab = {"[UNK]": 0, "alpha": 1, "river": 2}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.normalizer = normalizers.Lowercase()
    limits = TokenizeLimits(piece_chars=1_000)
    other = HfTokenizer(rust, ChatTemplate(None, {}), name="lowercase", limits=limits)
    parsed = chat_of("alpha river " * 1_000)
    assert not other.encodes_in_pieces(parsed.text_chars, add_special_tokens=False)
    assert piece_hold_chars(other, parsed) is None
