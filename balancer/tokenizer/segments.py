"""Token ids of repeated prompt segments, computed once (pure apart from a thread lock).

A fast tokenizer splits its input at added tokens before anything else and encodes the pieces in
between independently. Chat templates put added tokens around every message, so a long system
prompt or an earlier turn is such a piece, and its ids do not depend on what surrounds it. Caching
ids per piece is therefore exact, not an approximation.

Which added tokens split, special or not: those matched verbatim (no ``lstrip``/``rstrip``, not
``single_word``). ``tokenizers`` matches the ones marked ``normalized: false`` on the raw text first,
then the ``normalized: true`` ones inside the remaining pieces after normalisation; the latter are
split points only when the normaliser changes nothing (none, or an empty ``Sequence``, as
DeepSeek-V3's, whose ``<｜User｜>`` and ``<｜Assistant｜>`` are such non-special, normalized tokens).
:class:`Splitter` reproduces the two passes, each leftmost-longest as ``tokenizers``' matcher is.
:class:`~balancer.tokenizer.tokenizer.HfTokenizer` checks the cached path against a plain encode at
load time, on probe texts holding tokens of every pass, and turns the cache off if they ever differ.

The cache is an LRU bounded by the total number of cached token ids (``max_tokens``); segments shorter
than ``min_chars`` are not cached (encoding them is cheap). Tokenising runs in worker threads
(``asyncio.to_thread``), hence the lock.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class AddedToken:
    """What the splitter needs to know about one added token of a tokenizer."""

    content: str
    token_id: int
    special: bool
    verbatim: bool
    """Matched as is: no lstrip/rstrip, not single-word (whether normalised is :attr:`normalized`)."""
    normalized: bool = False
    """Matched on the normalised text, in ``tokenizers``' second pass."""


@dataclass(frozen=True, slots=True)
class Splitter:
    """Where a fast tokenizer splits text at added tokens: one regex per matching pass, and the ids."""

    passes: tuple[re.Pattern[str], ...]
    """Raw-text tokens first, then normalised ones (when the normaliser is the identity)."""
    ids: dict[str, int]
    """Every split token's id."""

    def split(self, text: str) -> list[str]:
        """``text`` as pieces; the pieces that are split tokens are keys of :attr:`ids`.

        A piece equal to a token's text but left between split points (not matched) cannot occur:
        every occurrence of a token's text is matched by its pass.
        """
        pieces = [text]
        for pattern in self.passes:
            out: list[str] = []
            for piece in pieces:
                if piece in self.ids:
                    out.append(piece)
                    continue
                out.extend(part for part in pattern.split(piece) if part)
            pieces = out
        return pieces


def build_splitter(tokens: Iterable[AddedToken], *, identity_normalizer: bool = False) -> Splitter | None:
    """The :class:`Splitter` of the verbatim added tokens, special or not; ``None`` if none.

    ``normalized`` tokens are used only with ``identity_normalizer`` (the normaliser changes nothing).
    """
    raw: dict[str, int] = {}
    normalized: dict[str, int] = {}
    for token in tokens:
        if not token.verbatim or not token.content:
            continue
        if not token.normalized:
            raw[token.content] = token.token_id
        elif identity_normalizer:
            normalized[token.content] = token.token_id
    groups = [group for group in (raw, normalized) if group]
    if not groups:
        return None
    passes = tuple(_alternation(group) for group in groups)
    ids = {**normalized, **raw}
    return Splitter(passes, ids)


def _alternation(tokens: Iterable[str]) -> re.Pattern[str]:
    """Longest first: at each position the longest token wins (leftmost-longest)."""
    alternatives = "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True))
    return re.compile(f"({alternatives})")


@dataclass(slots=True)
class SegmentCache:
    """Bounded LRU of text segment → token ids (stored compactly as u32 arrays)."""

    max_tokens: int = 2_000_000
    """Cap on cached ids, all segments together (4 bytes each); 0 disables the cache."""
    min_chars: int = 256
    """Segments shorter than this are encoded every time."""
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    _entries: OrderedDict[str, array[int]] = field(default_factory=OrderedDict)
    _tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def ids(self, segment: str, encode: Callable[[str], list[int]]) -> array[int] | list[int]:
        """Ids of ``segment``, from the cache or from ``encode`` (whose result is then cached)."""
        if self.max_tokens <= 0 or len(segment) < self.min_chars:
            return encode(segment)
        with self._lock:
            found = self._entries.get(segment)
            if found is not None:
                self._entries.move_to_end(segment)
                self.hits += 1
                return found
            self.misses += 1
        encoded = array("I", encode(segment))
        if len(encoded) > self.max_tokens // 4:  # one huge segment would flush everything else
            return encoded
        with self._lock:
            if segment not in self._entries:
                self._entries[segment] = encoded
                self._tokens += len(encoded)
                while self._tokens > self.max_tokens:
                    _, old = self._entries.popitem(last=False)
                    self._tokens -= len(old)
                    self.evictions += 1
        return encoded


def encode_segmented(
    text: str,
    splitter: Splitter,
    cache: SegmentCache,
    encode: Callable[[str], list[int]],
) -> list[int]:
    """Ids of ``text``: split tokens by lookup, the pieces between them via ``cache``."""
    ids: list[int] = []
    lookup = splitter.ids
    for piece in splitter.split(text):
        token_id = lookup.get(piece)
        if token_id is not None:
            ids.append(token_id)
        else:
            ids.extend(cache.ids(piece, encode))
    return ids
