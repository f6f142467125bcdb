"""Token ids of a short new text, word by word from a bounded memo (pure apart from a thread lock).

A chat whose system prompt the segment cache holds still has a new user message to encode on every
request: about 370 characters (64 tokens) in ``kvlb bench overhead``'s ``chat_shared``, and 0.81
million of the 3.9 million instructions of the whole request, most of them ``tokenizers``' fixed
cost per pre-token and per call (the regex split, the byte-level mapping, the offsets it keeps).
Words recur across messages far more than messages do, and :mod:`balancer.tokenizer.cuts` proves,
for the tokenizers it accepts (checked again against a whole encode when one loads), that a text's
ids are the ids of the pieces between its *safe cuts*, end to end: ``ids(text) == ids(text[:p]) +
ids(text[p:])`` at each cut ``p``. :func:`split_words` cuts a text at one kind of safe cut, a
character that is not whitespace before a space (``"Say hello, world"`` → ``"Say"``, ``" hello,"``,
``" world"``; until 2026-12-01, h-perf19, only an ASCII letter before a space, which left ``" 199:
result"`` one piece; fewer cuts than the proof allows only make longer pieces), and
:class:`WordMemo` answers it from the memo when it holds every piece: the same ids as the whole
encode, for a split and a dict lookup per piece.

When pieces are missing, they are joined in their order and encoded once, with character offsets
(``Tokenizer.encode``): each junction is again a character that is not whitespace before a space
(a missing piece that is not the text's last ends with the character of the cut after it, one that
is not its first starts with the space), so that text's ids are the missing pieces' ids end to
end, and each piece gets the ids whose first character lies in it (no token spans a cut, since each
cut is a pre-token boundary). The memo keeps them. One call for all of them: ``tokenizers`` has a
fixed cost per call, and encoding 55 words one call each cost about 3.5 times one encode of their
text (393 µs against 114 µs of CPU, 2026-12-01 16:00 UTC). If the offsets do not split as
expected (no ids for a piece), the caller encodes the text whole (:meth:`WordMemo.ids` answers
``None``).

Bounds: at most ``max_words`` pieces and ``max_bytes`` bytes (:func:`word_bytes` of each: its text,
its ids with their int objects, the entry), each piece at most ``max_word_chars`` characters (a
longer piece is never kept, and is encoded with every text that holds it); past either bound the
oldest entries go first (counted in :attr:`WordMemo.evictions`, exported as
``kvlb_tokenizer_word_memo_evictions_total``). Texts over ``max_text_chars`` are not looked at (the
caller encodes them whole). Reads take no lock (a dict read is atomic under the GIL); stores do.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from itertools import chain, islice
from typing import Final


def split_words(text: str) -> list[str]:
    """``text`` cut before every space that follows a character that is not whitespace
    (``str.isspace``; a safe cut of :mod:`balancer.tokenizer.cuts`): the pieces, end to end, are
    ``text``; none is empty unless ``text`` is (an empty piece gets no ids: :meth:`WordMemo.ids`
    then answers ``None``). A part of ``text.split(" ")`` that is empty (two spaces in a row) or
    ends with whitespace joins the next one."""
    parts = text.split(" ")
    words: list[str] = []
    current = parts[0]
    for part in islice(parts, 1, None):
        if current and not current[-1].isspace():
            words.append(current)
            current = " " + part
        else:
            current = current + " " + part
    words.append(current)
    return words


MAX_WORDS: Final = 16_384
"""Default bound on the memo's entries (about 230 bytes each for an English word)."""
MAX_BYTES: Final = 4 * 1024 * 1024
"""Default bound on the bytes the memo counts (:func:`word_bytes`)."""
MAX_WORD_CHARS: Final = 48
"""Default bound on a kept piece's characters (a piece runs from one safe cut to the next: a word
with the punctuation after it, or a line's words up to the first letter before a space)."""
ENTRY_BYTES: Final = 120
"""What an entry costs besides its text and its ids: the dict's slot and the ids' tuple header."""


def word_bytes(word: str, ids: int) -> int:
    """What :class:`WordMemo` counts for ``word`` kept with ``ids`` ids: ``sys.getsizeof`` of the
    text, 8 bytes a pointer and 32 an int object per id, and :data:`ENTRY_BYTES`."""
    return sys.getsizeof(word) + 40 * ids + ENTRY_BYTES


MAX_TEXT_CHARS: Final = 8_192
"""Default bound on a text looked up word by word (the request path encodes at most
``INLINE_TOKENIZE_CHARS`` new characters inline)."""


class WordMemo:
    """Ids of short texts from a memo of their safe-cut pieces (see the module docstring)."""

    __slots__ = (
        "_bytes",
        "_encode_offsets",
        "_lock",
        "_memo",
        "evictions",
        "hits",
        "max_bytes",
        "max_text_chars",
        "max_word_chars",
        "max_words",
        "misses",
    )

    def __init__(
        self,
        encode_offsets: Callable[[str], tuple[list[int], list[tuple[int, int]]]],
        max_words: int = MAX_WORDS,
        max_bytes: int = MAX_BYTES,
        max_word_chars: int = MAX_WORD_CHARS,
        max_text_chars: int = MAX_TEXT_CHARS,
    ) -> None:
        self._encode_offsets = encode_offsets
        """An encode without special tokens: the ids and each id's ``(start, end)`` characters."""
        self._memo: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        self.max_words = max_words
        self.max_bytes = max_bytes
        self._bytes = 0
        self.max_word_chars = max_word_chars
        self.max_text_chars = max_text_chars
        self.hits = 0
        """Texts answered from the memo."""
        self.misses = 0
        """Texts with a piece missing (those pieces encoded)."""
        self.evictions = 0
        """Entries dropped for :attr:`max_words` or :attr:`max_bytes` (oldest first)."""

    def __len__(self) -> int:
        return len(self._memo)

    @property
    def held_bytes(self) -> int:
        """The bytes counted against :attr:`max_bytes`."""
        return self._bytes

    def clear(self) -> None:
        """Forget every entry and zero the counters."""
        with self._lock:
            self._memo.clear()
            self._bytes = 0
        self.hits = self.misses = self.evictions = 0

    def ids(self, text: str) -> list[int] | None:
        """The ids of ``text`` (without special tokens); ``None`` when it is over
        :attr:`max_text_chars` or the memo is off (``max_words`` or ``max_bytes`` 0): encode it whole then."""
        if len(text) > self.max_text_chars or self.max_words <= 0 or self.max_bytes <= 0:
            return None
        words = split_words(text)
        found = list(map(self._memo.get, words))
        if None not in found:
            self.hits += 1
            return list(chain.from_iterable(found))  # type: ignore[arg-type]
        self.misses += 1
        missing = [word for word, word_ids in zip(words, found, strict=True) if word_ids is None]
        ids, offsets = self._encode_offsets(missing[0] if len(missing) == 1 else "".join(missing))
        split = _split_ids(missing, ids, offsets)
        if split is None:
            return None
        new = iter(split)
        whole = [next(new) if word_ids is None else word_ids for word_ids in found]
        limit = self.max_word_chars
        self._keep(
            [(word, word_ids) for word, word_ids in zip(missing, split, strict=True) if len(word) <= limit]
        )
        return list(chain.from_iterable(whole))

    def _keep(self, kept: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        """Store ``kept`` (new entries only), then drop the oldest past the bounds."""
        if not kept:
            return
        memo = self._memo
        with self._lock:
            for word, word_ids in kept:
                if word not in memo:
                    memo[word] = word_ids
                    self._bytes += word_bytes(word, len(word_ids))
            while memo and (len(memo) > self.max_words or self._bytes > self.max_bytes):
                oldest = next(iter(memo))
                self._bytes -= word_bytes(oldest, len(memo.pop(oldest)))
                self.evictions += 1


WORDS_PROBE: Final = "Say hello to the world.\nThen say it again, twice: hello, world! 42 times\n  and done"
"""A text :func:`checked_words` encodes through a new memo twice (learnt, then found), then with
three more words (those learnt, the rest found)."""


def checked_words(memo: WordMemo, raw: Callable[[str], list[int]]) -> WordMemo | None:
    """``memo`` (emptied) if it gives ``raw``'s ids for :data:`WORDS_PROBE` and a longer text
    each time it learns and finds them, else ``None``: a load-time check beside :mod:`.self_checks`'."""
    want, longer = raw(WORDS_PROBE), WORDS_PROBE + " and then some"
    if memo.ids(WORDS_PROBE) != want or memo.ids(WORDS_PROBE) != want or memo.hits != 1:
        return None
    if memo.ids(longer) != raw(longer) or memo.ids(longer) != raw(longer) or memo.hits != 2:
        return None
    memo.clear()
    return memo


def _split_ids(
    words: Sequence[str], ids: Sequence[int], offsets: Sequence[tuple[int, int]]
) -> list[tuple[int, ...]] | None:
    """``ids`` of ``"".join(words)`` split among ``words`` by each id's first character
    (``offsets``); ``None`` when a word gets none or ids are left over."""
    split: list[tuple[int, ...]] = []
    token, count, end = 0, len(ids), 0
    for word in words:
        end += len(word)
        first = token
        while token < count and offsets[token][0] < end:
            token += 1
        if first == token:
            return None
        split.append(tuple(ids[first:token]))
    return split if token == count else None
