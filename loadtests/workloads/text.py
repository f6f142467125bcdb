"""Synthetic prompt text and its toy token-id rendering (pure).

Text workloads write prompts from a fixed list of common English words, so a real tokenizer sees
ordinary words and not random bytes. Sizes are asked for in tokens and turned into a word count with
:data:`TOKENS_PER_WORD`, so token counts of text prompts are approximate (a few percent either way,
depending on the tokenizer and the words drawn). The figure was measured on the DeepSeek-V3 tokenizer
(the one the emulator and kvlb use) over 20,000 words drawn by :func:`random_text`::

    .venv/bin/python -m loadtests.workloads.text /path/to/tokenizer.json

The same text can be rendered as token ids without any tokenizer (:func:`render_token_ids`): each
whitespace-separated word becomes one id from a stable hash, and each message opens with a role id.
That rendering is exact (one word, one token), cheap, and keeps the prefix structure of the chat:
the ids of a chat are a prefix of the ids of any chat that extends it.
"""

from __future__ import annotations

import random
import sys
import zlib
from collections.abc import Iterable, Sequence

from loadtests.workloads.base import ChatMessage, PromptFormat, RequestSpec

TOKENS_PER_WORD = 1.09
"""DeepSeek-V3 tokens per word of :func:`random_text` output: 1.0869 measured (module docstring).

Words are one token each but for one; the full stops add the rest."""

TOKEN_ID_LOW = 1000
"""Lowest id of the toy rendering; ids below it (special and byte tokens) are never produced."""

TOKEN_ID_HIGH = 100_000
"""One past the highest id of the toy rendering; inside DeepSeek-V3's vocabulary of 129,280."""

ROLE_TOKEN_IDS = {"system": 1001, "user": 1002, "assistant": 1003, "tool": 1004}
"""Id that opens each message in the toy rendering; the assistant's id is also the generation prompt."""

_WORD_ID_LOW = 1100
_SENTENCE_WORDS = 12

_WORD_TEXT = """
    the of and to in is that for it as was with be by on not he this are or his from at which but have
    an had they you were their one all we can her has there been if more when will would who so no she
    other its may these about than time some could them only into then two any first new also such
    after most made over many where what used should each well between those way year work system
    three under must both through high part world long during place state being people house another
    same much water since number under small great life general public found large order because
    however city group case point service often form set without before right local development
    information following program days different important family country second power within give
    business process based market three company several service level report back field early data
    change result value research control given social major view level line value period model study
    design area history national little course early support human rate likely build table window
    river garden bridge planet silver engine signal market harbor forest winter summer autumn spring
    morning evening letter number answer question reason method theory memory energy motion vector
    matrix network server client buffer packet record column schema index cache block token layer
    kernel thread socket stream queue batch shard replica cluster region budget ledger invoice
    contract policy review release version feature module package library source target metric
    sample figure chapter section paper article author editor reader student teacher doctor patient
    nurse driver pilot farmer artist singer player member leader worker manager officer partner
    """

WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_TEXT.split()))
"""The word list of every text prompt (lowercase, common, mostly one token each)."""


def words_for_tokens(tokens: int, tokens_per_word: float) -> int:
    """Words needed for about ``tokens`` tokens; at least one word for any positive size."""
    if tokens <= 0:
        return 0
    return max(1, round(tokens / tokens_per_word))


def random_text(rng: random.Random, words: int) -> str:
    """``words`` words from :data:`WORDS`, with a full stop every twelve words."""
    picked = rng.choices(WORDS, k=words)
    for end in range(_SENTENCE_WORDS - 1, words, _SENTENCE_WORDS):
        picked[end] += "."
    return " ".join(picked)


def word_token_ids(text: str) -> list[int]:
    """One toy id per whitespace-separated word, from CRC-32 (stable across processes and runs)."""
    span = TOKEN_ID_HIGH - _WORD_ID_LOW
    return [_WORD_ID_LOW + zlib.crc32(word.encode()) % span for word in text.split()]


def render_token_ids(messages: Sequence[ChatMessage]) -> tuple[int, ...]:
    """Toy token ids of a chat: per message its role id then its words; the assistant id closes it.

    A chat extended by an assistant reply and a new user message renders to ids that start with the
    shorter chat's ids, as a real template does (the closing assistant id opens the reply).
    """
    ids: list[int] = []
    for message in messages:
        ids.append(ROLE_TOKEN_IDS[message.role])
        ids.extend(word_token_ids(message.content))
    ids.append(ROLE_TOKEN_IDS["assistant"])
    return tuple(ids)


def tokens_per_word(prompt_format: PromptFormat) -> float:
    """Tokens per word: exactly 1 in the toy id rendering, :data:`TOKENS_PER_WORD` as text."""
    return 1.0 if prompt_format == "tokens" else TOKENS_PER_WORD


def chat_spec(
    request_id: str,
    messages: Sequence[ChatMessage],
    *,
    prompt_format: PromptFormat,
    max_tokens: int,
    session_id: str | None = None,
    tags: tuple[tuple[str, str], ...] = (),
) -> RequestSpec:
    """A spec of ``messages`` as chat (``chat``) or as their toy token ids (``tokens``)."""
    if prompt_format == "tokens":
        return RequestSpec(
            request_id,
            max_tokens,
            prompt_token_ids=render_token_ids(messages),
            session_id=session_id,
            tags=tags,
        )
    return RequestSpec(request_id, max_tokens, messages=tuple(messages), session_id=session_id, tags=tags)


def _measure(tokenizer_json: str, samples: Iterable[int] = range(20)) -> float:
    """DeepSeek-style tokens per word of :func:`random_text` (for the docstring figure)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_json)
    words = tokens = 0
    for seed in samples:
        text = random_text(random.Random(seed), 1000)
        words += 1000
        tokens += len(tokenizer.encode(text, add_special_tokens=False).ids)
    return tokens / words


if __name__ == "__main__":
    print(f"{_measure(sys.argv[1]):.4f} tokens per word")
