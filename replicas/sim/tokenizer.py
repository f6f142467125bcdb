"""The tokenizer seam of an emulated replica: prompt or chat → token ids (pure).

The emulator tokenizes nothing itself and imports no tokenizer of the balancer's. Whoever starts
replicas hands them a :class:`PromptTokenizer`, usually obtained from a :class:`TokenizerLoader` that
reads a ``--tokenizer`` name. ``kvlb emulate`` (:mod:`loadtests.emulate`) binds the balancer's
tokenizers, so replica and balancer compute the same ids. Without such a loader,
:data:`TOKEN_IDS_ONLY` serves ``--tokenizer none``: prompts given as token ids, no chat.

**Encode failures.** ``encode_prompt`` and ``encode_chat`` raise ``ValueError`` (any subclass: the
balancer's ``TokenizeError`` is one, :class:`PromptError` is the emulator's own) for a prompt that
cannot be turned into token ids; the replica answers HTTP 400 with the exception's message.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

NO_TOKENIZER = "none"
"""``--tokenizer none``: token-id prompts only (needs no loader)."""
DEFAULT_TOKENIZER = "default"
"""``--tokenizer default``: the loader's default tokenizer (``kvlb emulate``: the balancer's, DeepSeek-V3
with kvlb's chat template)."""

MAX_PROMPT_TOKENS = 1_048_576
"""Most token ids one prompt may have (the balancer's default ``max_prompt_tokens``)."""

_NO_CHAT = "no tokenizer is configured: chat requests need a tokenizer (and its chat template)"


class PromptError(ValueError):
    """A prompt the replica cannot turn into token ids (HTTP 400)."""


class UnknownTokenizer(ValueError):
    """A ``--tokenizer`` name the loader cannot load."""


class PromptTokenizer(Protocol):
    """What an emulated replica calls to tokenize a request.

    A tokenizer may also have an ``int`` attribute ``vocab_size``: generated token ids are then drawn
    below it (else below the profile's ``vocab_size``). Encoding is CPU work and does no I/O; the
    replica runs long prompts in a thread, so an implementation must be safe to share between threads.
    """

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Ids of a ``/v1/completions`` prompt: text is tokenized, a list of ids is validated.
        Raises ``ValueError`` for a prompt it cannot take."""
        ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Ids of a chat rendered by the model's template, with the generation prompt, as the engine
        prefills them. Raises ``ValueError`` for messages it cannot take."""
        ...


class TokenizerLoader(Protocol):
    """Where the emulator's tokenizers come from: a ``--tokenizer`` name (``none``, ``default``, or a
    folder or ``tokenizer.json`` path) → a tokenizer, and the folder the replicas report for it."""

    def load(self, name: str) -> PromptTokenizer:
        """The tokenizer ``name``. Blocking (reads files): run it in a thread in async code."""
        ...

    def model_path(self, name: str) -> str:
        """What replicas report as ``model_path``: a local folder routers can load the tokenizer from
        (``""`` when there is none). Raises :class:`UnknownTokenizer` for a name it cannot load."""
        ...


def validate_token_ids(token_ids: Sequence[int]) -> list[int]:
    """A copy of ``token_ids`` after checking each is an ``int`` with ``0 <= t < 2**32`` and that there
    are at most :data:`MAX_PROMPT_TOKENS`; :class:`PromptError` names the problem otherwise."""
    if isinstance(token_ids, (str, bytes)):
        raise PromptError("token ids must be a list of integers, not a string")
    if len(token_ids) > MAX_PROMPT_TOKENS:
        raise PromptError(f"prompt has {len(token_ids)} tokens, over the limit of {MAX_PROMPT_TOKENS} tokens")
    ids = list(token_ids)
    if not ids:
        return ids
    kinds = set(map(type, ids))  # bool is rejected although it is an int
    if kinds != {int}:
        bad = sorted(k.__name__ for k in kinds - {int})
        raise PromptError(f"token ids must be integers, found {', '.join(bad)}")
    try:  # one C pass that fails on any id outside [0, 2**32)
        array("I", ids)
    except OverflowError:
        low, high = min(ids), max(ids)
        wrong = low if low < 0 else high
        raise PromptError(f"token id {wrong} is outside [0, 2**32)") from None
    return ids


class TokenIdPrompts:
    """No tokenizer: prompts must be token ids, and chats are refused (the messages and checks of the
    balancer's token-id passthrough)."""

    __slots__ = ()

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            raise PromptError(
                "no tokenizer is configured: send the prompt as a list of token ids, or configure one"
            )
        return validate_token_ids(prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        raise PromptError(_NO_CHAT)


class TokenIdsOnly:
    """The loader when none is injected: ``none`` only (:class:`TokenIdPrompts`)."""

    __slots__ = ()

    def load(self, name: str) -> PromptTokenizer:
        self._check(name)
        return TokenIdPrompts()

    def model_path(self, name: str) -> str:
        self._check(name)
        return ""

    @staticmethod
    def _check(name: str) -> None:
        if name != NO_TOKENIZER:
            raise UnknownTokenizer(
                f"--tokenizer {name}: no tokenizer loader here, only '{NO_TOKENIZER}' (token-id prompts); "
                "`kvlb emulate` loads real tokenizers"
            )


TOKEN_IDS_ONLY: TokenizerLoader = TokenIdsOnly()
"""The loader of ``python -m replicas.command``: token-id prompts only."""
