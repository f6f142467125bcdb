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

The request path does not join a rendered chat to split it: :meth:`Splitter.split_chunks` splits the
template's output chunks (literals, message contents) one by one, exactly as the joined text would be
split when no token can straddle two chunks (it answers ``None`` otherwise).

The cache is an LRU bounded by the total number of cached token ids (``max_tokens``) and by the bytes
it holds (``max_bytes``: each segment's text, ids and entry, :func:`segment_bytes`, and its ``u32``
copy); segments shorter than ``min_chars`` are not cached (encoding them is cheap). Tokenising runs in
worker threads (``asyncio.to_thread``), hence the lock.

A segment's ids are kept as a tuple of shared int objects (one per vocabulary id, ``SegmentCache.ints``):
8 bytes per cached id, and a hit extends the prompt's list by copying pointers. Kept as a ``u32`` array
(4 bytes) every hit made a new int per id: about 0.1 ms per 8k-token prompt, half of a cached chat's
tokenizing. The request path wants the prompt as a ``u32`` array, though (``compact_ids``), and
converting a list of 8k ints costs about as much again, so :func:`encode_segmented_packed` builds the
array directly: a segment it hits also gets a ``u32`` copy, made at that first hit and kept beside its
tuple (4 bytes more per id of such segments), which later hits copy as bytes.

A request's segments are new string objects (decoded from its body), so finding one in a dict hashes
all of it (about 10 µs for a 46,000-character system prompt) and compares it with the stored key
once per dict operation. The cache therefore also keeps one stored key per *shape* (length, first
and last :data:`SHAPE_CHARS` characters): a segment whose shape names a stored key equal to it (one
compare) is looked up by that key object, whose hash is cached and which every dict finds by
identity. Any other segment is looked up by its own hash, as before; the answers are the same.
"""

from __future__ import annotations

import operator
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any


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
    initials: tuple[tuple[str, ...], ...]
    """Per pass, the first characters of its tokens. Matches are looked for only where one occurs
    (``str.find``): the regex alone scans every character when a pass's tokens start with different
    characters (DeepSeek-V3's second pass: about 0.2 ms on an 8k-token chat)."""
    longest: int
    """Characters of the longest split token: a longer piece is not looked up in :attr:`ids`, which
    would hash all of it (the whole rendered chat, in the first pass: tens of microseconds at 8k tokens)."""
    prefixes: frozenset[str] = frozenset()
    """Every proper prefix of every split token: text ending in one of them may end in the middle of
    a token that the text after it completes (see :meth:`split_chunks`)."""
    starts: str = ""
    """The first characters of the split tokens of every pass, each once."""
    solid: frozenset[str] = frozenset()
    """The split tokens that hold no other split token: such a text is that one token."""

    def split(self, text: str) -> list[str]:
        """``text`` as pieces; the pieces that are split tokens are keys of :attr:`ids`.

        A piece equal to a token's text but left between split points (not matched) cannot occur:
        every occurrence of a token's text is matched by its pass.
        """
        pieces = [text]
        ids, longest = self.ids, self.longest
        for number, (pattern, initials) in enumerate(zip(self.passes, self.initials, strict=True)):
            out: list[str] = []
            for piece in pieces:
                if number and len(piece) <= longest and piece in ids:  # matched by an earlier pass
                    out.append(piece)
                else:
                    _split_pass(pattern, initials, piece, out)
            pieces = out
        return pieces

    def split_chunks(self, chunks: Iterable[str]) -> list[str] | None:
        """:meth:`split` of ``"".join(chunks)``, without joining them; ``None`` when a split token
        could straddle two chunks (then split the joined text). :meth:`split_chunk_parts` with each
        piece made of several chunks' text joined."""
        pieces = self.split_chunk_parts(chunks)
        if pieces is None:
            return None
        return [piece if type(piece) is str else "".join(piece) for piece in pieces]

    def split_chunk_parts(self, chunks: Iterable[str]) -> list[str | tuple[str, ...]] | None:
        """:meth:`split_chunks`, but a piece between tokens that several chunks make (a system
        prompt and the template's ``"\\n\\n"`` after it) comes as the tuple of its parts, not
        joined: :meth:`SegmentCache.peek_packed_parts` finds a cached one without the join's copy
        (46,603 characters a request for a shared 8k-token system prompt).

        A chat template's output comes as such chunks (its literals, each message's content): the
        long ones are the message texts themselves, whose split finds nothing to cut (often without
        looking at a character: ``str.find`` of a character wider than the text's), while the joined
        text is a new, wider string (two bytes a character once it holds ``<\uff5cUser\uff5c>``)
        that every pass scans, slices and copies again. Splitting chunk by chunk is exact when no
        token can start in one chunk and end in a later one: no end of the text before a boundary
        (its last ``longest - 1`` characters) is a proper prefix of a token (:attr:`prefixes`).
        Then every token match lies inside one chunk and the passes decide alike; the pieces between
        tokens that meet at a boundary are joined into one piece, as the joined text has them.
        """
        ids, longest, keep = self.ids, self.longest, self.longest - 1
        pieces: list[str | tuple[str, ...]] = []
        text: list[str] = []  # the parts of the piece between tokens under way
        tail = ""  # the last ``keep`` characters of the chunks so far
        for chunk in chunks:
            if not chunk:
                continue
            if keep and tail and self._may_straddle(tail):
                return None
            if len(chunk) <= longest and chunk in self.solid:
                found = [chunk]  # a template literal that is one token
            elif any(start in chunk for start in self.starts):
                found = self.split(chunk)
            else:
                found = [chunk]  # no token starts in it (the usual message content)
            for piece in found:
                if len(piece) <= longest and piece in ids:
                    if text:
                        pieces.append(text[0] if len(text) == 1 else tuple(text))
                        text = []
                    pieces.append(piece)
                else:
                    text.append(piece)
            if keep:
                tail = chunk[-keep:] if len(chunk) >= keep else (tail + chunk)[-keep:]
        if text:
            pieces.append(text[0] if len(text) == 1 else tuple(text))
        return pieces

    def _may_straddle(self, tail: str) -> bool:
        """Whether some end of ``tail`` is the start of a longer split token."""
        prefixes = self.prefixes
        for start in self.starts:
            at = tail.find(start)
            while at >= 0:
                if tail[at:] in prefixes:
                    return True
                at = tail.find(start, at + 1)
        return False


MAX_PROBES = 32
"""Places a token may start at that :func:`_split_pass` tries one by one before the regex scans the
rest of the piece in one call (text full of ``<``, such as HTML, would otherwise cost a Python loop
turn per ``<``)."""


def _split_pass(pattern: re.Pattern[str], initials: tuple[str, ...], piece: str, out: list[str]) -> None:
    """Append ``piece`` split at the leftmost-longest matches of ``pattern`` (tokens included) to
    ``out``; the same pieces as ``pattern.split``, found by trying only where an initial occurs."""
    start = position = 0
    upcoming = {initial: piece.find(initial) for initial in initials}  # next place of each, or -1
    for _ in range(MAX_PROBES):
        for initial, at in upcoming.items():
            if 0 <= at < position:
                upcoming[initial] = piece.find(initial, position)
        found = [at for at in upcoming.values() if at >= 0]
        if not found:
            break
        at = min(found)
        match = pattern.match(piece, at)  # the longest token starting here (see _alternation)
        if match is None:
            position = at + 1
            continue
        if at > start:
            out.append(piece[start:at])
        out.append(match.group())
        start = position = match.end()
    else:  # many candidates: the regex scans the rest (no token starts in piece[start:position])
        out.extend(part for part in pattern.split(piece[start:]) if part)
        return
    if start < len(piece):
        out.append(piece[start:])


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
    initials = tuple(tuple(sorted({token[0] for token in group})) for group in groups)
    ids = {**normalized, **raw}
    prefixes = frozenset(token[:end] for token in ids for end in range(1, len(token)))
    starts = "".join(sorted({token[0] for token in ids}))
    solid = frozenset(token for token in ids if not _holds_another(token, ids, passes))
    return Splitter(passes, ids, initials, max(map(len, ids)), prefixes, starts, solid)


def _holds_another(token: str, ids: dict[str, int], passes: Iterable[re.Pattern[str]]) -> bool:
    """Whether another split token occurs in ``token``: one of its prefixes, or one starting later."""
    if any(token[:end] in ids for end in range(1, len(token))):
        return True
    return any(pattern.match(token, start) for pattern in passes for start in range(1, len(token)))


def _alternation(tokens: Iterable[str]) -> re.Pattern[str]:
    """One capturing group matching the longest of ``tokens`` that starts at a position.

    The tokens are laid out as a trie (``<(?:\uff5c(?:User\uff5c>|Assistant\uff5c>)|think>)``), so a
    place that starts no token fails after a character or two instead of trying each token in turn
    (DeepSeek-V3 has 1,237 that start with ``<``). At each node the longer continuations are tried
    before ending there, so the match is the longest, as ``tokenizers``' leftmost-longest matcher's.
    """
    trie: dict[str, Any] = {}
    for token in tokens:
        node = trie
        for char in token:
            node = node.setdefault(char, {})
        node[_END] = {}
    return re.compile(f"({_trie_pattern(trie)})")


_END = ""
"""The trie key marking that a token ends at a node (no character is the empty string)."""


def _trie_pattern(node: dict[str, Any]) -> str:
    branches = [re.escape(char) + _trie_pattern(child) for char, child in sorted(node.items()) if char]
    if not branches:
        return ""
    if len(branches) == 1 and _END not in node:
        return branches[0]
    group = "(?:" + "|".join(branches) + ")"
    return group + "?" if _END in node else group


SHAPE_CHARS = 32
"""Characters at each end of a segment that, with its length, make its shape (:class:`SegmentCache`)."""


def _shape(segment: str) -> tuple[int, str, str]:
    return len(segment), segment[:SHAPE_CHARS], segment[-SHAPE_CHARS:]


def _parts_shape(parts: tuple[str, ...]) -> tuple[int, str, str]:
    """:func:`_shape` of ``"".join(parts)``, without joining them."""
    head = tail = ""
    for part in parts:
        head += part[: SHAPE_CHARS - len(head)]
        if len(head) >= SHAPE_CHARS:
            break
    for part in reversed(parts):
        tail = part[len(tail) - SHAPE_CHARS :] + tail
        if len(tail) >= SHAPE_CHARS:
            break
    return sum(map(len, parts)), head, tail


def _spells(key: str, parts: tuple[str, ...]) -> bool:
    """Whether ``key == "".join(parts)``, compared in place (``str.startswith`` at each part's offset)."""
    at = 0
    for part in parts:
        if not key.startswith(part, at):
            return False
        at += len(part)
    return at == len(key)


SEGMENT_ENTRY_BYTES = 700
"""What a cached segment costs besides its text (``sys.getsizeof``), its ids' pointers (8 bytes each)
and its ``u32`` copy (``sys.getsizeof`` of the array, once made): the ids' tuple header, the dict
slots and the shape entry with its two strings of :data:`SHAPE_CHARS` characters (``tracemalloc``:
405–453 bytes for ASCII and latin-1 segments, 519 for CJK, 651 for emoji, with about 115 bytes more
for a ``u32`` copy than the 64 of its ``sys.getsizeof``; ``python -m loadtests.container_figures
segments``)."""


def segment_bytes(segment: str, ids: int) -> int:
    """What :class:`SegmentCache` counts for ``segment`` cached with ``ids`` ids, before any ``u32``
    copy: ``sys.getsizeof`` of the text (1, 2 or 4 bytes a character, by its widest), 8 bytes an id
    and :data:`SEGMENT_ENTRY_BYTES` (pure, O(1))."""
    return sys.getsizeof(segment) + 8 * ids + SEGMENT_ENTRY_BYTES


@dataclass(slots=True)
class SegmentCache:
    """Bounded LRU of text segment → token ids (tuples of shared ints), in ids and in bytes."""

    max_tokens: int = 2_000_000
    """Cap on cached ids, all segments together (8 bytes each, 12 for a segment with a ``u32`` copy,
    plus about 230 bytes per segment for its shape entry); 0 disables the cache."""
    max_bytes: int = 128 * 1024 * 1024
    """Cap on the bytes the cache holds (:func:`segment_bytes` of each segment plus its ``u32`` copy):
    the segments' text is not bounded by their ids (a run of spaces is 128 characters a token with
    DeepSeek-V3, 512 bytes a token in a string with one emoji), so :attr:`max_tokens` alone let the
    cache hold about 1 GiB. Past it the least recently used segments go (:attr:`byte_evictions`); a
    segment over a quarter of it is not cached (:attr:`refused`). 0 disables the cache."""
    min_chars: int = 256
    """Segments shorter than this are encoded every time."""
    ints: Sequence[int] = ()
    """Shared int objects, ``ints[i] == i``, for the ids below its length (the vocabulary): cached
    ids point at these instead of holding an int object each (28 bytes)."""
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    """Segments dropped for :attr:`max_tokens`."""
    byte_evictions: int = 0
    """Segments dropped for :attr:`max_bytes`."""
    refused: int = 0
    """Segments encoded but not cached: over a quarter of :attr:`max_tokens` or of :attr:`max_bytes`."""
    _entries: OrderedDict[str, tuple[int, ...]] = field(default_factory=OrderedDict)
    _arrays: dict[str, array[int]] = field(default_factory=dict)
    """The ``u32`` copies of the entries :meth:`packed_ids` hit (a subset of ``_entries``' keys)."""
    _shapes: dict[tuple[int, str, str], str] = field(default_factory=dict)
    """Shape → the key of ``_entries`` (that very object) first stored with it while none was: at
    most one per entry, dropped with it."""
    _tokens: int = 0
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    @property
    def cached_bytes(self) -> int:
        """The bytes counted against :attr:`max_bytes` (:func:`segment_bytes` and the ``u32`` copies)."""
        return self._bytes

    def cached(self, segment: str) -> bool:
        """Whether :meth:`ids` would answer ``segment`` without encoding it (now)."""
        if self.max_tokens <= 0 or self.max_bytes <= 0 or len(segment) < self.min_chars:
            return False
        with self._lock:
            return self._stored(segment) in self._entries

    def _stored(self, segment: str) -> str:
        """The stored key equal to ``segment`` that its shape names (found by identity in the
        dicts, its hash cached), else ``segment`` itself. Call with the lock held."""
        key = self._shapes.get(_shape(segment))
        return key if key is not None and key == segment else segment

    def ids(self, segment: str, encode: Callable[[str], list[int]]) -> Sequence[int]:
        """Ids of ``segment``, from the cache or from ``encode`` (whose result is then cached)."""
        return self._ids(segment, encode, packed=False)

    def packed_ids(self, segment: str, encode: Callable[[str], list[int]]) -> Sequence[int]:
        """:meth:`ids`, a hit as a ``u32`` array (made at the segment's first such hit, then kept)."""
        return self._ids(segment, encode, packed=True)

    def peek_packed(self, segment: str) -> array[int] | None:
        """A hit's ids as a ``u32`` array (made at its first such hit, then kept), ``None`` on a miss;
        counts nothing (:meth:`count_hits`), but a hit becomes the most recently used."""
        if self.max_tokens <= 0 or self.max_bytes <= 0 or len(segment) < self.min_chars:
            return None
        with self._lock:
            key = self._stored(segment)
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            made = self._arrays.get(key)
        return made if made is not None else self._first_array(key, found)

    def peek_packed_parts(self, parts: tuple[str, ...]) -> array[int] | None:
        """:meth:`peek_packed` of ``"".join(parts)`` when their shape names the stored key equal to
        them (compared in place): found without the join's copy and the joined text's hash. ``None``
        otherwise (a miss, or a hit stored without its shape): then join them and call
        :meth:`peek_packed`, which finds those too."""
        if self.max_tokens <= 0 or self.max_bytes <= 0:
            return None
        shape = _parts_shape(parts)
        if shape[0] < self.min_chars:
            return None
        with self._lock:
            key = self._shapes.get(shape)
            if key is None or not _spells(key, parts):
                return None
            found = self._entries[key]  # a shape's key is an entry's (dropped with it)
            self._entries.move_to_end(key)
            made = self._arrays.get(key)
        return made if made is not None else self._first_array(key, found)

    def _first_array(self, key: str, found: tuple[int, ...]) -> array[int]:
        """The ``u32`` copy of the entry ``key`` (``found``) at its first packed hit, kept unless the
        entry was evicted meanwhile."""
        made = array("I", found)
        with self._lock:
            if self._entries.get(key) is found and key not in self._arrays:  # not evicted meanwhile
                self._keep_array(key, made)
        return made

    def count_hits(self, count: int) -> None:
        """Count ``count`` hits found by :meth:`peek_packed` and used."""
        with self._lock:
            self.hits += count

    def _ids(self, segment: str, encode: Callable[[str], list[int]], packed: bool) -> Sequence[int]:
        if self.max_tokens <= 0 or self.max_bytes <= 0 or len(segment) < self.min_chars:
            return encode(segment)
        with self._lock:
            key = self._stored(segment)
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                if not packed:
                    return found
                made = self._arrays.get(key)
                if made is not None:
                    return made
            else:
                self.misses += 1
        if found is not None:  # the first packed hit of this segment
            made = array("I", found)
            with self._lock:
                if self._entries.get(key) is found and key not in self._arrays:  # not evicted meanwhile
                    self._keep_array(key, made)
            return made
        encoded = self._shared(encode(segment))
        size = segment_bytes(segment, len(encoded))
        # One huge segment would flush everything else.
        if len(encoded) > self.max_tokens // 4 or size > self.max_bytes // 4:
            with self._lock:
                self.refused += 1
            return encoded
        with self._lock:
            if self._stored(segment) not in self._entries:
                self._entries[segment] = encoded
                self._shapes.setdefault(_shape(segment), segment)
                self._tokens += len(encoded)
                self._bytes += size
                self._evict()
        return encoded

    def _keep_array(self, key: str, made: array[int]) -> None:
        """Keep ``made``, the ``u32`` copy of the entry ``key``, and evict past the bytes it adds
        (call with the lock held; ``key`` was just used, so the least recently used go first)."""
        self._arrays[key] = made
        self._bytes += sys.getsizeof(made)
        self._evict()

    def _evict(self) -> None:
        """Drop the least recently used entries until both bounds hold (call with the lock held)."""
        while self._tokens > self.max_tokens or self._bytes > self.max_bytes:
            by_tokens = self._tokens > self.max_tokens
            gone, old = self._entries.popitem(last=False)
            made = self._arrays.pop(gone, None)
            shape = _shape(gone)
            if self._shapes.get(shape) is gone:
                del self._shapes[shape]
            self._tokens -= len(old)
            self._bytes -= segment_bytes(gone, len(old)) + (0 if made is None else sys.getsizeof(made))
            if by_tokens:
                self.evictions += 1
            else:
                self.byte_evictions += 1

    def _shared(self, ids: list[int]) -> tuple[int, ...]:
        """``ids`` (a tokenizer's, so never negative) as a tuple of the :attr:`ints` objects; a plain
        tuple of ``ids`` when one is past :attr:`ints`. One ``itemgetter`` call: for 8k ids about a
        fifth of the CPU of the ``min``/``max`` bounds check and per-id ``map`` it replaces (about
        0.6 ms of a new 8k-token chat's tokenizing, docs/benchmark-history.md)."""
        if len(ids) < 2:  # ``itemgetter`` of one index answers the item, not a tuple
            return tuple(self.ints[i] if 0 <= i < len(self.ints) else i for i in ids)
        try:
            shared: tuple[int, ...] = operator.itemgetter(*ids)(self.ints)
        except IndexError:
            return tuple(ids)
        return shared


def encode_segmented(
    text: str,
    splitter: Splitter,
    cache: SegmentCache,
    encode: Callable[[str], list[int]],
    max_new_chars: int | None = None,
) -> list[int] | None:
    """Ids of ``text``: split tokens by lookup, the pieces between them via ``cache``.

    With ``max_new_chars``: ``None`` (nothing encoded) when the pieces the cache does not hold have
    more characters than that (the caller then encodes elsewhere, e.g. in a thread)."""
    ids: list[int] = []
    return ids if _encode_pieces(ids, text, splitter, cache, encode, max_new_chars) else None


def encode_segmented_packed(
    text: str,
    splitter: Splitter,
    cache: SegmentCache,
    encode: Callable[[str], list[int]],
    max_new_chars: int | None = None,
) -> array[int] | None:
    """:func:`encode_segmented` as one ``u32`` array (``array('I')``), cached segments copied as bytes."""
    return encode_pieces_packed(splitter.split(text), splitter, cache, encode, max_new_chars)


def encode_pieces_packed(
    pieces: Sequence[str | tuple[str, ...]],
    splitter: Splitter,
    cache: SegmentCache,
    encode: Callable[[str], list[int]],
    max_new_chars: int | None = None,
) -> array[int] | None:
    """:func:`encode_segmented_packed` of the text ``pieces`` (from :meth:`Splitter.split` or
    :meth:`Splitter.split_chunk_parts`) make: each cached piece is looked up once (hashing and
    comparing a long system prompt is most of a hit's cost), then copied as bytes; a piece given as
    its parts is joined only when :meth:`SegmentCache.peek_packed_parts` does not find it."""
    lookup, longest = splitter.ids, splitter.longest
    parts: list[int | array[int] | str] = []
    new_chars = hits = 0
    for piece in pieces:
        if not isinstance(piece, str):
            found = cache.peek_packed_parts(piece)
            if found is not None:
                hits += 1
                parts.append(found)
                continue
            piece = "".join(piece)
        token_id = lookup.get(piece) if len(piece) <= longest else None
        if token_id is not None:
            parts.append(token_id)
            continue
        found = cache.peek_packed(piece)
        if found is None:
            new_chars += len(piece)
            parts.append(piece)
        else:
            hits += 1
            parts.append(found)
    if max_new_chars is not None and new_chars > max_new_chars:
        return None
    if hits:
        cache.count_hits(hits)
    ids: array[int] = array("I")
    for part in parts:
        if isinstance(part, int):
            ids.append(part)
        elif isinstance(part, str):
            ids.extend(cache.packed_ids(part, encode))
        else:
            ids.extend(part)
    return ids


def _encode_pieces(
    ids: MutableSequence[int],
    text: str,
    splitter: Splitter,
    cache: SegmentCache,
    encode: Callable[[str], list[int]],
    max_new_chars: int | None,
) -> bool:
    """Append the ids of ``text`` to ``ids``; ``False`` (nothing appended) when more than
    ``max_new_chars`` characters miss the cache."""
    lookup = splitter.ids
    pieces = splitter.split(text)
    if max_new_chars is not None:
        new_chars = sum(len(p) for p in pieces if p not in lookup and not cache.cached(p))
        if new_chars > max_new_chars:
            return False
    for piece in pieces:
        token_id = lookup.get(piece)
        if token_id is not None:
            ids.append(token_id)
        else:
            ids.extend(cache.ids(piece, encode))
    return True
