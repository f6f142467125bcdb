"""The control: prompts that share nothing (pure).

Every request is one user message of fresh random words and no system message, so two prompts share
only the chat template's opening tokens (BOS and the user marker) and, by chance, a word or two. A
cache-aware router can gain nothing here; this workload measures its overhead and load spreading.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from loadtests.workloads.base import (
    ChatMessage,
    PromptFormat,
    RequestSpec,
    check_format,
    check_positive,
)
from loadtests.workloads.text import chat_spec, random_text, tokens_per_word, words_for_tokens


@dataclass(frozen=True, slots=True)
class UniqueWorkload:
    """``num_requests`` unrelated prompts of ``prompt_tokens`` each."""

    name: ClassVar[str] = "unique"

    num_requests: int = 1000
    """Requests generated; the stream ends after this many."""

    prompt_tokens: int = 2000
    """Prompt size, in tokens (approximate for ``chat``)."""

    max_tokens: int = 100
    """Completion tokens asked for per request."""

    prompt_format: PromptFormat = "chat"
    """``chat`` (messages, text) or ``tokens`` (toy token ids to ``/v1/completions``)."""

    def __post_init__(self) -> None:
        check_positive(
            self.name,
            num_requests=self.num_requests,
            prompt_tokens=self.prompt_tokens,
            max_tokens=self.max_tokens,
        )
        check_format(self.name, self.prompt_format)

    def generate(self, rng: random.Random) -> Iterator[RequestSpec]:
        words = words_for_tokens(self.prompt_tokens, tokens_per_word(self.prompt_format))
        for n in range(self.num_requests):
            yield chat_spec(
                f"{self.name}-{n}",
                (ChatMessage("user", random_text(rng, words)),),
                prompt_format=self.prompt_format,
                max_tokens=self.max_tokens,
            )
