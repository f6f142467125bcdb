"""``ChatTemplate.render_chunks`` renders as ``Template.generate`` does: the same chunks, the same
context (globals, special tokens, template kwargs, in that order of precedence), the same errors.

The request path renders through ``render_prepared`` (the template's globals read once at load);
the reference here is Jinja's own ``generate`` on the same compiled template.
"""

from __future__ import annotations

import json
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest

from balancer.tokenizer.chat_template import CHATML_TEMPLATE, ChatTemplate

FIXTURES = Path(__file__).parent.parent / "fixtures" / "tokenizer"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
NOON = datetime(2026, 11, 28, 12, 0)

GLOBALS_TEMPLATE = """{% set ns = namespace(n=0, system='') %}
{% for m in messages %}
{% set ns.n = ns.n + 1 %}
{% if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif %}
{% generation %}[{{ m.role }}:{{ m.content }}]{% endgeneration %}
{% endfor %}
{% set sep = joiner('|') %}
{% for i in range(ns.n) %}{{ sep() }}{{ i }}{% endfor %}
{{ cycler('a', 'b').next() }}{{ bos_token }}{{ eos_token }}{{ strftime_now('%Y-%m-%d') }}
{{ ns.system }}{{ extra | default('-') }}{{ tools | tojson }}{{ add_generation_prompt }}
{% if add_generation_prompt %}<gen>{% endif %}"""
"""Uses every global the sandbox adds (``range``, ``namespace``, ``joiner``, ``cycler``,
``strftime_now``), the special tokens, a template kwarg, ``tools`` and ``add_generation_prompt``."""

SHADOWING_TEMPLATE = "{{ bos_token }}|{{ joiner is string }}|{{ lipsum is number }}|{{ messages | length }}"
"""Prints names a template kwarg may shadow: a special token and two globals."""

MESSAGES: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "s" * 300},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "again <｜User｜> 中文"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "a<b & 'c' ü"}}]


def _deepseek_source() -> str:
    config = (FIXTURES / "deepseek-v3-chat" / "tokenizer_config.json").read_text("utf-8")
    source = json.loads(config)["chat_template"]
    assert isinstance(source, str)
    return source


def _reference(
    chat: ChatTemplate,
    template: jinja2.Template,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
) -> list[str]:
    """What ``render_chunks`` returned before it rendered through ``render_prepared``."""
    context = {**SPECIAL, **kwargs}
    context.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
    return list(template.generate(context))


def _compiled(chat: ChatTemplate, name: str) -> jinja2.Template:
    templates: dict[str, jinja2.Template] = chat._templates
    return templates[name]


@pytest.mark.parametrize("source", [GLOBALS_TEMPLATE, CHATML_TEMPLATE, "deepseek"])
@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("kwargs", [{}, {"extra": "X"}, {"extra": ["a", 1]}])
def test_chunks_are_the_ones_generate_yields(
    source: str, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: dict[str, Any]
) -> None:
    text = _deepseek_source() if source == "deepseek" else source
    chat = ChatTemplate(text, SPECIAL, clock=lambda: NOON)
    for tools in (None, TOOLS):
        got = chat.render_chunks(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, template_kwargs=kwargs
        )
        want = _reference(chat, _compiled(chat, "default"), messages, tools, add_generation_prompt, kwargs)
        assert got == want
        assert all(type(chunk) is str for chunk in got)
    if source == GLOBALS_TEMPLATE:  # the globals were used, not left undefined
        rendered = "".join(want)
        assert "|".join(map(str, range(len(messages)))) + "a<s></s>2026-11-28" in rendered


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, "<s>|False|False|1"),
        ({"bos_token": "B"}, "B|False|False|1"),  # a kwarg over a special token
        ({"joiner": "J", "lipsum": 3}, "<s>|True|True|1"),  # kwargs over the sandbox's globals
    ],
)
def test_template_kwargs_shadow_special_tokens_and_globals(kwargs: dict[str, Any], expected: str) -> None:
    chat = ChatTemplate(SHADOWING_TEMPLATE, SPECIAL)
    messages = [{"role": "user", "content": "x"}]
    got = chat.render_chunks(messages, add_generation_prompt=True, tools=None, template_kwargs=kwargs)
    want = _reference(chat, _compiled(chat, "default"), messages, None, True, kwargs)
    assert got == want
    assert "".join(got) == expected


def test_tool_use_template_is_chosen_with_tools_and_gets_its_own_globals() -> None:
    chat = ChatTemplate(
        [
            {"name": "default", "template": "default:{{ messages | length }}"},
            {
                "name": "tool_use",
                "template": "{% for i in range(2) %}{{ i }}{% endfor %}{{ tools | tojson }}",
            },
        ],
        SPECIAL,
    )
    messages = [{"role": "user", "content": "x"}]
    plain = chat.render_chunks(messages, add_generation_prompt=True, tools=None, template_kwargs={})
    assert "".join(plain) == "default:1"
    got = chat.render_chunks(messages, add_generation_prompt=True, tools=TOOLS, template_kwargs={})
    assert got == _reference(chat, _compiled(chat, "tool_use"), messages, TOOLS, True, {})
    assert "".join(got).startswith("01[")


def _failure(render: Any) -> BaseException:
    with pytest.raises(Exception) as caught:  # any error: compared with the reference's
        render()
    return caught.value


@pytest.mark.parametrize(
    ("source", "messages"),
    [
        (
            "ok\n{% if messages[0]['role'] != 'user' %}\n"
            "{{ raise_exception('first must be user') }}\n{% endif %}",
            [{"role": "system", "content": "x"}],
        ),
        ("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "text"}]),
        ("{{ ''.__class__.__mro__ }}", [{"role": "user", "content": "x"}]),
        ("{{ messages.append(1) }}", [{"role": "user", "content": "x"}]),
    ],
)
def test_errors_are_the_ones_generate_raises(source: str, messages: list[dict[str, Any]]) -> None:
    chat = ChatTemplate(source, SPECIAL)
    got = _failure(
        lambda: chat.render_chunks(messages, add_generation_prompt=True, tools=None, template_kwargs={})
    )
    want = _failure(lambda: _reference(chat, _compiled(chat, "default"), messages, None, True, {}))
    assert type(got) is type(want)
    assert str(got) == str(want)
    # Jinja rewrites the traceback to point at the template's own lines, for both
    template_lines = [(frame.filename, frame.lineno) for frame in traceback.extract_tb(got.__traceback__)]
    wanted_lines = [(frame.filename, frame.lineno) for frame in traceback.extract_tb(want.__traceback__)]
    assert [line for line in template_lines if line[0] == "<template>"] == [
        line for line in wanted_lines if line[0] == "<template>"
    ]
