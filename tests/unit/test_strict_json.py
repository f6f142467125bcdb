"""Strict JSON (issue #17, defect 4): kvlb writes no NaN/Infinity, reads none, and every policy
weight has a finite, documented range that every source of weights is checked against."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer import strict_json
from balancer.api.errors import ApiError
from balancer.api.parsing import (
    ParsedRequest,
    decode_object,
    lone_surrogate_at,
    may_hold_surrogate,
    parse_body,
    parse_json_object,
    parse_request,
    parse_weights_header,
    typed_completion,
    weights_from,
)
from balancer.errors import ConfigError
from balancer.index.hashing import compact_ids
from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.policy import PolicyWeights
from balancer.policy.base import WEIGHT_RANGES, RouteRequest
from balancer.policy.cost import CostPolicy
from balancer.types import Overlap, ReplicaId

DOCS = Path(__file__).resolve().parents[2] / "docs" / "policies.md"


def _refuse(literal: str) -> Any:
    raise AssertionError(f"not JSON: {literal}")


def strict_parse(text: str | bytes) -> Any:
    return json.loads(text, parse_constant=_refuse)


def test_dumps_writes_non_finite_numbers_as_null() -> None:
    value = {"cost": math.inf, "terms": [1.5, -math.inf, math.nan, {"p": math.nan}], "ok": 2.0}
    text = strict_json.dumps(value)
    assert strict_parse(text) == {"cost": None, "terms": [1.5, None, None, {"p": None}], "ok": 2.0}
    assert strict_json.dumps({"a": 1.0}, separators=(",", ":")) == '{"a":1.0}'


def test_loads_can_read_numbers_too_large_for_a_float_as_dumps_writes_them() -> None:
    text = '{"a": 1e400, "b": [-1e400, 1.5, 1e308, 10], "c": {"d": 2.5e-400}}'
    assert strict_json.loads(text)["a"] == math.inf  # json's own reading
    read = strict_json.loads(text, overflow_to_null=True)
    assert read == {"a": None, "b": [None, 1.5, 1e308, 10], "c": {"d": 0.0}}
    assert read == json.loads(strict_json.dumps(strict_json.loads(text)))  # what the written JSON says
    with pytest.raises(ValueError, match="not a JSON value"):
        strict_json.loads('{"x": NaN}', overflow_to_null=True)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.floats() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=20,
    )
)
def test_dumps_output_always_parses_strictly(value: Any) -> None:
    strict_parse(strict_json.dumps(value))


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_loads_and_the_body_parser_refuse_non_json_numbers(literal: str) -> None:
    with pytest.raises(ValueError, match="not a JSON value"):
        strict_json.loads(f'{{"x": {literal}}}')
    with pytest.raises(ApiError) as info:
        parse_json_object(f'{{"model": "m", "temperature": {literal}}}'.encode())
    assert info.value.status == 400 and literal in info.value.message
    with pytest.raises(ApiError) as info:
        parse_weights_header(f'{{"temperature": {literal}}}', PolicyWeights())
    assert info.value.status == 400


def test_the_body_parser_names_where_a_lone_surrogate_is() -> None:
    cases = {
        b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}': "'messages[0].content'",
        b'{"prompt": "a\\udfff"}': "'prompt'",
        b'{"prompt": ["a\\uDBFF"]}': "'prompt[0]'",  # upper-case escapes are JSON too
        b'{"tools": [{"x": {"\\udc00": 1}}]}': "a key of 'tools[0].x'",
        b'{"x": "\xed\xa0\x80"}': "'x'",  # CESU-8 bytes: json.loads decodes them with surrogatepass
        '{"a": ["ok", "\ud800"]}'.encode("utf-16", "surrogatepass"): "'a[1]'",
    }
    for raw, where in cases.items():
        with pytest.raises(ApiError) as info:
            parse_json_object(raw)
        assert info.value.status == 400
        assert f"{where} holds a lone UTF-16 surrogate" in info.value.message
    assert parse_json_object(b'{"p": "\\ud83d\\ude00 \\\\ud800"}') == {"p": "\U0001f600 \\ud800"}
    assert lone_surrogate_at({"a": [{"b": "x"}, "y"], "c": "z"}) is None


@given(st.text(alphabet=st.characters(exclude_categories=()), min_size=1))
def test_a_body_that_decodes_to_a_lone_surrogate_is_never_skipped_by_the_byte_hints(text: str) -> None:
    """The byte pre-filter may say "maybe" too often, never "no" for a body that holds one."""
    for raw in (
        json.dumps({"x": text}).encode(),  # \\uXXXX escapes
        json.dumps({"x": text}, ensure_ascii=False).encode("utf-8", "surrogatepass"),  # CESU-8
        json.dumps({"x": text}, ensure_ascii=False).encode("utf-16", "surrogatepass"),
    ):
        if lone_surrogate_at(json.loads(raw)) is not None:
            assert may_hold_surrogate(raw)


def test_token_ids_and_ascii_text_skip_the_walk() -> None:
    assert not may_hold_surrogate(json.dumps({"prompt": list(range(8192)), "model": "m"}).encode())
    assert not may_hold_surrogate(b'{"messages": [{"role": "user", "content": "plain text"}]}')


# ------------------------------------------------------------------------ weight ranges


def test_every_weight_has_a_finite_range_holding_its_default() -> None:
    defaults = PolicyWeights()
    names = {f.name for f in dataclasses.fields(PolicyWeights)}
    assert set(WEIGHT_RANGES) == names
    for name, weight_range in WEIGHT_RANGES.items():
        assert math.isfinite(weight_range.low) and math.isfinite(weight_range.high)
        default = getattr(defaults, name)
        assert default is None or weight_range.contains(default), name


@pytest.mark.parametrize("name", sorted(WEIGHT_RANGES))
def test_out_of_range_weights_are_refused_naming_the_field_and_range(name: str) -> None:
    weight_range = WEIGHT_RANGES[name]
    # 10**400: JSON's 1 and 400 zeros, an int too large for a float (was OverflowError: a 500)
    for bad in (weight_range.high * 1.0001 + 1e-9, 1e308, weight_range.low - 1.0, 10**400):
        with pytest.raises(ConfigError, match=rf"policy\.{name} must be in {re.escape(str(weight_range))}"):
            PolicyWeights().replace(**{name: bad})
        with pytest.raises(ApiError) as info:  # PUT /admin/policy and gRPC SetPolicy
            weights_from({name: bad}, PolicyWeights(), "weights")
        assert (
            info.value.status == 400
            and name in info.value.message
            and str(weight_range) in info.value.message
        )
        with pytest.raises(ApiError):  # x-kvlb-weights
            parse_weights_header(json.dumps({name: bad}), PolicyWeights())
        with pytest.raises(ConfigError):  # the config file and the Redis-shared policy: from_dict
            PolicyWeights.from_dict({name: bad})
    PolicyWeights().replace(**{name: weight_range.high})  # the bound itself is valid


def test_the_documented_ranges_are_the_enforced_ones() -> None:
    """docs/policies.md's weights table gives each field's range as WEIGHT_RANGES does."""
    rows = dict(re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|", DOCS.read_text("utf-8"), re.MULTILINE))
    spelled = {
        "[0, 1000]": "0..1000", "[0, 4]": "0..4", "[0, 1000000]": "0..1e6", "[0, 1]": "0..1",
        "(0, 1]": "(0, 1] or null", "(0, 1000000000]": "(0, 1e9] or null", "[1, 1000000]": "1..1e6",
        "[0, 8]": "0..8", "[0, 60]": "0..60",
    }  # fmt: skip
    for name, weight_range in WEIGHT_RANGES.items():
        documented = rows[name].strip().removesuffix(" requests")
        assert documented == spelled[str(weight_range)], name


def test_the_largest_weights_keep_every_cost_finite_and_printable() -> None:
    """At the upper bounds, a decision over a huge prompt and backlog is still finite JSON."""
    top = {name: r.high for name, r in WEIGHT_RANGES.items() if name != "temperature"}
    replicas = (ReplicaId("r0"), ReplicaId("r1"), ReplicaId("r2"))
    request = RouteRequest(replicas, request_blocks=1 << 20, prompt_tokens=1 << 24)
    loads = {
        r: ReplicaLoad(
            r,
            pending_prefill_tokens=1 << 40,
            pending_prefill_blocks=float(1 << 36),
            active_decode_blocks=1 << 30,
            waiting_reqs=1 << 20,
            kv_usage=0.99,
            capacity_blocks=float(1 << 20),
        )
        for r in replicas[:2]
    }
    load = LoadSnapshot(now=0.0, block_size_tokens=16, replicas=loads)
    overlap = Overlap({replicas[0]: 1 << 19, replicas[1]: 0, replicas[2]: 0}, request_blocks=1 << 20)
    for temperature in (0.0, 5e-324, 1e6):
        weights = PolicyWeights().replace(**top, temperature=temperature)
        decision = CostPolicy()(request, overlap, load, weights, random.Random(0))
        text = json.dumps(dataclasses.asdict(decision), allow_nan=False)  # raises on a non-finite number
        assert strict_parse(text)["replica"] in replicas


# ------------------------------------------------------------------------ the fast decoders

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(st.characters()),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(st.characters()), inner, max_size=3),
    max_leaves=8,
)


def stdlib_answer(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except ApiError as exc:
        return (exc.status, exc.message)


@settings(max_examples=300, deadline=None)
@given(
    value=st.dictionaries(
        st.sampled_from(["model", "prompt", "stream", "max_tokens", "user", "messages", "x", "\ud800"]),
        json_values | st.lists(st.integers(-2, 2**32 + 1), max_size=4),
        max_size=5,
    ),
    encoding=st.sampled_from(["ascii", "utf-8", "cesu-8", "utf-16"]),
)
def test_the_fast_decoders_answer_as_the_stdlib_path(value: dict[str, Any], encoding: str) -> None:
    """Whatever the body (lone surrogates, odd types, ids out of range, UTF-16): the msgspec decoders
    accept exactly what the stdlib path accepts, with the same value, and refuse with its message."""
    text = json.dumps(value, ensure_ascii=encoding == "ascii")
    raw = text.encode("utf-16" if encoding == "utf-16" else "utf-8", "surrogatepass")
    expected = stdlib_answer(lambda: parse_json_object(raw))
    assert stdlib_answer(lambda: decode_object(raw)) == expected
    for kind in ("chat", "completions"):
        reference = expected
        if not isinstance(expected, tuple):
            reference = stdlib_answer(functools.partial(parse_body, expected, kind))
        got = stdlib_answer(functools.partial(parse_request, raw, kind))
        if isinstance(got, ParsedRequest) and got.ids_checked:
            assert isinstance(reference, ParsedRequest)
            assert dataclasses.replace(got, ids_checked=False) == reference
            assert set(map(type, got.prompt)) == {int} and min(got.prompt) >= 0 and max(got.prompt) < 2**32
            assert got.packed is not None and got.packed.tolist() == got.prompt
        else:
            assert got == reference


def test_token_ids_are_checked_while_decoding() -> None:
    ids = list(range(0, 8192 * 15, 15))
    parsed = parse_request(json.dumps({"model": "m", "prompt": ids, "stream": True}).encode(), "completions")
    assert parsed.ids_checked and parsed.prompt == ids and parsed.stream
    assert parsed.packed is not None and parsed.packed.typecode == "I" and parsed.packed.tolist() == ids
    assert compact_ids(parsed.packed) is parsed.packed  # tokenize hands it on as it is
    for prompt in ([1, True], [1, -1], [2**32], [1.0], [[1, 2]], ["a"]):  # the stdlib path decides
        raw = json.dumps({"model": "m", "prompt": prompt}).encode()
        assert typed_completion(raw) is None
        answer = stdlib_answer(functools.partial(parse_request, raw, "completions"))
        assert not (isinstance(answer, ParsedRequest) and answer.ids_checked)
    with pytest.raises(ApiError, match="'prompt' must not be empty"):
        parse_request(b'{"model": "m", "prompt": []}', "completions")
    # raw CESU-8 in a field the struct skips: not ASCII, so the checking decoder answers
    with pytest.raises(ApiError, match="lone UTF-16 surrogate"):
        parse_request(b'{"model": "m", "prompt": [1], "x": "\xed\xa0\x80"}', "completions")
