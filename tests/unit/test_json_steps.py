"""JSON decoded and encoded in steps (:func:`balancer.strict_json.loads_steps`, :func:`dumps_steps`;
h-workersmerge): the same value and the same text as :func:`~balancer.strict_json.loads` and
:func:`~balancer.strict_json.dumps` in one go, the same ``ValueError`` for a bad document, and a
large document's arrays really cut into steps of about ``step_chars`` characters each."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from step_runs import run_steps

from balancer import strict_json

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
DOCUMENTS = (
    st.dictionaries(st.text(max_size=8), VALUES | st.lists(VALUES, max_size=12), max_size=6)
    | st.lists(VALUES, max_size=12)
    | VALUES
)


def spaced(text: str) -> str:
    """``text`` with JSON whitespace around every structural character outside strings."""
    out: list[str] = []
    in_string = escaped = False
    for char in text:
        out.append(char)
        if in_string:
            in_string = not (char == '"' and not escaped)
            escaped = char == "\\" and not escaped
        elif char == '"':
            in_string = True
        elif char in "{}[],:":
            out.append(" \n\t\r ")
    return " \n" + "".join(out) + "\r\n "


@settings(max_examples=300, deadline=None)
@given(DOCUMENTS, st.integers(min_value=1, max_value=64))
def test_steps_decode_and_encode_as_one_go(value: Any, step_chars: int) -> None:
    text = strict_json.dumps(value)
    assert run_steps(strict_json.dumps_steps(value, step_chars))[0] == text
    for form in (text, text.encode("utf-8"), spaced(text), spaced(text).encode("utf-8")):
        assert run_steps(strict_json.loads_steps(form, step_chars))[0] == strict_json.loads(form)


BAD = [
    "",
    " ",
    "{",
    "[",
    '{"a": [1, 2}',
    '{"a": [1, 2,]}',
    '{"a" [1]}',
    '{"a": 1,}',
    "{a: 1}",
    '{"a": [1] "b": 2}',
    "[1 2]",
    "[1,]",
    '{"a": [1]} x',
    "[1] [2]",
    '{"a": [NaN]}',
    '{"a": Infinity}',
    "[-Infinity]",
    '{"a": ["\x01"]}',
    "\ufeff[1]",
    '{"a": 1} }',
]


@pytest.mark.parametrize("text", BAD)
def test_a_bad_document_is_refused_as_in_one_go(text: str) -> None:
    with pytest.raises(ValueError) as one_go:
        strict_json.loads(text)
    with pytest.raises(ValueError) as stepped:
        run_steps(strict_json.loads_steps(text, 1))
    assert type(stepped.value) is type(one_go.value)


def test_duplicate_keys_and_non_finite_floats_as_in_one_go() -> None:
    text = '{"a": [1], "b": 2, "a": [3, 4]}'
    assert run_steps(strict_json.loads_steps(text, 1))[0] == json.loads(text) == {"a": [3, 4], "b": 2}
    value = {"x": [1.5, math.inf, {"y": math.nan}], "z": -math.inf}
    assert run_steps(strict_json.dumps_steps(value, 1))[0] == strict_json.dumps(value)


def test_a_large_document_is_cut_into_steps_of_about_step_chars() -> None:
    views = [{"id": f"r{i:03d}", "health": {"probe_ok": True, "age_s": i / 7}} for i in range(200)]
    value = {"replicas": views, "kept_drains": views[:50], "kept_drains_total": 50, "workers": [0, 1]}
    text = strict_json.dumps(value)
    decoded, pauses = run_steps(strict_json.loads_steps(text, 1024))
    assert decoded == value
    assert len(text) // 1024 - 2 <= pauses <= len(text) // 1024 + 2, (pauses, len(text))
    encoded, pauses = run_steps(strict_json.dumps_steps(value, 1024))
    assert encoded == text
    assert len(text) // 1024 - 2 <= pauses <= len(text) // 1024 + 2, (pauses, len(text))
    assert run_steps(strict_json.loads_steps(text))[1] >= len(text) // strict_json.STEP_CHARS - 1
