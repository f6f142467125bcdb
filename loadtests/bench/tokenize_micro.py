"""In-process micro-benchmark of a ``chat_shared`` request's tokenizing: a cached system prompt, a new
user message.

Not part of ``kvlb bench``: a probe of what ``tokenize`` does on the event loop for such a chat
(``encode_chat_if_cached`` with the request path's budget of ``INLINE_TOKENIZE_CHARS`` new characters,
then ``compact_ids``, the ``array('I')`` the request keeps), without HTTP. The bodies are those of
``kvlb bench overhead``'s ``chat_shared`` kind (its 32 system prompts of about 8,128 tokens, each body
with a new 64-token user message), decoded by the request path's parser; the first run's bodies are
the bench's own, each later run gets new user messages, so that no user message is ever a cache hit.
The system prompts are cached by a warm-up. Prints, per chat, the best and the median of the runs'
process CPU time, and with ``--stages`` the same for each step of the path on the same bodies.

    PYTHONPATH=$PWD python loadtests/bench/tokenize_micro.py [--runs N] [--stages]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from balancer.api.openai import INLINE_TOKENIZE_CHARS
from balancer.api.parsing import ParsedRequest, parse_request
from balancer.index.hashing import compact_ids
from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.tokenizer import HfTokenizer, TokenizeLimits
from loadtests.bench.overhead.workload import QUESTION_TOKENS, OverheadShape, build_prompts, shared_bodies
from loadtests.workloads.text import TOKENS_PER_WORD, words_for_tokens


def chat_shared_runs(runs: int) -> list[list[ParsedRequest]]:
    """``runs + 1`` sets of parsed ``chat_shared`` bodies (the first for the warm-up), each user
    message new."""
    shape = OverheadShape(kinds=("chat_shared",))
    cold = default_tokenizer(TokenizeLimits(segment_cache_tokens=0))
    chat = list(build_prompts(shape, cold).chat)
    words = words_for_tokens(QUESTION_TOKENS, TOKENS_PER_WORD)
    return [
        [
            parse_request(body, "chat")
            for body in shared_bodies(shape, chat, random.Random(shape.seed + 1 + run), words)
        ]
        for run in range(runs + 1)
    ]


def cpu_us(runs: Sequence[Sequence[Any]], step: Callable[[Any], object]) -> tuple[float, float]:
    """Best and median over ``runs`` of the process CPU time per item of ``step``, in µs."""
    per_item = []
    for items in runs:
        started = time.process_time_ns()
        for item in items:
            step(item)
        per_item.append((time.process_time_ns() - started) / len(items) / 1000)
    return min(per_item), statistics.median(per_item)


def tokenize(tokenizer: HfTokenizer, request: ParsedRequest) -> object:
    assert request.messages is not None
    ids = tokenizer.encode_chat_if_cached(request.messages, request.chat_kwargs, INLINE_TOKENIZE_CHARS)
    assert ids is not None, "a chat_shared body must be tokenized inline"
    return compact_ids(ids)


def stages(tokenizer: HfTokenizer, runs: list[list[ParsedRequest]]) -> None:
    """Each step of ``encode_chat_if_cached`` alone, on fresh bodies (private parts of the tokenizer)."""
    splitter, cache = tokenizer._splitter, tokenizer.segment_cache
    assert splitter is not None and cache is not None
    lines: list[tuple[str, tuple[float, float]]] = []

    def render(request: ParsedRequest) -> list[str]:
        assert request.messages is not None
        return tokenizer._render_chunks(request.messages, **request.chat_kwargs)

    lines.append(("render the template (chunks)", cpu_us(runs, render)))
    chunks = [[render(request) for request in requests] for requests in runs]
    lines.append(("render, joined (the thread path's text)", cpu_us(chunks, "".join)))
    lines.append(("split the chunks", cpu_us(chunks, splitter.split_chunks)))
    joined = [["".join(c) for c in run] for run in chunks]
    lines.append(("split the joined text instead", cpu_us(joined, splitter.split)))
    pieces = [[splitter.split_chunks(c) or [] for c in run] for run in chunks]
    cached = [[max(p, key=len) for p in run] for run in pieces]  # the system prompt's piece
    lines.append(("look the system prompt's piece up (hash, compare)", cpu_us(cached, cache.peek_packed)))
    copies = [[piece[:-1] + piece[-1] for piece in run] for run in cached]  # new strings: no hash yet
    lines.append(
        (
            "the same, looked up as before (cached, then packed_ids)",
            cpu_us(copies, lambda piece: (cache.cached(piece), cache.packed_ids(piece, tokenizer._raw))),
        )
    )
    new = [
        [[p for p in found if p not in splitter.ids and cache.peek_packed(p) is None] for found in run]
        for run in pieces
    ]
    lines.append(
        ("encode the new pieces (the user message)", cpu_us(new, lambda ps: [tokenizer._raw(p) for p in ps]))
    )
    for name, (best, median) in lines:
        print(f"  {name}: best {best:.1f} us, median {median:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs of the bench's 1,032 bodies (5)")
    parser.add_argument("--stages", action="store_true", help="also time each step of the path")
    args = parser.parse_args()
    tokenizer = default_tokenizer()
    warmup, *runs = chat_shared_runs(args.runs + (2 if args.stages else 0))
    shape = OverheadShape()
    for request in warmup[: shape.prompts]:  # every system prompt into the segment cache
        assert request.messages is not None
        tokenizer.encode_chat_if_cached(request.messages, request.chat_kwargs, 10**9)
    timed, rest = runs[: args.runs], runs[args.runs :]
    best, median = cpu_us(timed, lambda request: tokenize(tokenizer, request))
    print(
        f"chat_shared tokenize + compact_ids: best {best:.1f} us, median {median:.1f} us CPU per chat "
        f"({args.runs} runs of {len(timed[0])} chats)"
    )
    if args.stages:
        stages(tokenizer, rest)


if __name__ == "__main__":
    main()
