"""A long text encoded in pieces, refused once it is surely over the token limit (pure).

Before this, a text far over ``max_prompt_tokens`` was encoded whole and then refused: 4 M
characters cost 4 to 21 s of a tokenizer thread and about 100 times the text in memory
(``docs/reliability.md``, "Memory"). Here a text longer than :data:`PIECE_CHARS` is cut into pieces
at *safe cuts* and encoded piece by piece; the ids of the pieces, end to end, are the ids of the
whole text, so their running count is the whole text's count so far. Once it passes the limit the
text is refused (:class:`~balancer.tokenizer.tokenizer.PromptTooLarge`), the rest never encoded; a
text within the limit gets the concatenated ids: the same ids as a whole encode, made with the
working memory of one piece instead of the whole text's.

**Safe cuts.** A position ``p`` (``0 < p < len(text)``) is a cut when

* ``text[p - 1]`` is ``"\\n"`` and ``text[p]`` is not whitespace (``str.isspace``) (a *newline
  cut*), or
* ``text[p - 1]`` is not whitespace and ``text[p]`` is a space (``" "``) (a *space cut*: after a
  letter, a digit, a mark, punctuation, a symbol, CJK, a control or format character, anything but
  whitespace; until 2026-12-01, h-perf19, only after an ASCII letter).

**Why the pieces' ids are the whole's** (``ids(text) == ids(text[:p]) + ids(text[p:])``, without
special tokens), for a Hugging Face fast tokenizer that :func:`cuts_apply` accepts. ``tokenizers``
encodes in stages: (1) it finds the added tokens; (2) normalises the text between them; (3)
pre-tokenises each such segment into *pre-tokens*, through the stages of its pre-tokenizer in
turn, each splitting the pieces the previous one left; (4) runs the model (BPE, WordLevel,
WordPiece, Unigram) on each pre-token on its own; (5) the post-processor may add special tokens.
So the ids are the same when the pieces' pre-tokens, end to end, are the whole's. Stage by stage:

1. *Added tokens.* No added token's text holds ``"\\n"`` or ``" "``, so no match of one holds both
   ``text[p - 1]`` and ``text[p]``; none strips the whitespace beside it (:attr:`verbatim`), so none
   reaches across ``p`` by stripping. The matches (leftmost-longest, as :mod:`.segments` says) are
   then the same in ``text[:p]``, ``text[p:]`` and the whole: a longer match that would change a
   choice before ``p`` would span ``p``.
2. *Normaliser.* None, or one that changes nothing (an empty ``Sequence``): the text is as sent.
3. *Pre-tokenizer.* A ``Sequence`` of stages, each one of :data:`SAFE_STAGES`, or one such stage,
   with at least one stage that *closes* a cut (``Whitespace``, ``WhitespaceSplit``, DeepSeek-V3's
   main regex) and a ``ByteLevel`` (no regex, no prefix space: it only maps each piece's bytes to
   characters, one piece at a time) as the last stage if any. For each stage, with ``S`` the piece
   around ``p`` it is given:

   * ``\\p{N}{1,3}`` (digits, Isolated): at a newline cut ``text[p - 1]``, at a space cut
     ``text[p]``, is no digit, so no run of digits, hence no match, spans ``p``; the runs, cut in
     threes from their start, are the same on either side (a run that ends at ``p - 1`` is cut in
     threes from the same start in ``text[:p]``). Only a gap (the text between matches) may span
     ``p``: cut there, it is the same text.
   * ``[一-龥぀-ゟ゠-ヿ]+`` (CJK, Isolated): one side of ``p`` (``"\\n"`` or ``" "``) is not one
     of those, so likewise.
   * ``Whitespace`` (``\\w+|[^\\w\\s]+``) and ``WhitespaceSplit``: the pre-tokens hold no
     whitespace, and ``text[p - 1]`` (``"\\n"``) or ``text[p]`` (``" "``) is whitespace, so no
     pre-token spans ``p``; a greedy run before ``p`` stops at that whitespace either way.
   * DeepSeek-V3's main regex, ``R = [!"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+ |
     [^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+ | ?[\\p{P}\\p{S}]+[\\r\\n]* | \\s*[\\r\\n]+ |
     \\s+(?!\\S) | \\s+`` (Isolated; found left to right, the first alternative that matches wins,
     no look-behind, no empty match). *Newline cut:* a ``"\\n"`` is always in a match
     (``\\s*[\\r\\n]+`` matches from it), so the match ``m`` holding ``p - 1`` exists; the only
     atoms that take a ``"\\n"`` are ``\\s`` and ``[\\r\\n]``, after which ``R``'s alternatives
     hold only more ``\\s`` or ``[\\r\\n]`` (the letters of the second alternative may follow
     only a character that is not ``\\r\\n``). So ``m`` ends at ``p`` (``text[p]`` is not
     whitespace), and every atom of ``R`` that looks at ``text[p]`` after taking the ``"\\n"``
     fails there exactly as it fails at the end of ``text[:p]``, but for the look-ahead of
     ``\\s+(?!\\S)``; that alternative is never tried on a run of whitespace that holds a
     newline, since ``\\s*[\\r\\n]+`` before it matches it. *Space cut:* ``c = text[p - 1]``
     is not whitespace, so no atom ``\\s`` takes it (nor ``[\\r\\n]``, nor the space of
     `` ?``). An atom that takes ``c`` is one of ``R``'s character classes (the leading
     punctuation of the first alternative, ``[^\\r\\n\\p{L}\\p{P}\\p{S}]``, ``[A-Za-z]``,
     ``[\\p{L}\\p{M}]``, ``[\\p{P}\\p{S}]``); what its alternative may take after it is
     ``[A-Za-z]``, ``[\\p{L}\\p{M}]``, ``[\\p{P}\\p{S}]`` or ``[\\r\\n]``, and a space is none of
     them. So no match holds both ``c`` and ``text[p]``: a match holding ``c`` ends at ``p``; if
     none holds it (``c`` alone is matched by no alternative, e.g. a format character such as
     U+200D before a space), ``c`` lies in a gap, and a match starts at ``p`` (``\\s+`` at least
     takes the space), so the gap ends there. And the matches from before ``p`` are decided by
     ``text[:p]`` alone: none ends after ``p``; the only look-ahead, of ``\\s+(?!\\S)``, follows
     whitespace only, so a match of it ends before ``c`` and looks at ``c`` at most; and a regex
     without anchors, look-behind or look-ahead past its end finds in a prefix exactly the
     matches (and failures) it finds in the whole text that end within the prefix, tried in the
     same order. Either way ``p`` is a match boundary (or a gap's end) in ``S``, the matches
     before it are those of ``S[:p]``, and those after it, found from ``p`` with no look-behind,
     are those of ``S[p:]``: the cut is *closed*, no piece of this stage spans it, and later
     stages see each side alone.

   Whitespace in that proof is ``\\s`` of Oniguruma (Unicode ``White_Space``); ``str.isspace`` is
   true for every such character (and for a few more, which only means fewer cuts), which
   ``tests/unit/test_prompt_cuts.py`` checks; it also checks both cuts on DeepSeek-V3 beside every
   code point up to U+3100, every separator, control and format character and every 101st other
   (for the space cut, each of those before the space, in several contexts), and that the rules
   cut nowhere else it found unsafe (between a character and a newline, between two spaces).
4. *Model.* Each pre-token on its own (BPE without dropout, which would make ids random).
5. *Post-processor.* None or ``ByteLevel`` add no tokens. With another (a template adding BOS)
   the pieces are used only for a text encoded without special tokens (a rendered chat).

:class:`~balancer.tokenizer.tokenizer.HfTokenizer` also encodes a probe text both ways when it loads
and uses the pieces only if they agree, as it does for its segment cache; the property tests of
``tests/unit/test_prompt_cuts.py`` compare the verdict and the ids with a whole encode on many texts
near a small limit, for every tokenizer the tests have. A tokenizer this module does not accept
(SentencePiece-like ones whose pre-tokenizer leaves the text whole, a normaliser, another regex) is
encoded whole, as before. A text with no safe cut (no space after a character that is not
whitespace, no newline before one: all CJK, say) is encoded whole too: for those, BPE runs over
runs of text that no cut can split exactly.

**The pieces' memory.** A caller that held memory for pieces of at most ``max_chars`` characters
(the request path: ``balancer.api.openai.piece_hold_chars``) passes that bound to
:func:`encode_pieces`, which finds every piece's end first and raises :class:`LongPiece`, before
anything is encoded, when one would be longer (a stretch with no cut); the caller then holds the
whole encode's estimate and encodes without the bound. Cuts are looked for in windows of
:data:`SCAN_CHARS` characters, so that a text without one does not hold the GIL for a whole scan.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

PIECE_CHARS = 65_536
"""Least characters of a piece (it ends at the first safe cut after that many): a text at most this
long is encoded whole. What may be encoded past the limit before a text is refused: 22–24 ms of CPU
for ASCII words (10,740 tokens), 106–133 ms for random latin-1 bytes (71,566 tokens), on the
default tokenizer (2026-11-30 18:54 UTC, load 4.5)."""

CUT = re.compile(r"\n(?!\s)|\S(?= )")
"""A safe cut is the end of a match: a newline before a character that is not whitespace, or a
character that is not whitespace before a space (Python's ``\\s``, ``str.isspace``)."""

DEEPSEEK_DIGITS = r"\p{N}{1,3}"
DEEPSEEK_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
DEEPSEEK_MAIN = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)
"""DeepSeek-V3's pre-tokenizer regexes (its ``tokenizer.json``), as the proof above reads them."""

SAFE_SPLITS = {DEEPSEEK_DIGITS: False, DEEPSEEK_CJK: False, DEEPSEEK_MAIN: True}
"""``Split`` regexes (Isolated, not inverted) the proof covers, and whether each closes a cut."""
SAFE_STAGES = {"Whitespace": True, "WhitespaceSplit": True}
"""Pre-tokenizer stages without parameters the proof covers, and whether each closes a cut."""


def cuts_apply(
    pre_tokenizer: Mapping[str, Any] | None,
    *,
    identity_normalizer: bool,
    added: Iterable[tuple[str, bool]],
    dropout: float | None,
) -> bool:
    """Whether the proof of this module covers a tokenizer: its pre-tokenizer's state (the JSON of
    ``tokenizer.json``), whether its normaliser changes nothing, its added tokens as ``(text,
    verbatim)`` and its BPE dropout (``None`` for another model)."""
    if not identity_normalizer or dropout or pre_tokenizer is None:
        return False
    if any(not verbatim or "\n" in text or " " in text for text, verbatim in added):
        return False
    sequence = pre_tokenizer.get("type") == "Sequence"
    stages = pre_tokenizer.get("pretokenizers") if sequence else [pre_tokenizer]
    if not isinstance(stages, list) or not stages:
        return False
    closed = False
    for number, stage in enumerate(stages):
        closes = _stage_closes(stage, last=number == len(stages) - 1)
        if closes is None:
            return False
        closed = closed or closes
    return closed


def _stage_closes(stage: Any, *, last: bool) -> bool | None:
    """Whether ``stage`` closes a cut; ``None`` when the proof does not cover it."""
    if not isinstance(stage, Mapping):
        return None
    kind = stage.get("type")
    if kind in SAFE_STAGES and set(stage) <= {"type"}:
        return SAFE_STAGES[kind]
    if kind == "ByteLevel":
        if last and stage.get("use_regex") is False and stage.get("add_prefix_space") is False:
            return False
        return None
    if kind == "Split" and stage.get("behavior") == "Isolated" and stage.get("invert") is False:
        pattern = stage.get("pattern")
        regex = pattern.get("Regex") if isinstance(pattern, Mapping) else None
        if isinstance(regex, str) and regex in SAFE_SPLITS:
            return SAFE_SPLITS[regex]
    return None


class LongPiece(Exception):
    """A piece of ``text`` from ``start`` would be longer than ``max_chars`` (no safe cut for that
    long): raised by :func:`encode_pieces` with ``max_chars`` before any piece is encoded."""

    def __init__(self, start: int, max_chars: int) -> None:
        super().__init__(f"no safe cut within {max_chars} characters of character {start}")
        self.start = start
        self.max_chars = max_chars


SCAN_CHARS = 65_536
"""Characters of a text one search for a cut looks at, at most: a search holds the GIL (``re``
never releases it), so a text without cuts is scanned in windows of this many characters, about
3 ms each on this project's 2-core machine (a single search over 4 M characters without a cut took
53-190 ms, 2026-11-30 19:05 UTC, load 3.5), and the event loop gets the GIL between them."""


def next_cut(
    text: str, start: int, min_chars: int, max_chars: int | None = None, scan_chars: int = SCAN_CHARS
) -> int | None:
    """The first safe cut at least ``min_chars`` after ``start``; ``None`` when there is none
    before the end (the rest is one piece). A scan from there, in windows of ``scan_chars``
    characters: it stops at the first cut. With ``max_chars`` (at least ``min_chars``) the cut is
    at most that many after ``start``; when there is none and more than ``max_chars`` characters
    are left, :class:`LongPiece` (the scan looks no further)."""
    n = len(text)
    position = start + max(min_chars, 1) - 1
    # the last character a cut may follow (a match's start; its cut is the next position)
    last = n - 1 if max_chars is None else min(n, start + max_chars) - 1
    while position <= last:
        end = min(last, position + max(scan_chars, 1) - 1)
        # the window's matches start at most at ``end``; its look-ahead sees ``text[end + 1]``
        found = CUT.search(text, position, end + 2)
        if found is not None and found.start() <= end:
            cut = found.end()
            return cut if cut < n else None
        position = end + 1
    if max_chars is not None and n - start > max_chars:
        raise LongPiece(start, max_chars)
    return None


def piece_ends(text: str, min_chars: int, max_chars: int | None = None) -> Iterator[int]:
    """Where each piece of ``text`` ends (the last at ``len(text)``), found as they are needed
    (:func:`next_cut`; :class:`LongPiece` as it says)."""
    start = 0
    while start < len(text):
        cut = next_cut(text, start, min_chars, max_chars)
        start = len(text) if cut is None else cut
        yield start


def encode_pieces(
    text: str,
    encode: Callable[[str], list[int]],
    room: int,
    min_chars: int = PIECE_CHARS,
    max_chars: int | None = None,
) -> tuple[list[int], int] | tuple[None, int]:
    """``text``'s ids encoded piece by piece (pieces of at least ``min_chars``, cut at safe cuts),
    while they number at most ``room``: ``(ids, len(ids))``. As soon as more were encoded:
    ``(None, count)``, ``count > room`` being a lower bound of the whole text's ids (the rest
    is not encoded). With ``max_chars``, every piece's end is found first, and a piece that would
    be longer raises :class:`LongPiece` before anything is encoded (the caller held memory for
    pieces of at most that many characters)."""
    ids: list[int] = []
    start = 0
    ends = piece_ends(text, min_chars, max_chars)
    for end in ends if max_chars is None else list(ends):
        ids += encode(text[start:end] if start or end < len(text) else text)
        if len(ids) > room:
            return None, len(ids)
        start = end
    return ids, len(ids)
