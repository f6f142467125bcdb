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

from balancer.api.openai import INLINE_TOKENIZE_CHARS
from balancer.api.parsing import parse_request
from balancer.tokenizer.tokenizer import Tokenizer
from loadtests.bench.overhead.servers import MODEL
from loadtests.workloads.text import TOKENS_PER_WORD, random_text, words_for_tokens

KINDS: tuple[str, ...] = ("chat_shared", "chat", "chat_cold", "tokens", "tokens_shared", "grpc_tokens")
GRPC_KINDS = frozenset({"grpc_tokens"})
"""Kinds sent to the kvlb paths over gRPC (``Generate``); the other paths get the same bodies over HTTP."""
UNIQUE_KINDS = frozenset({"chat_shared", "chat_cold", "tokens_shared"})
"""Kinds whose every request is a new body (no body is sent twice to a path)."""
QUESTION_TOKENS = 64
"""The user message of each chat prompt; the system message holds the rest."""

KIND_DESCRIPTIONS = {
    "chat_shared": "chat messages to /v1/chat/completions: one of the shared system prompts (from "
    "kvlb's segment cache after the warm-up) and a user message unique per request",
    "chat": "chat messages to /v1/chat/completions (kvlb renders and tokenizes them; the distinct prompts "
    "repeat whole, so after the warm-up every segment comes from kvlb's segment cache)",
    "chat_cold": "chat messages whose system prompt and user message are unique per request "
    "(tokenized from scratch)",
    "tokens": "the chat prompts as token ids to /v1/completions, the distinct prompts repeated whole "
    "(no tokenizer in kvlb's path; after the warm-up every run of ids is in kvlb's token-id memo: its "
    "best case)",
    "tokens_shared": "the chat_shared prompts as token ids to /v1/completions: one of the shared "
    "system prompts' ids and a user message's ids unique per request (the memo finds the system "
    "prompt's runs, the user tail is decoded)",
    "grpc_tokens": "the tokens prompts as token ids over gRPC to kvlb (kvlb.v1.Balancer/Generate with "
    "prompt_token_ids; kvlb packs the ids from the message and writes the replica's JSON body itself, "
    "repeated prompts' runs of packed ids found in its token-id memo), "
    "as HTTP /v1/completions bodies to the other paths",
}


@dataclass(frozen=True, slots=True)
class OverheadShape:
    """Sizes of one ``kvlb bench overhead`` run."""

    prompt_tokens: int = 8192
    """Approximate prompt size in tokens (the measured mean is reported)."""
    prompts: int = 32
    """Distinct prompts, sent in turn."""
    sequential_rounds: int = 200
    """Sequential phase: requests each path gets, one at a time, in blocks of :attr:`sequential_block`."""
    sequential_block: int = 8
    """Sequential phase: requests a path gets back to back before the next path's turn (the order of
    the paths rotates block by block). Sent one request per path in turn, every path would idle
    through every other path's latency (about 43 ms for sglang-router on ``chat_shared``), and on a
    VM a process that idled that long runs its next request up to 3× slower: the phase would then
    measure the slowest path's latency, not each path's cost. The spaced phase measures that regime on
    purpose, with the same idle time for every path."""
    spaced_rounds: int = 30
    """Spaced phase: each round sends one request on every path, in a rotating order, each after
    :attr:`spaced_gap_ms` of idle time: traffic at a low rate, every process starting cold."""
    spaced_gap_ms: float = 50.0
    """Spaced phase: idle time before each request, in milliseconds (0 to 10,000)."""
    warmup_rounds: int = 20
    """Sequential rounds sent first and not counted (connections, caches); at least three times
    :attr:`prompts` are sent (:attr:`warmup`), so that every distinct prompt has been seen three
    times before measuring."""
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
    """Prompt kinds to measure, among :data:`KINDS`."""
    seed: int = 0
    """Seed of the prompt text."""
    workers: tuple[int, ...] = (1, 2)
    """``kvlb serve --workers`` counts measured side by side: the path ``kvlb`` runs the first, each
    other count ``n`` the path ``kvlb_w<n>`` (its CPU summed over the supervisor and workers)."""

    def __post_init__(self) -> None:
        sizes = {name: getattr(self, name) for name in _POSITIVE}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= self.spaced_gap_ms <= 10_000:
            raise ValueError(f"spaced_gap_ms must be in [0, 10000], got {self.spaced_gap_ms}")
        if self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {self.warmup_rounds}")
        if not self.workers or min(self.workers) < 1 or len(set(self.workers)) != len(self.workers):
            raise ValueError(f"workers must be distinct counts >= 1, got {self.workers}")
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown or not self.kinds:
            raise ValueError(f"kinds must be among {', '.join(KINDS)}, got {', '.join(self.kinds) or 'none'}")

    @property
    def warmup(self) -> int:
        """Warm-up rounds sent: :attr:`warmup_rounds`, but never fewer than three times the distinct
        prompts, so that every distinct prompt (and every shared system prompt) is sent three times
        before measuring: kvlb's token-id memo notes a new prompt's first run of ids at its first
        sight, keeps that run at its second, and the prompt's other runs at its third."""
        return max(self.warmup_rounds, 3 * self.prompts)

    @property
    def spaced_start(self) -> int:
        """Index of the first body of the spaced phase (after the sequential phase)."""
        return self.warmup + self.sequential_rounds

    @property
    def concurrent_warmup_start(self) -> int:
        """Index of the first body of the concurrent phase's warm-up burst (after the spaced phase)."""
        return self.spaced_start + self.spaced_rounds

    def burst_start(self, round_index: int) -> int:
        """Index of the first body of concurrent round ``round_index``: every phase and round takes
        bodies no earlier one took, so a kind of unique bodies never resends one."""
        return self.concurrent_warmup_start + self.concurrency + round_index * self.burst_requests

    @property
    def requests_per_path(self) -> int:
        """Requests each path gets of one kind: the bodies a kind of unique bodies needs."""
        return self.burst_start(self.concurrent_rounds)


_POSITIVE = (
    "prompt_tokens", "prompts", "sequential_rounds", "sequential_block", "spaced_rounds", "concurrency",
    "concurrent_rounds", "burst_requests", "replicas", "max_tokens",
)  # fmt: skip


SMOKE = OverheadShape(
    prompt_tokens=512,
    prompts=2,
    sequential_rounds=4,
    sequential_block=2,
    spaced_rounds=2,
    spaced_gap_ms=5.0,
    warmup_rounds=1,
    concurrency=4,
    concurrent_rounds=1,
    burst_requests=8,
    replicas=2,
)
"""A seconds-long run for tests and CI (figures meaningless)."""


@dataclass(frozen=True, slots=True)
class Prompts:
    """The request bodies of every kind, and what tokenizing the chat prompts cost here."""

    chat: tuple[bytes, ...]
    tokens: tuple[bytes, ...]
    token_counts: tuple[int, ...]
    tokenize_s: tuple[float, ...]
    """Tokenizing one ``chat`` prompt with the segment cache off: every sample a full encode."""
    chat_cold: tuple[bytes, ...] = ()
    """Chat bodies whose system prompt and user message are unique per request: no cache hit."""
    chat_shared: tuple[bytes, ...] = ()
    """Chat bodies with one of the ``chat`` system prompts and a user message unique per request."""
    tokens_shared: tuple[bytes, ...] = ()
    """The ``chat_shared`` bodies as token ids (``prompt``), one per request, none repeated."""
    tokenize_shared_s: tuple[float, ...] = ()
    """Tokenizing one ``chat_shared`` prompt (a new user message each sample) once the system prompts
    are cached, the way kvlb's request path does on its event loop: ``encode_chat_if_cached`` with
    the path's budget of ``INLINE_TOKENIZE_CHARS`` new characters (and ``encode_chat`` after it when
    that returns ``None``, as the path then does in a thread)."""
    tokenize_shared_fallbacks: int = 0
    """Samples of :attr:`tokenize_shared_s` that ``encode_chat_if_cached`` refused (encoded whole)."""
    tokenize_cpu_s: tuple[float, ...] = ()
    """The process CPU (all threads) of each ``tokenize_s`` sample: the tokenizer's own CPU per new
    chat, which kvlb's CPU per ``chat_cold`` request is set against."""

    def bodies(self, kind: str) -> tuple[str, tuple[bytes, ...]]:
        """(path, bodies) of ``kind``."""
        if kind in ("tokens", "grpc_tokens"):
            return "/v1/completions", self.tokens
        if kind == "tokens_shared":
            return "/v1/completions", self.tokens_shared
        by_kind = {"chat": self.chat, "chat_cold": self.chat_cold, "chat_shared": self.chat_shared}
        return "/v1/chat/completions", by_kind[kind]


def build_prompts(shape: OverheadShape, cold: Tokenizer, warm: Tokenizer | None = None) -> Prompts:
    """Distinct chat prompts of about ``prompt_tokens`` tokens, the same as token ids, and the
    bodies of the unique kinds. Blocking.

    ``cold`` tokenizes and is timed: give it one whose segment cache is off, so that every timed
    sample is a full encode (through a cache, repeats would time hits). ``warm`` (cache on) times the
    ``chat_shared`` prompts once their system prompts are cached, then tokenizes them for the
    ``tokens_shared`` bodies (its cache keeps that quick); without it neither is built.
    """
    rng = random.Random(shape.seed)
    system_words = words_for_tokens(max(1, shape.prompt_tokens - QUESTION_TOKENS), TOKENS_PER_WORD)
    question_words = words_for_tokens(QUESTION_TOKENS, TOKENS_PER_WORD)
    chat, tokens, counts, timings, cpu = [], [], [], [], []
    for _ in range(shape.prompts):
        messages = [
            {"role": "system", "content": random_text(rng, system_words)},
            {"role": "user", "content": random_text(rng, question_words)},
        ]
        ids: list[int] = []
        for _ in range(3):
            started, cpu_started = time.perf_counter(), time.process_time()
            ids = cold.encode_chat(messages)
            timings.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
        common = {"model": MODEL, "max_tokens": shape.max_tokens, "stream": True}
        chat.append(json.dumps({**common, "messages": messages}).encode())
        tokens.append(json.dumps({**common, "prompt": ids}).encode())
        counts.append(len(ids))
    shared = shared_bodies(shape, chat, random.Random(shape.seed + 1), question_words)
    timed: tuple[tuple[float, ...], int] = ((), 0)
    tokens_shared: tuple[bytes, ...] = ()
    if warm is not None:
        timed = time_shared(shape, shared, warm)  # first: every timed user message is new to ``warm``
        tokens_shared = token_id_bodies(shared, warm)
    return Prompts(
        tuple(chat),
        tuple(tokens),
        tuple(counts),
        tuple(timings),
        chat_cold=cold_bodies(shape, chat),
        chat_shared=shared,
        tokens_shared=tokens_shared,
        tokenize_shared_s=timed[0],
        tokenize_shared_fallbacks=timed[1],
        tokenize_cpu_s=tuple(cpu),
    )


def cold_bodies(shape: OverheadShape, chat: list[bytes]) -> tuple[bytes, ...]:
    """One body per request sent (no repeats): the system prompt and the user message each start
    with a unique nonce, so every request is tokenized from scratch, as for traffic that shares no
    prompt text."""
    out = []
    for index in range(shape.requests_per_path):
        body = json.loads(chat[index % len(chat)])
        for message in body["messages"]:
            message["content"] = f"Request {index} of this run. {message['content']}"
        out.append(json.dumps(body).encode())
    return tuple(out)


def shared_bodies(
    shape: OverheadShape, chat: list[bytes], rng: random.Random, question_words: int
) -> tuple[bytes, ...]:
    """One body per request sent: the system prompt of ``chat[index % prompts]`` (so the warm-up sends
    each three times) and a fresh user message: what chat traffic with shared system prompts looks like."""
    out = []
    for index in range(shape.requests_per_path):
        body = json.loads(chat[index % len(chat)])
        body["messages"][1]["content"] = f"Question {index}: {random_text(rng, question_words)}"
        out.append(json.dumps(body).encode())
    return tuple(out)


def token_id_bodies(chat_bodies: tuple[bytes, ...], tokenizer: Tokenizer) -> tuple[bytes, ...]:
    """Each chat body with its messages replaced by their token ids as the ``prompt``: the same
    request as a client that tokenizes for itself sends it (a shared system prompt's ids, then the
    user message's)."""
    out = []
    for raw in chat_bodies:
        body = json.loads(raw)
        ids = tokenizer.encode_chat(body.pop("messages"))
        out.append(json.dumps({**body, "prompt": ids}).encode())
    return tuple(out)


def time_shared(
    shape: OverheadShape, bodies: tuple[bytes, ...], warm: Tokenizer
) -> tuple[tuple[float, ...], int]:
    """Seconds to tokenize each of ``3 × prompts`` ``chat_shared`` prompts on kvlb's request path
    (``encode_chat_if_cached`` with the path's ``INLINE_TOKENIZE_CHARS``, each user message new),
    after the first ``prompts`` (which put every system prompt in ``warm``'s cache) were tokenized
    untimed; and how many samples it refused (then timed with the whole ``encode_chat`` added)."""
    timings = []
    fallbacks = 0
    for index in range(min(len(bodies), 4 * shape.prompts)):
        parsed = parse_request(bodies[index], "chat")
        assert parsed.messages is not None
        started = time.perf_counter()
        ids = warm.encode_chat_if_cached(parsed.messages, parsed.chat_kwargs, INLINE_TOKENIZE_CHARS)
        if ids is None:
            warm.encode_chat(parsed.messages, **parsed.chat_kwargs)
        if index >= shape.prompts:
            timings.append(time.perf_counter() - started)
            fallbacks += ids is None
    return tuple(timings), fallbacks
