"""Multi-turn chat sessions whose history grows turn by turn (pure).

Turn ``n + 1`` of a session sends the prompt of turn ``n`` plus an assistant reply plus a new user
message, so each prompt is an exact prefix of the next. The assistant reply is fake: deterministic
words from the workload's rng, not the server's output, because an open-loop run does not wait for
outputs (a real engine's cache then holds the real reply, not ours: only the prompt part is reused).
All sessions share one system message when ``system_tokens`` > 0.

Requests come in rounds: turn 0 of every session (in a shuffled order), then turn 1, and so on, so
a closed-loop run keeps many sessions busy at once. :func:`grow_conversations` is shared with the
agent workload.
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
    make_tags,
)
from loadtests.workloads.text import chat_spec, random_text, tokens_per_word, words_for_tokens


@dataclass(frozen=True, slots=True)
class ConversationShape:
    """Sizes of a growing conversation, in tokens; converted to words by the prompt format."""

    system_tokens: int
    """Shared system message (0: none)."""
    opener_tokens: int
    """First user message of a session."""
    reply_tokens: int
    """Each fake assistant reply appended before the next turn."""
    followup_tokens: int
    """Each later user message (a question, or a tool output for agents)."""
    followup_prefix: str = ""
    """Text that opens every later user message (e.g. ``"Tool output:"``)."""
    max_context_tokens: int | None = None
    """A session ends before a turn that would take its prompt past this many tokens; ``None``: no cap."""


def grow_conversations(
    rng: random.Random,
    shape: ConversationShape,
    *,
    workload: str,
    sessions: int,
    turns: int,
    prompt_format: PromptFormat,
    max_tokens: int,
) -> Iterator[RequestSpec]:
    """``sessions`` conversations of up to ``turns`` turns each, in shuffled rounds (module docs)."""
    per_word = tokens_per_word(prompt_format)
    reply_words = words_for_tokens(shape.reply_tokens, per_word)
    followup_words = words_for_tokens(shape.followup_tokens, per_word)
    turn_growth_tokens = shape.reply_tokens + shape.followup_tokens
    system = (
        ChatMessage("system", random_text(rng, words_for_tokens(shape.system_tokens, per_word)))
        if shape.system_tokens > 0
        else None
    )
    histories: list[list[ChatMessage]] = []
    for _ in range(sessions):
        opener = ChatMessage("user", random_text(rng, words_for_tokens(shape.opener_tokens, per_word)))
        histories.append([system, opener] if system is not None else [opener])
    context_tokens = [shape.system_tokens + shape.opener_tokens] * sessions
    prefix = f"{shape.followup_prefix} " if shape.followup_prefix else ""
    count = 0
    for turn in range(turns):
        order = list(range(sessions))
        rng.shuffle(order)
        for session in order:
            if turn > 0:
                grown_tokens = context_tokens[session] + turn_growth_tokens
                if shape.max_context_tokens is not None and grown_tokens > shape.max_context_tokens:
                    continue
                context_tokens[session] = grown_tokens
                histories[session].append(ChatMessage("assistant", random_text(rng, reply_words)))
                histories[session].append(ChatMessage("user", prefix + random_text(rng, followup_words)))
            yield chat_spec(
                f"{workload}-{count}",
                histories[session],
                prompt_format=prompt_format,
                max_tokens=max_tokens,
                session_id=f"{workload}-s{session}",
                tags=make_tags(session=session, turn=turn),
            )
            count += 1


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """Multi-turn chat: ``sessions × turns`` requests, each prompt extending the session's last one."""

    name: ClassVar[str] = "chat"

    sessions: int = 16
    """Concurrent conversations."""

    turns: int = 8
    """Requests per conversation."""

    system_tokens: int = 300
    """System message shared by every session, in tokens (0: none)."""

    user_tokens: int = 150
    """Each user message, in tokens (approximate for ``chat``)."""

    reply_tokens: int = 150
    """Each fake assistant reply put into the history, in tokens."""

    max_tokens: int = 150
    """Completion tokens asked for per request."""

    prompt_format: PromptFormat = "chat"
    """``chat`` (messages, text) or ``tokens`` (toy token ids to ``/v1/completions``)."""

    def __post_init__(self) -> None:
        check_positive(
            self.name,
            sessions=self.sessions,
            turns=self.turns,
            user_tokens=self.user_tokens,
            reply_tokens=self.reply_tokens,
            max_tokens=self.max_tokens,
        )
        if self.system_tokens < 0:
            raise ValueError(f"{self.name}: system_tokens must be >= 0, got {self.system_tokens}")
        check_format(self.name, self.prompt_format)

    def generate(self, rng: random.Random) -> Iterator[RequestSpec]:
        shape = ConversationShape(
            system_tokens=self.system_tokens,
            opener_tokens=self.user_tokens,
            reply_tokens=self.reply_tokens,
            followup_tokens=self.user_tokens,
        )
        return grow_conversations(
            rng,
            shape,
            workload=self.name,
            sessions=self.sessions,
            turns=self.turns,
            prompt_format=self.prompt_format,
            max_tokens=self.max_tokens,
        )
