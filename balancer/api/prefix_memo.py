"""A bounded memo of chat body prefixes seen before, decoded once (pure).

Chats that share a long system prompt (and multi-turn chats, whose history is the earlier turns'
body) differ only near their end, yet ``msgspec`` scans the whole body on every request: for an
8k-token system prompt, about 0.24 million instructions of decoding for 46,600 characters mostly
seen before. :class:`PrefixMemo` keeps, for a body prefix seen twice, what decoding it gave, and for
a body that begins with those very bytes decodes only the rest.

A prefix ``P`` is kept only where it ends right after a complete element of the top-level
``messages`` array (a ``}``), with the decoder's state known there: the top-level object holds the
keys before ``messages`` and ``messages`` is open, after an element. :meth:`PrefixMemo.learn`
proves that state by decoding ``P + ,"<sentinel>"]}`` (valid only there) and checking that the
sentinel closed ``messages`` and no other array. A body ``P + T`` then decodes as the synthetic
document ``{"":[null`` + ``T``, which is in that same state after ``[null``: it is valid JSON (to
``msgspec``: strict UTF-8, no lone surrogate, same depth) exactly when the whole body is, and it
holds ``T``'s further messages after the ``null`` and ``T``'s keys after ``messages``. The answer
joins the prefix's fields (fresh containers, scalars shared) with those. Whenever that could differ
from a whole decode, the whole decode answers instead (``fallbacks``): the synthetic document
refused (any error then comes from the whole decode, as before), ``T`` holding a key written ``""``
(the synthetic's own) or a key the prefix holds (a duplicate: the whole decode keeps the last). So
:meth:`PrefixMemo.decode` gives what :func:`~balancer.api.parsing.decode_object` gives, for every body.

Where a prefix may end is found without decoding: the last ``},{`` or ``}, {`` (compact and
``json.dumps`` separators) before the body's last ``"role"`` (its last message's: keys such as
``tools`` after ``messages`` hold none). A chat's new message is its last, so for ``[system, user]``
that is the system message's end, for a multi-turn chat the end of its history. Bodies are grouped by a
digest of their first :data:`HEAD_BYTES`; a head seen once is only noted (two generations of at most
``max_entries`` each), so a body never sent again costs that digest. From a head's second sight, a
body not found proposes its boundary (a pending entry: the prefix's length and XXH3-128 digest); a
later body with the same prefix bytes finds it, proves its state (:meth:`learn`: about one decode of
the prefix) and keeps its decoded fields. Like :class:`~balancer.api.body_memo.BodyMemo`, a match
trusts the 128-bit digest and the length.

Bounded in entries and bytes: at most ``max_entries`` prefixes (pending ones included) and
``max_bytes`` of their decoded fields' estimated size (:func:`~balancer.api.parsing.json_text_size`)
plus :data:`ENTRY_OVERHEAD_BYTES` each, least recently used out first (``evictions``,
``kvlb_http_prefix_memo_evictions_total``); a prefix whose fields alone pass ``max_bytes`` is not kept
(``too_large``). A body fully repeated is the body memo's (:mod:`balancer.api.body_memo`), looked up
first; the tokenizer's segment cache is untouched (it sees the same messages).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any, Final

import xxhash

from balancer.api.parsing import decode_object, fast_decode, json_text_size

_xxh3_128 = xxhash.xxh3_128_intdigest
_xxh3_64 = xxhash.xxh3_64_intdigest

HEAD_BYTES: Final = 256
"""Bytes at a body's start whose digest groups bodies that may share a prefix."""

MIN_PREFIX_BYTES: Final = 2048
"""Shortest prefix kept, in bytes: a shorter one saves less decoding than its lookups and join cost
(a body shorter than this is decoded whole without a look)."""

PREFIXES_PER_HEAD: Final = 4
"""Prefix lengths tried for one head, most recent first: each costs a digest of that many bytes."""

ENTRY_OVERHEAD_BYTES: Final = 512
"""What one entry costs besides its decoded fields, in bytes, counted against ``max_bytes``: its key,
its slot, its head's list of lengths."""

MAX_PREFIX_DEPTH: Final = 64
"""Deepest nesting of a prefix's decoded fields that is kept (its copy per request recurses)."""

SENTINEL: Final = "\x00kvlb-prefix-memo"
"""The string :meth:`PrefixMemo.learn` appends to the open array to find which one it is."""

_SENTINEL_JSON: Final = b',"\\u0000kvlb-prefix-memo"]}'
_OPENER: Final = b'{"":[null'
_BOUNDARIES: Final = (b"},{", b"}, {")
_EMPTY_KEY: Final = re.compile(rb'""[ \t\n\r]*:')
"""A key ``""`` in a tail: no escape spells the empty string otherwise (a match inside a string, as
in ``"a\\"" :``, only costs a whole decode)."""

PrefixKey = tuple[int, int]
"""(the prefix's length in bytes, XXH3-128 of those bytes)."""


class _Entry:
    """A prefix: its head's digest, and once learned, its decoded top-level fields (``messages``
    the prefix's complete elements) and its counted size."""

    __slots__ = ("fields", "head", "size")

    def __init__(self, head: int, size: int) -> None:
        self.head = head
        self.fields: dict[str, Any] | None = None
        self.size = size


class PrefixMemo:
    """Decoded prefixes of recently seen chat bodies (:meth:`decode`).

    ``max_entries = 0`` or ``max_bytes = 0`` turns it off (every body decoded whole, nothing hashed).
    Counters: ``hits`` (bodies whose tail alone was decoded), ``misses`` (bodies of
    :data:`MIN_PREFIX_BYTES` or more with no known prefix), ``learned`` (prefixes proved and kept),
    ``refused`` (proposed prefixes whose state could not be proved), ``fallbacks`` (bodies with a
    known prefix decoded whole: an invalid tail, a duplicate key), ``evictions``, ``too_large``."""

    __slots__ = (
        "_entries",
        "_heads",
        "_refused",
        "_refused_before",
        "_seen",
        "_seen_before",
        "bytes",
        "evictions",
        "fallbacks",
        "hits",
        "learned",
        "max_bytes",
        "max_entries",
        "misses",
        "refused",
        "too_large",
    )

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[PrefixKey, _Entry] = OrderedDict()
        self._heads: dict[int, dict[int, int]] = {}
        """Prefix lengths of each head's entries, oldest first (at most :data:`PREFIXES_PER_HEAD`),
        each with its number of entries."""
        self._refused: set[PrefixKey] = set()
        self._refused_before: set[PrefixKey] = set()
        self._seen: set[int] = set()
        self._seen_before: set[int] = set()
        self.bytes = 0
        """Bytes counted of the entries held now."""
        self.hits = 0
        self.misses = 0
        self.learned = 0
        self.refused = 0
        self.fallbacks = 0
        self.evictions = 0
        self.too_large = 0

    def __len__(self) -> int:
        return len(self._entries)

    def counts(self) -> dict[str, int]:
        """The counters and what is held, for ``kvlb_http_prefix_memo_*`` (read at scrape time)."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "learned": self.learned,
            "refused": self.refused,
            "fallbacks": self.fallbacks,
            "evictions": self.evictions,
            "too_large": self.too_large,
            "entries": len(self._entries),
            "held_bytes": self.bytes,
        }

    def decode(self, raw: bytes) -> dict[str, Any]:
        """``raw`` as a JSON object, or 400: exactly :func:`~balancer.api.parsing.decode_object`'s
        answer, with a known prefix's bytes not decoded again."""
        known = self.decode_known(raw)
        return decode_object(raw) if known is None else known

    def decode_known(self, raw: bytes) -> dict[str, Any] | None:
        """What :func:`~balancer.api.parsing.decode_object` gives for ``raw``, decoding only what
        follows a known prefix; ``None`` when the whole decode must answer (no known prefix, or
        a tail that could answer otherwise): the caller calls it as it would have, so its errors
        (and its depth on the stack, which bounds the nesting ``msgspec`` accepts) are the same."""
        if not self.max_entries or not self.max_bytes or len(raw) < MIN_PREFIX_BYTES:
            return None
        head = _xxh3_64(raw[:HEAD_BYTES])
        lengths = self._heads.get(head)
        if lengths is not None:
            for length in reversed(lengths):
                if length >= len(raw) or raw[length - 1] != 0x7D:  # "}"
                    continue
                key = (length, _xxh3_128(memoryview(raw)[:length]))
                entry = self._entries.get(key)
                if entry is None:
                    continue
                if entry.fields is None and not self.learn(key, raw):
                    self.misses += 1
                    return None
                self._entries.move_to_end(key)
                assert entry.fields is not None
                joined = join(entry.fields, raw[length:])
                if joined is None:
                    self.fallbacks += 1
                else:
                    self.hits += 1
                return joined
        self.misses += 1
        if lengths is not None or head in self._seen or head in self._seen_before:
            self._propose(head, raw)
        else:
            if len(self._seen) >= self.max_entries:
                self._seen_before = self._seen
                self._seen = set()
            self._seen.add(head)
        return None

    def learn(self, key: PrefixKey, raw: bytes) -> bool:
        """Prove the pending prefix ``key`` (``raw``'s first ``key[0]`` bytes) ends after an element
        of the top-level ``messages`` array and keep its decoded fields; ``False`` (and the entry
        dropped) when it does not, or when they pass ``max_bytes``."""
        entry = self._entries[key]
        decoded = fast_decode(raw[: key[0]] + _SENTINEL_JSON)
        messages = decoded.get("messages") if decoded is not None else None
        if (
            decoded is None
            or type(messages) is not list
            or len(messages) < 2
            or messages[-1] != SENTINEL
            or any(type(v) is list and v and v[-1] == SENTINEL for k, v in decoded.items() if k != "messages")
            or _depth_over(decoded, MAX_PREFIX_DEPTH)
        ):
            self.refused += 1
            self._refuse(key)
            return False
        del messages[-1]
        size = json_text_size(decoded)[1] + ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:
            self.too_large += 1
            self._refuse(key)
            return False
        entry.fields = decoded
        self.bytes += size - entry.size
        entry.size = size
        self.learned += 1
        self._entries.move_to_end(key)
        self._evict(keep=1)
        return True

    def _refuse(self, key: PrefixKey) -> None:
        """Drop the pending ``key`` and note it, so that it is not proposed (and decoded) again
        (two generations of at most ``max_entries`` each)."""
        self._drop(key)
        if len(self._refused) >= self.max_entries:
            self._refused_before = self._refused
            self._refused = set()
        self._refused.add(key)

    def _propose(self, head: int, raw: bytes) -> None:
        """Note where ``raw``'s prefix may end (the boundary before its last message) as a pending
        entry."""
        last = raw.rfind(b'"role"')  # in the last message, before any "tools" after the messages
        end = max(raw.rfind(boundary, 0, last) for boundary in _BOUNDARIES) + 1 if last > 0 else 0
        if end < MIN_PREFIX_BYTES:
            return
        key = (end, _xxh3_128(memoryview(raw)[:end]))
        if key in self._entries or key in self._refused or key in self._refused_before:
            return
        lengths = self._heads.setdefault(head, {})
        lengths[end] = lengths.pop(end, 0) + 1
        if len(lengths) > PREFIXES_PER_HEAD:  # the oldest length is no longer tried (its entries age out)
            del lengths[next(iter(lengths))]
        self._entries[key] = _Entry(head, ENTRY_OVERHEAD_BYTES)
        self.bytes += ENTRY_OVERHEAD_BYTES
        self._evict(keep=1)

    def _evict(self, keep: int) -> None:
        """Least recently used entries out until the bounds hold (the ``keep`` newest stay)."""
        entries = self._entries
        while len(entries) > keep and (len(entries) > self.max_entries or self.bytes > self.max_bytes):
            self._drop(next(iter(entries)))
            self.evictions += 1

    def _drop(self, key: PrefixKey) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.size
        lengths = self._heads.get(entry.head)
        if lengths is not None and key[0] in lengths:
            lengths[key[0]] -= 1
            if lengths[key[0]] <= 0:
                del lengths[key[0]]
                if not lengths:
                    del self._heads[entry.head]


def join(fields: dict[str, Any], tail: bytes) -> dict[str, Any] | None:
    """The body a prefix decoded to ``fields`` (``messages`` open after its last element) and
    ``tail`` make, decoded: ``None`` when the whole decode must answer (the tail refused, a key
    ``""`` in it, a key the prefix holds)."""
    if _EMPTY_KEY.search(tail) is not None:
        return None
    rest = fast_decode(_OPENER + tail)
    if rest is None:
        return None
    more = rest.pop("")
    if not fields.keys().isdisjoint(rest):
        return None
    # Built as ``msgspec`` builds them, item by item (``extend`` and ``update`` size their tables
    # otherwise), so that ``sys.getsizeof`` gives the same and so does
    # :attr:`~balancer.api.parsing.ParsedRequest.parsed_bytes`.
    body = {key: _fresh(value) for key, value in fields.items()}
    append = body["messages"].append
    for message in more[1:]:
        append(message)
    for key, value in rest.items():
        body[key] = value
    return body


def _fresh(value: Any) -> Any:
    """``value`` with new dicts and lists, so that a request may not change the memo's objects, and
    new copies of its strings that are not ASCII (a memcpy each): once read as UTF-8 (by the
    tokenizer, an encoder) a string keeps that form and ``sys.getsizeof`` counts it, so a shared one
    would weigh more in :func:`~balancer.api.parsing.json_text_size` than the same string decoded
    fresh (:func:`_fresh_str`). Numbers are shared."""
    kind = type(value)
    if kind is str:
        return _fresh_str(value)
    if kind is dict:
        return {_fresh_str(key): _fresh(item) for key, item in value.items()}
    if kind is list:
        return [_fresh(item) for item in value]
    return value


def _fresh_str(text: str) -> str:
    """``text`` as a whole decode would give it: a new copy, unless it is ASCII (its UTF-8 is its own
    bytes) or one character of Latin-1 (the decoder gives CPython's shared object for it, whose
    size is then that object's, UTF-8 kept or not)."""
    if text.isascii() or (len(text) == 1 and text <= "\xff"):
        return text
    return "".join((text, ""))


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests dicts and lists deeper than ``limit`` (no recursion)."""
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if depth > limit:
            return True
        if type(item) is dict:
            pending.extend((child, depth + 1) for child in item.values())
        elif type(item) is list:
            pending.extend((child, depth + 1) for child in item)
    return False
