"""Deterministic "generation" for the emulator (pure).

Generated token ``i`` of a request is a hash of (prompt, ``i``, salt): the same prompt gives the same
output every time with ``temperature`` 0; with ``temperature`` > 0 the salt is the request's ``seed``
(reproducible) or, without one, a per-replica request counter (varies, yet replays identically from a
fresh start). Ids avoid the low range where vocabularies keep their special tokens. Text is one word
per token from a fixed list, so outputs are readable and their length is predictable.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Final

_LOW_ID: Final = 100
"""First id generated: ids below are left to special tokens."""
_MAX_SPAN: Final = 100_000
"""Generated ids stay below ``_LOW_ID + _MAX_SPAN`` (inside every real vocabulary's regular range)."""
_MASK64: Final = (1 << 64) - 1

WORDS: Final[tuple[str, ...]] = (
    "the", "cache", "router", "token", "block", "prefix", "replica", "engine",
    "batch", "page", "tree", "query", "model", "decode", "prefill", "latency",
    "load", "event", "stream", "index", "hash", "queue", "policy", "cost",
    "fleet", "prompt", "reply", "kernel", "memory", "buffer", "shard", "node",
    "is", "a", "of", "and", "to", "in", "on", "for",
    "fast", "warm", "cold", "busy", "idle", "shared", "local", "remote",
    "first", "next", "last", "every", "some", "many", "few", "all",
    "runs", "holds", "sends", "keeps", "finds", "moves", "waits", "ends",
)  # fmt: skip


def prompt_digest(prompt: Sequence[int]) -> int:
    """A 64-bit digest of the prompt's token ids (the seed of its generated tokens)."""
    packed = struct.pack(f"<{len(prompt)}I", *prompt)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


def sampling_salt(temperature: float, seed: int | None, request_number: int) -> int:
    """0 for greedy decoding; otherwise the request's seed, or its number when it has none."""
    if temperature <= 0.0:
        return 0
    if seed is not None:
        return (seed & _MASK64) | (1 << 64)  # never collides with the greedy salt 0
    return (request_number & _MASK64) | (2 << 64)


def _mix64(value: int) -> int:
    """SplitMix64 finaliser: a cheap, well-spread bijection of 64-bit values."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def sample_token(digest: int, index: int, salt: int, vocab_size: int) -> int:
    """Generated token ``index`` (0-based) of a request whose prompt digest is ``digest``."""
    span = max(1, min(_MAX_SPAN, vocab_size - _LOW_ID))
    mixed = _mix64(digest ^ _mix64(index) ^ _mix64(salt & _MASK64) ^ (salt >> 64))
    return _LOW_ID + mixed % span


def token_text(token: int) -> str:
    """The text piece of a generated token: a space and one word."""
    return " " + WORDS[token % len(WORDS)]
