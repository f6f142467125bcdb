"""A bounded memo of whole request bodies seen before: their parsed fields and token ids (pure).

An HTTP ``/v1/chat/completions`` or ``/v1/completions`` body sent again byte for byte (a retry, a
client's fan-out, a load test repeating its prompts) would be decoded, checked and tokenized again
for the same answer: for an 8k-token chat that is most of what kvlb spends on it besides the
relay, the JSON decoding alone about 0.24 million instructions (``msgspec`` scanning a 46,600
character system prompt). :class:`BodyMemo` keeps, under an XXH3-128 digest of the raw bytes, their
length and the request's kind, what routing reads of a parsed body after tokenizing
(:class:`~balancer.api.parsing.ParsedRequest` without its messages, prompt and chat kwargs: model,
``stream``, its usage options, ``max_tokens``, ``user``, ``n``) and the token ids the pool's
tokenizer gave. Everything kept is what the bytes determine; whatever depends on the settings or on
the request's headers (``limits.max_n``, ``limits.max_prompt_tokens``, the pool and its tokenizer,
the tenant, the weights header) is checked again on every hit by the caller, and ids are used only
when the pool's tokenizer is the very one that made them.

It serves identical repeated bodies only: a chat that differs in one byte (a new user message, a
different ``user``, ``stream`` or ``max_tokens``) is a miss and costs what it did plus a digest of
its last kilobyte (:data:`GUESS_TAIL_BYTES`): only a body whose tail, length and kind were seen
before is digested whole and looked up, so a body is kept from its second sight, and bodies never
sent again cost neither a whole digest nor an entry and an eviction. Only bodies that parsed and
tokenized on the event loop without error are kept: a bad body is never found and gets its 4xx
from the fresh parse.

Bounded in entries and in bytes: at most ``max_entries`` bodies and ``max_bytes`` of their ids,
their model and ``user`` strings, plus :data:`ENTRY_OVERHEAD_BYTES` each, least recently used out
first (``evictions``, exported as ``kvlb_http_body_memo_evictions_total``); a body whose entry alone
passes ``max_bytes`` is not kept (``too_large``). Like :class:`~balancer.index.hashing.KeyMemo`, a
hit trusts the 128-bit digest and the length; a collision would route the request by another body's
ids, and its own bytes still go to the engine.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import replace
from typing import Final, NamedTuple

import xxhash

from balancer.api.parsing import ParsedRequest, RequestKind

_xxh3_128 = xxhash.xxh3_128_intdigest
_xxh3_64 = xxhash.xxh3_64_intdigest

GUESS_TAIL_BYTES: Final = 1024
"""Bytes at a body's end whose digest, with the body's length and kind, tells whether a body like it
was seen before (:meth:`BodyMemo.key`): a chat's new message is at its end, so bodies that share a
long system prompt and differ in their last message are told apart without a digest of them whole."""

ENTRY_OVERHEAD_BYTES: Final = 512
"""What one entry costs besides its ids, in bytes, counted against ``max_bytes``: its key (a tuple,
a 128-bit int), the slim :class:`ParsedRequest` (about 170 B with its model and ``user`` strings)
and the table's slot."""

BodyKey = tuple[int, int, RequestKind]
"""(XXH3-128 of the body's bytes, their length, the request's kind)."""


class Remembered(NamedTuple):
    """What a body seen before gave: its parsed fields (no messages, prompt or chat kwargs), the
    tokenizer that made its ids (compared by identity) and the ids."""

    parsed: ParsedRequest
    tokenizer: object
    token_ids: array[int]


class BodyMemo:
    """Parsed fields and token ids of recently seen request bodies, by a digest of their bytes.

    ``max_entries = 0`` or ``max_bytes = 0`` turns it off (:meth:`key` gives ``None``, nothing is
    hashed). Counters: ``hits``, ``misses`` (bodies not found: first sights, and bodies looked up
    and not found), ``evictions`` (entries dropped for the bounds), ``too_large`` (bodies whose ids
    alone pass ``max_bytes``)."""

    __slots__ = (
        "_entries",
        "_seen",
        "_seen_before",
        "bytes",
        "evictions",
        "hits",
        "max_bytes",
        "max_entries",
        "misses",
        "too_large",
    )

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[BodyKey, tuple[Remembered, int]] = OrderedDict()
        # Bodies seen once, only their guesses (:meth:`key`): two generations of at most
        # ``max_entries`` each, the older dropped when the newer fills.
        self._seen: set[tuple[int, int, RequestKind]] = set()
        self._seen_before: set[tuple[int, int, RequestKind]] = set()
        self.bytes = 0
        """Bytes counted of the entries held now (ids plus :data:`ENTRY_OVERHEAD_BYTES` each)."""
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.too_large = 0

    def __len__(self) -> int:
        return len(self._entries)

    def counts(self) -> dict[str, int]:
        """The counters and what is held, for ``kvlb_http_body_memo_*`` (read at scrape time)."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "too_large": self.too_large,
            "entries": len(self._entries),
            "held_bytes": self.bytes,
        }

    def key(self, raw: bytes, kind: RequestKind) -> BodyKey | None:
        """The body's key; ``None`` when the memo is off, or when no body with the same last
        :data:`GUESS_TAIL_BYTES`, length and kind was seen before (the body is then noted as seen
        and counted a miss): a body never sent again costs a digest of its tail, not of all its
        bytes (about 40,000 instructions for 47 kB)."""
        if not self.max_entries or not self.max_bytes:
            return None
        guess = (_xxh3_64(raw[-GUESS_TAIL_BYTES:]), len(raw), kind)
        if guess not in self._seen and guess not in self._seen_before:
            if len(self._seen) >= self.max_entries:
                self._seen_before = self._seen
                self._seen = set()
            self._seen.add(guess)
            self.misses += 1
            return None
        return (_xxh3_128(raw), len(raw), kind)

    def find(self, key: BodyKey | None) -> Remembered | None:
        """What the body of ``key`` gave when it was kept, or ``None``."""
        if key is None:
            return None
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return found[0]

    def note(
        self, key: BodyKey | None, parsed: ParsedRequest, tokenizer: object, token_ids: array[int]
    ) -> None:
        """Remember what the body of ``key`` gave (parsed and tokenized without error); ``None``
        (a first sight, or the memo off) is not kept."""
        if key is None or key in self._entries:
            return
        # the model and ``user`` strings are the client's, of any length: counted at a byte a character
        size = token_ids.itemsize * len(token_ids) + ENTRY_OVERHEAD_BYTES + len(parsed.model)
        size += len(parsed.session_key or "")
        if size > self.max_bytes:
            self.too_large += 1
            return
        slim = replace(parsed, prompt=None, messages=None, chat_kwargs={}, packed=None)
        entries = self._entries
        while entries and (len(entries) >= self.max_entries or self.bytes + size > self.max_bytes):
            _, (_, dropped) = entries.popitem(last=False)
            self.bytes -= dropped
            self.evictions += 1
        entries[key] = (Remembered(slim, tokenizer, token_ids), size)
        self.bytes += size
