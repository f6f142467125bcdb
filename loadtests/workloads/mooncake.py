"""Mooncake trace replay as token-id ``/v1/completions`` requests (pure, but :func:`read_trace` reads a file).

A Mooncake trace (FAST'25, Kimi/Moonshot AI) is JSON lines of ``timestamp`` (ms from the start),
``input_length``, ``output_length`` and ``hash_ids``, the prompt's 512-token blocks (the last may be
partial); requests sharing a leading run of ``hash_ids`` share that prefix. Replay turns each hash id
into 512 token ids drawn from a generator seeded by ``(salt, hash_id)``, with the salt taken once from
the run's rng, so equal ids always give equal blocks within a run and a new seed gives new tokens. The
prompt is the blocks' concatenation truncated to ``input_length``; ids lie in ``[1000, 100000)``, safe
for the DeepSeek-V3 vocabulary (129,280) the emulator and kvlb use.

``prompt_format="text"`` replays the same rows as **text** chat requests instead (one user message),
for routers that accept only text (sglang-router) and so that kvlb runs on the same text. Each hash id
becomes a block of words (:func:`loadtests.workloads.text.random_text`, drawn from a generator seeded
by ``(salt, hash_id)``) sized to 512 tokens at :data:`~loadtests.workloads.text.TOKENS_PER_WORD`;
the prompt is the blocks joined by spaces, the last block cut to the row's remaining length in words,
and an unshared tail of fresh words when ``input_length`` runs past the blocks. Two rows sharing a
leading run of hash ids therefore share that text prefix exactly, and, since the tokenizer splits
at spaces first, the same token prefix up to the first differing word. Block boundaries fall within
tokenizer drift of multiples of 512 tokens (a few percent: the words drawn vary in token count), not
on them; prompt lengths are approximate in the same way.
"""

from __future__ import annotations

import gzip
import json
import math
import random
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar

from loadtests.workloads.base import ChatMessage, RequestSpec, check_positive, make_tags
from loadtests.workloads.text import TOKENS_PER_WORD, random_text, words_for_tokens

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the published Mooncake traces."""


class TraceError(ValueError):
    """A trace line that is not a valid Mooncake record."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One Mooncake trace record."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


_GZIP_MAGIC = b"\x1f\x8b"
_TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _whole(raw: dict[str, Any], name: str) -> int:
    """Field ``name`` as an int: a JSON integer, or a finite number (truncated), never a bool."""
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TraceError(f"{name} must be a finite number, got {value!r}")
    return int(value)


def parse_trace_line(line: str) -> TraceRow:
    """One JSON line → :class:`TraceRow`; raises :class:`TraceError` when a field is missing or wrong.

    A record is a JSON object with the four fields; ``input_length`` must be at least 1 (an engine
    refuses an empty prompt: one such row would count as an error at every rate),
    ``output_length`` and the hash ids at least 0 (an ``output_length`` of 0 asks for one token).
    """
    try:
        raw = json.loads(line)
    except ValueError as exc:
        raise TraceError(f"not JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise TraceError(f"not a Mooncake record (a JSON object with {', '.join(_TRACE_FIELDS)})")
    missing = [name for name in _TRACE_FIELDS if name not in raw]
    if missing:
        raise TraceError(f"missing field(s) {', '.join(missing)}")
    hash_ids = raw["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise TraceError("hash_ids must be a list of integers")
    row = TraceRow(
        timestamp_ms=_whole(raw, "timestamp"),
        input_length=_whole(raw, "input_length"),
        output_length=_whole(raw, "output_length"),
        hash_ids=tuple(hash_ids),
    )
    if row.input_length < 1:
        raise TraceError(f"input_length must be >= 1, got {row.input_length}")
    if row.output_length < 0 or any(h < 0 for h in row.hash_ids):
        raise TraceError("negative output_length or hash id")
    return row


def _text(path: str | Path, compressed: bool) -> IO[str]:
    """The trace's lines as text (a UTF-8 byte-order mark dropped), gunzipped when ``compressed``."""
    if compressed:
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def check_order(path: str | Path, *, offset: int = 0, limit: int | None = None) -> int:
    """One streaming pass over rows ``offset .. offset + limit`` (as :func:`read_trace`, every row
    parsed, nothing kept): their count, or :class:`TraceError` for the first bad row or the first
    row earlier than the one before it (the words of :func:`replay`'s check, numbered as it does).
    ``kvlb loadtest`` runs it before it starts a fleet: 0.11-0.13 s for the repo's 3,993-row trace
    (2026-12-01 10:21 UTC, load 5.3; 0.28-0.63 s at load 11-15)."""
    previous_ms: int | None = None
    count = 0
    for n, row in enumerate(read_trace(path, offset=offset, limit=limit), start=offset):
        if previous_ms is not None and row.timestamp_ms < previous_ms:
            raise TraceError(
                f"{path}: trace row {n + 1}: timestamp {row.timestamp_ms} ms is earlier than the row "
                f"before it ({previous_ms} ms); a trace must be in arrival order (sort it by timestamp)"
            )
        previous_ms = row.timestamp_ms
        count += 1
    return count


def read_trace(path: str | Path, *, offset: int = 0, limit: int | None = None) -> Iterator[TraceRow]:
    """Rows ``offset .. offset + limit`` of a trace file, read lazily (blank lines skipped). I/O.

    The file may be gzip-compressed (told by its first bytes, not its name), may start with a UTF-8
    byte-order mark and may end lines with CRLF. A bad line raises :class:`TraceError` naming the
    file and the line number.
    """
    if offset < 0 or (limit is not None and limit < 0):
        raise ValueError(f"offset and limit must be >= 0, got {offset}, {limit}")
    with open(path, "rb") as probe:
        compressed = probe.read(2) == _GZIP_MAGIC
    taken = 0
    index = 0
    number = 0
    try:
        with _text(path, compressed) as lines:
            for number, line in enumerate(lines, start=1):
                if limit is not None and taken >= limit:
                    return
                if not line.strip():
                    continue
                if index >= offset:
                    try:
                        yield parse_trace_line(line)
                    except TraceError as exc:
                        raise TraceError(f"{path} line {number}: {exc}: {line.strip()[:80]!r}") from None
                    taken += 1
                index += 1
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError, zlib.error) as exc:
        what = "gzip data" if compressed else "text"
        raise TraceError(f"{path} line {number + 1}: not UTF-8 JSON lines {what} ({exc})") from None


class BlockTokens:
    """Deterministic token ids per hash id, with a bounded LRU of recent blocks.

    ``cache_blocks`` blocks are kept; past that the least recently used is dropped and counted in
    ``evictions`` (it is regenerated, identical, when asked again).
    """

    __slots__ = ("_cache", "block_tokens", "cache_blocks", "evictions", "high", "low", "salt")

    def __init__(
        self,
        salt: int,
        *,
        block_tokens: int = MOONCAKE_BLOCK_TOKENS,
        low: int = 1000,
        high: int = 100_000,
        cache_blocks: int = 4096,
    ) -> None:
        check_positive("BlockTokens", block_tokens=block_tokens, cache_blocks=cache_blocks)
        if not 0 <= low < high:
            raise ValueError(f"need 0 <= low < high, got {low}, {high}")
        self.salt = salt
        self.block_tokens = block_tokens
        self.low = low
        self.high = high
        self.cache_blocks = cache_blocks
        self.evictions = 0
        self._cache: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def block(self, hash_id: int) -> tuple[int, ...]:
        """The ``block_tokens`` ids of ``hash_id``."""
        cached = self._cache.get(hash_id)
        if cached is not None:
            self._cache.move_to_end(hash_id)
            return cached
        # A str seed is hashed with SHA-512 by random.Random: stable across runs and platforms.
        raw = random.Random(f"{self.salt}:{hash_id}").randbytes(4 * self.block_tokens)
        span = self.high - self.low
        ids = tuple(self.low + v % span for v in struct.unpack(f"<{self.block_tokens}I", raw))
        self._cache[hash_id] = ids
        if len(self._cache) > self.cache_blocks:
            self._cache.popitem(last=False)
            self.evictions += 1
        return ids

    def prompt(self, hash_ids: Iterable[int], length: int) -> list[int]:
        """Blocks of ``hash_ids`` concatenated, cut at ``length`` (short if the blocks run out)."""
        ids: list[int] = []
        for hash_id in hash_ids:
            if len(ids) >= length:
                break
            ids.extend(self.block(hash_id))
        del ids[length:]
        return ids


class BlockText:
    """Deterministic text per hash id (module docstring), with a bounded LRU of recent blocks."""

    __slots__ = ("_cache", "block_words", "cache_blocks", "salt")

    def __init__(
        self, salt: int, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS, cache_blocks: int = 4096
    ) -> None:
        check_positive("BlockText", block_tokens=block_tokens, cache_blocks=cache_blocks)
        self.salt = salt
        self.block_words = words_for_tokens(block_tokens, TOKENS_PER_WORD)
        self.cache_blocks = cache_blocks
        self._cache: OrderedDict[int, list[str]] = OrderedDict()

    def block(self, hash_id: int) -> list[str]:
        """The ``block_words`` words of ``hash_id``."""
        cached = self._cache.get(hash_id)
        if cached is not None:
            self._cache.move_to_end(hash_id)
            return cached
        words = random_text(random.Random(f"text:{self.salt}:{hash_id}"), self.block_words).split(" ")
        self._cache[hash_id] = words
        if len(self._cache) > self.cache_blocks:
            self._cache.popitem(last=False)
        return words

    def prompt(self, hash_ids: Iterable[int], length: int, rng: random.Random) -> str:
        """Blocks of ``hash_ids`` joined, cut at about ``length`` tokens, padded with fresh words."""
        want = words_for_tokens(length, TOKENS_PER_WORD)
        words: list[str] = []
        for hash_id in hash_ids:
            if len(words) >= want:
                break
            words.extend(self.block(hash_id))
        del words[want:]
        if len(words) < want:
            words.extend(random_text(rng, want - len(words)).split(" "))
        return " ".join(words)


def replay(
    rows: Iterable[TraceRow],
    rng: random.Random,
    *,
    time_scale: float = 1.0,
    max_tokens_cap: int | None = None,
    max_input_tokens: int | None = None,
    first_index: int = 0,
    prompt_format: str = "tokens",
) -> Iterator[RequestSpec]:
    """Specs of ``rows``: token-id prompts, ``arrival_s`` = (timestamp − first timestamp) · ``time_scale``.

    ``max_tokens`` is ``output_length`` (at least 1), cut at ``max_tokens_cap``; prompts are cut at
    ``max_input_tokens`` (a prefix, so sharing is kept). A row whose ``input_length`` is longer than its
    blocks is padded with fresh ids from ``rng`` (an unshared tail). Request ids count from ``first_index``.
    A row whose timestamp is earlier than the one before it raises :class:`TraceError`.
    """
    check_positive("replay", time_scale=time_scale)
    if prompt_format not in ("tokens", "text"):
        raise ValueError(f"prompt_format must be tokens or text, got {prompt_format!r}")
    salt = rng.getrandbits(64)
    blocks = BlockTokens(salt)
    texts = BlockText(salt)
    start_ms: int | None = None
    previous_ms: int | None = None
    for n, row in enumerate(rows, start=first_index):
        start_ms = row.timestamp_ms if start_ms is None else start_ms
        if previous_ms is not None and row.timestamp_ms < previous_ms:
            raise TraceError(
                f"trace row {n + 1}: timestamp {row.timestamp_ms} ms is earlier than the row before it "
                f"({previous_ms} ms); a trace must be in arrival order (sort it by timestamp)"
            )
        previous_ms = row.timestamp_ms
        length = row.input_length if max_input_tokens is None else min(row.input_length, max_input_tokens)
        max_tokens = max(1, row.output_length)
        if max_tokens_cap is not None:
            max_tokens = min(max_tokens, max_tokens_cap)
        token_ids: tuple[int, ...] | None = None
        messages: tuple[ChatMessage, ...] | None = None
        if prompt_format == "text":
            messages = (ChatMessage("user", texts.prompt(row.hash_ids, length, rng)),)
        else:
            prompt = blocks.prompt(row.hash_ids, length)
            prompt.extend(rng.randrange(blocks.low, blocks.high) for _ in range(length - len(prompt)))
            token_ids = tuple(prompt)
        yield RequestSpec(
            f"mooncake-{n}",
            max_tokens,
            messages=messages,
            prompt_token_ids=token_ids,
            arrival_s=max(0.0, (row.timestamp_ms - start_ms) / 1000.0 * time_scale),
            tags=make_tags(trace_index=n, input_length=row.input_length, blocks=len(row.hash_ids)),
        )


@dataclass(frozen=True, slots=True)
class MooncakeWorkload:
    """Replay of a Mooncake trace file slice (``offset``, ``limit``) with a time scale."""

    name: ClassVar[str] = "mooncake"

    path: str
    """The trace file (JSON lines)."""

    offset: int = 0
    """Rows skipped at the start of the file."""

    limit: int | None = None
    """Rows replayed after ``offset``; ``None``: to the end of the file."""

    time_scale: float = 1.0
    """Multiplies the gaps between timestamps (< 1 replays faster, e.g. 0.5 = twice the rate)."""

    max_tokens_cap: int | None = None
    """Upper bound on ``max_tokens`` (from ``output_length``); ``None``: none."""

    max_input_tokens: int | None = None
    """Prompts are cut to this many tokens (kept a prefix) to fit a replica's context; ``None``: none."""

    prompt_format: str = "tokens"
    """``tokens``: token-id prompts to ``/v1/completions``; ``text``: the same prefix structure as
    text chat requests (module docstring), for text-only routers such as sglang-router."""

    def __post_init__(self) -> None:
        check_positive(self.name, time_scale=self.time_scale)
        if self.prompt_format not in ("tokens", "text"):
            raise ValueError(f"mooncake: prompt_format must be tokens or text, got {self.prompt_format!r}")
        for name, value in (
            ("max_tokens_cap", self.max_tokens_cap),
            ("max_input_tokens", self.max_input_tokens),
        ):
            if value is not None:
                check_positive(self.name, **{name: value})

    def generate(self, rng: random.Random) -> Iterator[RequestSpec]:
        return replay(
            read_trace(self.path, offset=self.offset, limit=self.limit),
            rng,
            time_scale=self.time_scale,
            max_tokens_cap=self.max_tokens_cap,
            max_input_tokens=self.max_input_tokens,
            first_index=self.offset,
            prompt_format=self.prompt_format,
        )
