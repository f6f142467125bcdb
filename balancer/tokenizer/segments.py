"""Token ids of repeated prompt segments, computed once (pure apart from a thread lock).

A fast tokenizer splits its input at added tokens before anything else and encodes the pieces in
between independently. Chat templates put special tokens around every message, so a long system
prompt or an earlier turn is such a piece, and its ids do not depend on what surrounds it. Caching
ids per piece is therefore exact, not an approximation: :func:`build_splitter` accepts only special
tokens that are matched verbatim (no stripping, no normalisation), and :class:`HfTokenizer` checks the
cached path against a plain encode at load time and turns the cache off if they ever differ.

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
    """Matched as is: no lstrip/rstrip, not single-word, not normalised."""


def build_splitter(tokens: Iterable[AddedToken]) -> tuple[re.Pattern[str], dict[str, int]] | None:
    """A regex splitting text at verbatim special tokens (captured), and their ids; ``None`` if none."""
    usable = {t.content: t.token_id for t in tokens if t.special and t.verbatim and t.content}
    if not usable:
        return None
    alternatives = "|".join(re.escape(t) for t in sorted(usable, key=len, reverse=True))
    return re.compile(f"({alternatives})"), usable


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
    splitter: re.Pattern[str],
    special_ids: dict[str, int],
    cache: SegmentCache,
    encode: Callable[[str], list[int]],
) -> list[int]:
    """Ids of ``text``: special tokens by lookup, the pieces between them via ``cache``."""
    ids: list[int] = []
    for position, piece in enumerate(splitter.split(text)):
        if not piece:
            continue
        if position % 2:  # odd positions are the captured special tokens
            ids.append(special_ids[piece])
        else:
            ids.extend(cache.ids(piece, encode))
    return ids
