"""What ``kvlb bench overhead`` sends (pure except for the tokenizer's timing): the run's sizes
(:class:`OverheadShape`), the prompt kinds, and the request bodies of each kind (:class:`Prompts`).

The bodies are built once, before any server starts, from seeded random text; the chat prompts are
tokenized here too, so the report can set kvlb's added latency beside the tokenizer's own time.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

from balancer.tokenizer.tokenizer import Tokenizer
from loadtests.bench.overhead.servers import MODEL
from loadtests.workloads.text import TOKENS_PER_WORD, random_text, words_for_tokens

KINDS: tuple[str, ...] = ("chat", "chat_cold", "tokens")
QUESTION_TOKENS = 64
"""The user message of each chat prompt; the system message holds the rest."""

KIND_DESCRIPTIONS = {
    "chat": "chat messages to /v1/chat/completions (kvlb renders and tokenizes them; the 32 system "
    "prompts repeat, so after the first round they come from kvlb's segment cache)",
    "chat_cold": "chat messages whose system prompt is unique per request (tokenized from scratch)",
    "tokens": "the same prompts as token ids to /v1/completions (no tokenizer in kvlb's path)",
}


@dataclass(frozen=True, slots=True)
class OverheadShape:
    """Sizes of one ``kvlb bench overhead`` run."""

    prompt_tokens: int = 8192
    """Approximate prompt size in tokens (the measured mean is reported)."""
    prompts: int = 32
    """Distinct prompts, sent in turn."""
    sequential_rounds: int = 200
    """Sequential phase: each round sends one request on every path, in a rotating order."""
    warmup_rounds: int = 20
    """Sequential rounds sent first and not counted (connections, caches, JIT-free warm-up)."""
    concurrency: int = 32
    """Concurrent phase: clients with one request in flight each."""
    concurrent_rounds: int = 6
    """Concurrent phase: each round runs one burst per path, in a rotating order."""
    burst_requests: int = 128
    """Requests per burst (one path at a time)."""
    replicas: int = 4
    """Replicas in kvlb's pool (all on the fake upstream): the policy scores this many."""
    max_tokens: int = 2
    """``max_tokens`` of each request (the fake upstream ignores it)."""
    kinds: tuple[str, ...] = KINDS
    """Prompt kinds to measure: ``chat`` and/or ``tokens``."""
    seed: int = 0
    """Seed of the prompt text."""

    def __post_init__(self) -> None:
        sizes = {name: getattr(self, name) for name in _POSITIVE}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {self.warmup_rounds}")
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown or not self.kinds:
            raise ValueError(f"kinds must be among {', '.join(KINDS)}, got {', '.join(self.kinds) or 'none'}")


_POSITIVE = (
    "prompt_tokens", "prompts", "sequential_rounds", "concurrency", "concurrent_rounds",
    "burst_requests", "replicas", "max_tokens",
)  # fmt: skip


SMOKE = OverheadShape(
    prompt_tokens=512,
    prompts=2,
    sequential_rounds=4,
    warmup_rounds=1,
    concurrency=4,
    concurrent_rounds=1,
    burst_requests=8,
    replicas=2,
)
"""A seconds-long run for tests and CI (figures meaningless)."""


@dataclass(frozen=True, slots=True)
class Prompts:
    """The request bodies of both kinds, and what tokenizing the chat prompts cost here."""

    chat: tuple[bytes, ...]
    tokens: tuple[bytes, ...]
    token_counts: tuple[int, ...]
    tokenize_s: tuple[float, ...]
    chat_cold: tuple[bytes, ...] = ()
    """Chat bodies whose system prompt is unique per request: kvlb's tokenizer cache never hits."""

    def bodies(self, kind: str) -> tuple[str, tuple[bytes, ...]]:
        """(path, bodies) of ``kind``."""
        if kind == "chat":
            return "/v1/chat/completions", self.chat
        if kind == "chat_cold":
            return "/v1/chat/completions", self.chat_cold
        return "/v1/completions", self.tokens


def build_prompts(shape: OverheadShape, tokenizer: Tokenizer) -> Prompts:
    """Distinct chat prompts of about ``prompt_tokens`` tokens, and the same as token ids. Blocking."""
    rng = random.Random(shape.seed)
    system_words = words_for_tokens(max(1, shape.prompt_tokens - QUESTION_TOKENS), TOKENS_PER_WORD)
    question_words = words_for_tokens(QUESTION_TOKENS, TOKENS_PER_WORD)
    chat, tokens, counts, timings = [], [], [], []
    for _ in range(shape.prompts):
        messages = [
            {"role": "system", "content": random_text(rng, system_words)},
            {"role": "user", "content": random_text(rng, question_words)},
        ]
        ids: list[int] = []
        for _ in range(3):
            started = time.perf_counter()
            ids = tokenizer.encode_chat(messages)
            timings.append(time.perf_counter() - started)
        common = {"model": MODEL, "max_tokens": shape.max_tokens, "stream": True}
        chat.append(json.dumps({**common, "messages": messages}).encode())
        tokens.append(json.dumps({**common, "prompt": ids}).encode())
        counts.append(len(ids))
    return Prompts(tuple(chat), tuple(tokens), tuple(counts), tuple(timings), cold_bodies(shape, chat))


def cold_bodies(shape: OverheadShape, chat: list[bytes]) -> tuple[bytes, ...]:
    """One body per request sent (no repeats): each system prompt starts with a unique nonce, so
    every request is tokenized from scratch, as for traffic that shares no prompt text."""
    needed = shape.warmup_rounds + shape.sequential_rounds + shape.burst_requests * shape.concurrent_rounds
    out = []
    for index in range(needed):
        body = json.loads(chat[index % len(chat)])
        system = body["messages"][0]
        system["content"] = f"Request {index} of this run. {system['content']}"
        out.append(json.dumps(body).encode())
    return tuple(out)
