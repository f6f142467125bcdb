"""A long text is encoded in pieces and refused once surely over the limit, never falsely.

Every tokenizer the tests have (the real DeepSeek-V3 one, the tiny WordLevel ones) is checked the
same way: the verdict and the ids of :class:`HfTokenizer` with a small ``max_prompt_tokens`` and
small pieces against a plain encode of the whole text by the Rust tokenizer, for texts and chats.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import unicodedata
from collections.abc import Callable
from typing import Any

import pytest
from fuzz_examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken as RustAddedToken
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, normalizers, pre_tokenizers, processors

from balancer.tokenizer.chat_template import ChatTemplate
from balancer.tokenizer.cuts import CUT, PIECE_CHARS, cuts_apply, encode_pieces, next_cut
from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.tokenizer import HfTokenizer, PromptTooLarge, TokenizeLimits

WHITE_SPACE = [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029]
WHITE_SPACE += [0x202F, 0x205F, 0x3000]
"""Unicode's ``White_Space`` property (PropList.txt), what Oniguruma's ``\\s`` matches."""

SEPARATORS = {"Zs", "Zl", "Zp", "Cc", "Cf"}
ALPHABET = list("ab Zy\n\n\n  \t\r1234.,!?'-_()\u00e9\u4e2d\u6587\U0001f600\u0301\u00a0\x1c")
FRAGMENTS = [
    *ALPHABET,
    "hello",
    " world",
    "yz",
    "'s",
    "345",
    "\n\n",
    "\u4e2d\u6587",
    "<turn>",
    "<\uff5cUser\uff5c>",
]
TEXTS = (
    st.lists(st.sampled_from(FRAGMENTS), max_size=150).map("".join)
    | st.text(alphabet=st.sampled_from(ALPHABET), max_size=300)
    | st.text(max_size=120)
)
"""Texts full of cuts and of what is next to them (newlines, spaces, letters, digits, marks,
symbols, CJK, whitespace ``str.isspace`` counts that Oniguruma does not, added tokens of both
kinds of tokenizer), and any text at all."""
LIMITS = st.sampled_from([None, None, None, 1, 11, 40, 250])
OFFSETS = st.sampled_from([0, 0, -1, 1, -2, 2, -7, 7])
"""A limit of its own, or ``None``: the text's own count (then moved by an offset: just over,
at, just under)."""
PIECES = st.sampled_from([1, 2, 5, 13, 40])
"""Piece sizes (characters)."""


@functools.cache
def deepseek() -> RustTokenizer:
    tok = default_tokenizer()
    rust: RustTokenizer = tok._tokenizer
    return rust


@functools.cache
def deepseek_template() -> ChatTemplate:
    return default_tokenizer()._chat


def word_level(pre_tokenizer: Any, *, template: bool = False, normalizer: Any = None) -> RustTokenizer:
    """A tiny WordLevel tokenizer as the other tests build them (every character and a few words)."""
    vocab = {"[UNK]": 0, "<s>": 1, "hello": 2, "world": 3, "ab": 4}
    for char in "".join(ALPHABET):
        vocab.setdefault(char, len(vocab))
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        rust.normalizer = normalizer
    rust.add_special_tokens(["<s>"])
    rust.add_tokens([RustAddedToken("<turn>", normalized=False)])
    if template:
        rust.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return rust


RUST: dict[str, Callable[[], RustTokenizer]] = {
    "deepseek-v3": deepseek,
    "deepseek-v3-template": deepseek,
    "whitespace+bos": lambda: word_level(pre_tokenizers.Whitespace(), template=True),
    "whitespace-split": lambda: word_level(pre_tokenizers.WhitespaceSplit()),
    "chars": lambda: word_level(pre_tokenizers.Split("", "isolated"), normalizer=normalizers.Sequence([])),
    "lowercase": lambda: word_level(pre_tokenizers.Whitespace(), normalizer=normalizers.Lowercase()),
}
"""Whether each is cut: the first four are, the last two are encoded whole (no proof covers them).
All chat in ChatML but ``deepseek-v3-template``, which has DeepSeek-V3's own template (its chats
are split at its added tokens, segment by segment)."""


@functools.cache
def built(name: str, piece_chars: int) -> HfTokenizer:
    limits = TokenizeLimits(piece_chars=piece_chars)
    template = deepseek_template() if name == "deepseek-v3-template" else ChatTemplate(None, {})
    return HfTokenizer(RUST[name](), template, name=name, limits=limits)


def tokenizer(name: str, limit: int, piece_chars: int) -> HfTokenizer:
    """The tokenizer ``name`` with these limits: built once per piece size (building DeepSeek-V3's
    takes most of a second), its ``limits`` set for each example."""
    tok = built(name, piece_chars)
    tok.limits = TokenizeLimits(max_prompt_tokens=limit, piece_chars=piece_chars)
    return tok


def near(expected: list[int], limit: int | None, offset: int) -> int:
    """``limit``, or (``None``) the count of ``expected`` itself (the tightest limit it is within),
    moved by ``offset``; at least 1."""
    return max(1, (len(expected) if limit is None else limit) + offset)


def verdict(tok: HfTokenizer, call: Callable[[], list[int]], expected: list[int]) -> None:
    """``call`` gives ``expected`` when it is within the limit, and is refused when it is over,
    with a count that is a lower bound of the whole text's."""
    limit = tok.limits.max_prompt_tokens
    if len(expected) <= limit:
        assert call() == expected  # never a false refusal, and the ids of a whole encode
        return
    with pytest.raises(PromptTooLarge) as refused:
        call()
    assert limit < refused.value.size <= len(expected)


def test_the_tokenizers_the_proof_covers() -> None:
    assert [tokenizer(name, 10, 1)._cuts for name in RUST] == [True, True, True, True, False, False]
    specials = [tokenizer(name, 10, 1)._cuts_special for name in RUST]
    assert specials == [True, True, False, True, False, False]


def covered(
    state: Any,
    *,
    identity: bool = True,
    added: tuple[tuple[str, bool], ...] = (("<s>", True),),
    dropout: float | None = None,
) -> bool:
    return cuts_apply(state, identity_normalizer=identity, added=added, dropout=dropout)


def test_what_the_proof_does_not_cover_is_refused_by_cuts_apply() -> None:
    state = json.loads(deepseek().pre_tokenizer.__getstate__())
    assert covered(state)
    assert not covered(state, identity=False)
    assert not covered(state, dropout=0.1)
    for added in ((("<s>", False),), (("a\nb", True),), (("a b", True),)):
        assert not covered(state, added=added)
    stages = state["pretokenizers"]
    for changed in (
        stages[:2] + stages[3:],  # no stage closes a cut
        [stages[3], *stages[:3]],  # ByteLevel first: the regexes would see its characters
        [*stages[:3], {**stages[3], "use_regex": True}],
        [*stages[:3], {**stages[3], "add_prefix_space": True}],
        [{**stages[2], "pattern": {"Regex": stages[2]["pattern"]["Regex"] + "|x"}}],
        [{**stages[2], "behavior": "Removed"}],
        [{"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}],
        [],
    ):
        assert not covered({"type": "Sequence", "pretokenizers": changed})
    assert covered({"type": "Sequence", "pretokenizers": stages[2:]})
    assert covered({"type": "Whitespace"})
    assert not covered(None)


def test_isspace_holds_all_unicode_white_space() -> None:
    """The proof needs ``text[p]`` outside Oniguruma's ``\\s``: ``str.isspace`` (Python's ``\\s``)
    covers all of it, so a character the cut regex takes for not whitespace is not."""
    assert all(chr(point).isspace() for point in WHITE_SPACE)
    cuts = [[m.end() for m in CUT.finditer(f"a\n{chr(point)}b")] for point in WHITE_SPACE]
    assert [at for at in cuts if 2 in at] == []  # no cut between the newline and the whitespace


def test_every_character_after_a_newline_or_before_a_space_cuts_deepseek_alike() -> None:
    """The cut rules on DeepSeek-V3 with every character beside the cut: the code points up to
    U+3100, every other separator, control and format character, and every 101st other one."""
    rust = deepseek()
    chars = [
        chr(point)
        for point in range(sys.maxunicode + 1)
        if not 0xD800 <= point < 0xE000
        and (point < 0x3100 or point % 101 == 0 or unicodedata.category(chr(point)) in SEPARATORS)
    ]
    assert len(chars) > 20_000

    def ids(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in rust.encode_batch_fast(texts, add_special_tokens=False)]

    for before, after in (("x \n", ""), ("(a", " ")):
        kept = [c for c in chars if after or not c.isspace()]
        wholes = ids([f"{before}{after}{c}y z\n" for c in kept])
        heads = ids([before])[0]
        tails = ids([f"{after}{c}y z\n" for c in kept])
        assert [c for c, whole, tail in zip(kept, wholes, tails, strict=True) if whole != heads + tail] == []


def unsafe_cuts(rust: RustTokenizer, texts: list[str], cut: re.Pattern[str]) -> list[tuple[str, int]]:
    """Each ``(text, p)`` where ``cut`` cuts ``text`` (a match's end ``p``, ``0 < p < len(text)``)
    and the pieces' ids, end to end, are not the whole text's (no special tokens)."""
    found = [(text, m.end()) for text in texts for m in cut.finditer(text) if 0 < m.end() < len(text)]

    def ids(parts: list[str]) -> list[list[int]]:
        return [e.ids for e in rust.encode_batch_fast(parts, add_special_tokens=False)]

    wholes = ids([text for text, _ in found])
    heads = ids([text[:at] for text, at in found])
    tails = ids([text[at:] for text, at in found])
    return [at for at, w, h, t in zip(found, wholes, heads, tails, strict=True) if w != h + t]


def not_whitespace() -> list[str]:
    """The characters of :func:`test_every_character_after_a_newline_or_before_a_space_cuts_deepseek_alike`
    that ``str.isspace`` calls not whitespace: what may stand before a space cut."""
    return [
        chr(point)
        for point in range(sys.maxunicode + 1)
        if not 0xD800 <= point < 0xE000
        and not chr(point).isspace()
        and (point < 0x3100 or point % 101 == 0 or unicodedata.category(chr(point)) in SEPARATORS)
    ]


def space_cuts_alike(contexts: list[tuple[str, str]], befores: list[str]) -> None:
    """Every character before the space in each ``(head, tail)`` context (``CUT`` cuts after it,
    and every cut it makes there is safe), and after the space behind each of ``befores``."""
    rust, chars = deepseek(), not_whitespace()
    assert len(chars) > 20_000
    for head, tail in contexts:
        texts = [f"{head}{c}{tail}" for c in chars]
        assert [t for t in texts if len(head) + 1 not in {m.end() for m in CUT.finditer(t)}] == []
        assert unsafe_cuts(rust, texts, CUT) == []
    for before in befores:
        assert unsafe_cuts(rust, [f"({before} {c}y z\n" for c in chars], CUT) == []


def test_a_space_after_any_character_but_whitespace_cuts_deepseek_alike() -> None:
    """The space cut (before h-perf19 only after an ASCII letter): ``CUT`` cuts after every
    character but whitespace before a space, and each such cut is safe."""
    space_cuts_alike([("x", " y")], [])


@pytest.mark.faults_long
def test_a_space_after_any_character_cuts_deepseek_alike_in_every_context() -> None:
    """The same in contexts that end runs of each kind before the character (letters, whitespace,
    a newline, punctuation, digits, CJK, a mark, a tab) and start them after the space (one space or
    two, a newline, punctuation, digits, CJK, emoji), and with every character after the space
    behind one of each kind (about 70 s)."""
    contexts = [(" ", "  y"), ("\n", " \nz"), (".", " ."), ("1", " 12"), ("\u4e2d", " \u6587")]
    contexts += [("\u0301", " \u0301"), ("'", " 's"), ("", " "), ("\t", " \U0001f600")]
    befores = [".", "1", "\u4e2d", "\u0301", "\u200d", "\U0001f600", "\x1c", "\u00ad"]
    space_cuts_alike(contexts, befores)


def test_the_cuts_the_proof_rules_out_are_unsafe_and_never_made() -> None:
    """The checker above finds what a cut rule gets wrong: a rule that also cut between a character
    and a newline, or between whitespace and a space, would split pre-tokens DeepSeek-V3 keeps
    whole (``".\\n"``, ``"  "``, ``" \\t"``); ``CUT`` makes none of those cuts."""
    rust = deepseek()
    texts = [".\nx", "a   b", "a \t b", "x \u00a0 y", "1 \n", "a. \n", "word.\nnext", "so   far"]
    too_many = re.compile(r"\n(?!\s)|\S(?=\s)|\s(?=\s)")  # also before any whitespace
    assert {text for text, _ in unsafe_cuts(rust, texts, too_many)} == set(texts)
    assert unsafe_cuts(rust, texts, CUT) == []
    # after the newline, then each letter before a space; none inside the runs of whitespace
    assert [m.end() for m in CUT.finditer(".\nx a   b \t c")] == [2, 3, 5, 9]
    cuts = [m.end() for m in CUT.finditer("Question 199: result (sic) \u4e2d \u200d end")]
    assert cuts == [8, 13, 20, 26, 28, 30]  # after a letter, a colon, a parenthesis, CJK, U+200D


@pytest.mark.parametrize("name", [name for name in RUST if name != "deepseek-v3-template"])
@settings(max_examples=examples(300), deadline=None)
@given(text=TEXTS, limit=LIMITS, offset=OFFSETS, piece_chars=PIECES, special=st.booleans())
def test_a_text_is_refused_only_when_over_and_gets_the_whole_texts_ids(
    name: str, text: str, limit: int | None, offset: int, piece_chars: int, special: bool
) -> None:
    expected = built(name, piece_chars)._tokenizer.encode(text, add_special_tokens=special).ids
    tok = tokenizer(name, near(expected, limit, offset), piece_chars)
    verdict(tok, lambda: tok.encode_prompt(text, add_special_tokens=special), expected)


@pytest.mark.parametrize("name", list(RUST))
@settings(max_examples=examples(200), deadline=None)
@given(
    contents=st.lists(TEXTS, min_size=1, max_size=4),
    limit=LIMITS,
    offset=OFFSETS,
    piece_chars=PIECES,
)
def test_a_chat_is_refused_only_when_over_and_gets_the_whole_chats_ids(
    name: str, contents: list[str], limit: int | None, offset: int, piece_chars: int
) -> None:
    """Chats: the template adds tokens, and the segments between added tokens are counted together
    (through the segment cache, whose hits are not counted: a lower bound still)."""
    tok = built(name, piece_chars)
    messages = [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(contents)]
    expected = tok._tokenizer.encode(tok.render_chat(messages), add_special_tokens=False).ids
    tok = tokenizer(name, near(expected, limit, offset), piece_chars)
    verdict(tok, lambda: tok.encode_chat(messages), expected)


def test_a_long_text_far_over_is_refused_after_a_few_pieces() -> None:
    """Over the limit, only about the limit's worth of text is encoded: the rest is never seen."""
    rust = deepseek()
    seen: list[str] = []

    def encode(piece: str) -> list[int]:
        seen.append(piece)
        ids: list[int] = rust.encode_batch_fast([piece], add_special_tokens=False)[0].ids
        return ids

    text = "The quick brown fox jumps over the lazy dog.\n" * 20_000  # 900,000 characters
    ids, count = encode_pieces(text, encode, 1_000, min_chars=1_000)
    assert ids is None and count > 1_000
    assert sum(map(len, seen)) < 12_000  # about 1,000 tokens of 10 a line, and one piece past
    assert "".join(seen) == text[: sum(map(len, seen))]
    whole, count = encode_pieces(text[:20_000], encode, 10**6, min_chars=1_000)
    assert whole == rust.encode(text[:20_000], add_special_tokens=False).ids and count == len(whole)


def test_pieces_end_at_the_first_cut_past_their_size() -> None:
    text = "aaaa bbbb\ncccc"
    assert next_cut(text, 0, 1) == 4  # after the letter before the space
    assert next_cut(text, 0, 5) == 10  # after the newline before "c"
    assert next_cut(text, 0, 11) is None
    assert next_cut("a\n\n b", 0, 1) is None  # newlines before whitespace, a space after one
    assert TokenizeLimits().piece_chars == PIECE_CHARS


def test_the_default_tokenizer_refuses_a_long_prompt_with_a_lower_bound() -> None:
    tok = default_tokenizer(TokenizeLimits(max_prompt_tokens=2_000, piece_chars=1_000))
    text = "alpha river stone\n" * 5_000  # 90,000 characters, 15,000 tokens
    with pytest.raises(PromptTooLarge, match=r"at least \d+ tokens \(the rest was not tokenized\)") as over:
        tok.encode_prompt(text)
    assert 2_000 < over.value.size < 2_400 and over.value.at_least
    with pytest.raises(PromptTooLarge, match="at least") as chat:
        tok.encode_chat([{"role": "system", "content": text[:9_000]}, {"role": "user", "content": text}])
    assert 2_000 < chat.value.size < 2_400
    within = text[:9_000]
    assert tok.encode_prompt(within) == tok._tokenizer.encode(within).ids
