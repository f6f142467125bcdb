"""The shared-prefix chat workload of the real-engine tests (pure: deterministic from a seed).

``groups`` conversations share a long system prompt each (the prefix, several KV blocks); every
request adds its own short user question. Requests go out round by round (one per group per round),
so a group's repeats are spread over time and, with an odd number of groups, round robin over two
replicas sends a group's second request to the replica that does not hold it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

_WORD_TEXT = (
    "alpha bravo cache token block prefix router engine replica kernel vector matrix tensor "
    "cluster latency budget window stream batch queue worker memory paged radix tree node leaf "
    "parent child hash chain event replay gap seq epoch model prompt answer question policy weight "
    "score cost load balance route index table store remove clear health probe metric scrape river "
    "mountain forest garden window harbor signal lantern copper silver meadow canyon violet amber "
    "crimson orange yellow purple marble granite basalt quartz cobalt nickel"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class ChatRequest:
    group: int
    round: int
    messages: tuple[dict[str, str], ...]

    def body(self, model: str, max_tokens: int) -> dict[str, Any]:
        return {
            "model": model,
            "messages": list(self.messages),
            "max_tokens": max_tokens,
            "temperature": 0,
        }


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def shared_prefix_workload(seed: int, groups: int, rounds: int, prefix_words: int) -> list[ChatRequest]:
    """``groups * rounds`` chat requests in send order (round-major)."""
    rng = random.Random(seed)
    systems = [f"[{seed}:{g}] " + _text(rng, prefix_words) for g in range(groups)]
    requests = []
    for r in range(rounds):
        for g in range(groups):
            question = f"Question {r} of group {g}: " + _text(rng, 12) + "?"
            messages = ({"role": "system", "content": systems[g]}, {"role": "user", "content": question})
            requests.append(ChatRequest(g, r, messages))
    return requests
