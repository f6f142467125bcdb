"""Retrieval-augmented requests over a corpus reused with Zipf popularity (pure).

A request is a shared system message, then k distinct retrieved documents in retrieval order, then a
fresh question, the documents and question in one user message. Documents are drawn with
probability ∝ 1 / (rank + 1)^s, and document id ``d`` has popularity rank ``d`` (document 0 is the
most popular). Reuse is therefore per document, but a cache only reuses a *prefix*: two requests share
the system message, plus the documents up to the first one where their retrieval lists differ.
Larger ``zipf_s`` concentrates traffic on a few documents (more sharing); 0 is uniform.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from loadtests.workloads.base import (
    ChatMessage,
    PromptFormat,
    RequestSpec,
    check_format,
    check_positive,
    make_tags,
)
from loadtests.workloads.text import chat_spec, random_text, tokens_per_word, words_for_tokens

_MAX_DRAWS_PER_DOC = 64


def zipf_cum_weights(count: int, s: float) -> list[float]:
    """Cumulative weights of ranks ``0..count-1`` with weight ``1 / (rank + 1)^s``."""
    return list(itertools.accumulate(1.0 / (rank + 1) ** s for rank in range(count)))


def draw_distinct(rng: random.Random, cum_weights: Sequence[float], k: int) -> list[int]:
    """``k`` distinct ranks by weight, in draw order (retrieval order).

    Repeats are redrawn; after ``64 · k`` draws (only for extreme skews) the most popular ranks not
    yet drawn fill the rest, so the call always ends.
    """
    if not 0 < k <= len(cum_weights):
        raise ValueError(f"k must be in 1..{len(cum_weights)}, got {k}")
    total = cum_weights[-1]
    picked: list[int] = []
    seen: set[int] = set()
    for _ in range(_MAX_DRAWS_PER_DOC * k):
        rank = min(bisect.bisect_right(cum_weights, rng.random() * total), len(cum_weights) - 1)
        if rank not in seen:
            seen.add(rank)
            picked.append(rank)
            if len(picked) == k:
                return picked
    picked.extend(itertools.islice((r for r in range(len(cum_weights)) if r not in seen), k - len(picked)))
    return picked


@dataclass(frozen=True, slots=True)
class RagWorkload:
    """System + k Zipf-popular documents + question, over a fixed corpus."""

    name: ClassVar[str] = "rag"

    documents: int = 200
    """Corpus size."""

    doc_tokens: int = 800
    """Tokens per document (approximate for ``chat``)."""

    docs_per_request: int = 4
    """Documents retrieved per request (k), distinct."""

    zipf_s: float = 1.1
    """Zipf exponent of document popularity (0: uniform; larger: more skew)."""

    system_tokens: int = 200
    """System message shared by every request, in tokens."""

    question_tokens: int = 60
    """Fresh question per request, in tokens."""

    num_requests: int = 1000
    """Requests generated; the stream ends after this many."""

    max_tokens: int = 150
    """Completion tokens asked for per request."""

    prompt_format: PromptFormat = "chat"
    """``chat`` (messages, text) or ``tokens`` (toy token ids to ``/v1/completions``)."""

    def __post_init__(self) -> None:
        check_positive(
            self.name,
            documents=self.documents,
            doc_tokens=self.doc_tokens,
            docs_per_request=self.docs_per_request,
            system_tokens=self.system_tokens,
            question_tokens=self.question_tokens,
            num_requests=self.num_requests,
            max_tokens=self.max_tokens,
        )
        if self.docs_per_request > self.documents:
            raise ValueError(f"{self.name}: docs_per_request ({self.docs_per_request}) > documents")
        if self.zipf_s < 0:
            raise ValueError(f"{self.name}: zipf_s must be >= 0, got {self.zipf_s}")
        check_format(self.name, self.prompt_format)

    def generate(self, rng: random.Random) -> Iterator[RequestSpec]:
        per_word = tokens_per_word(self.prompt_format)
        system = ChatMessage("system", random_text(rng, words_for_tokens(self.system_tokens, per_word)))
        doc_words = words_for_tokens(self.doc_tokens, per_word)
        corpus = [f"Document {d}: {random_text(rng, doc_words)}" for d in range(self.documents)]
        question_words = words_for_tokens(self.question_tokens, per_word)
        cum_weights = zipf_cum_weights(self.documents, self.zipf_s)
        for n in range(self.num_requests):
            docs = draw_distinct(rng, cum_weights, self.docs_per_request)
            question = random_text(rng, question_words)
            user = "\n\n".join([*(corpus[d] for d in docs), f"Question: {question}"])
            yield chat_spec(
                f"{self.name}-{n}",
                (system, ChatMessage("user", user)),
                prompt_format=self.prompt_format,
                max_tokens=self.max_tokens,
                tags=make_tags(docs=",".join(map(str, docs)), first_doc=docs[0]),
            )
