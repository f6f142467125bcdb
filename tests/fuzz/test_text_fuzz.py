"""Arbitrary text, lone UTF-16 surrogates included, on every endpoint that takes text (issue #17,
defect 3): the answer is never a 5xx over HTTP, never ``INTERNAL``/``UNKNOWN`` over gRPC.

Text reaches kvlb as JSON strings: escaped (``"\\ud800"``, what ``json.dumps`` writes) or as raw
bytes (CESU-8 surrogates, which Python's ``json`` decodes). Over HTTP that is every field of the chat,
completions, explain and policy bodies and the ``x-kvlb-weights`` header; over gRPC, whose strings
must be UTF-8, surrogates can only arrive inside JSON text (``extra_json``, the ``x-kvlb-weights``
metadata), and arbitrary UTF-8 in every string field (prompt, messages, model, session key, policy
keys). ``KVLBTEST_TEXT_FUZZ_EXAMPLES`` sets the examples per test (default 40; ``make faults`` runs
1000).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import requests
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kvlb_harness import MODEL
from live_service import LiveService, live

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer._proto.kvlb.v1 import balancer_pb2_grpc as pb_grpc

EXAMPLES = int(os.environ.get("KVLBTEST_TEXT_FUZZ_EXAMPLES", "40"))
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))

any_text = st.text(alphabet=st.characters(exclude_categories=()), max_size=24)
"""Any code point, lone surrogates (category Cs) included."""
utf8_text = st.text(max_size=24)
"""What a protobuf string can hold: no surrogates."""
texty = st.one_of(any_text, st.sampled_from(["a\ud800b", "\udfff", "\ud83d", "x\udc00\ud800", MODEL, "user"]))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | texty,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texty, inner, max_size=3),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def service() -> Iterator[LiveService]:
    limits = {"limits__max_prompt_tokens": 4096, "auth__allow_weight_override": True}
    with live(2, listen__grpc_port=0, **limits) as svc:
        yield svc


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as http:
        yield http


@pytest.fixture(scope="module")
def channel(service: LiveService) -> Iterator[grpc.Channel]:
    assert service.harness is not None
    port = service.harness.balancer.grpc_port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
        yield chan


def encode(body: dict[str, Any], raw: bool) -> bytes:
    """``body`` as JSON: surrogates as ``\\uXXXX`` escapes, or (``raw``) as their CESU-8 bytes."""
    if raw:
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return json.dumps(body).encode("ascii")


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[str, str, dict[str, Any], dict[str, str]]:
    """(method, path, body, headers) of a text-taking endpoint, text fields drawn from ``texty``."""
    kind = draw(st.sampled_from(["chat", "completions", "explain-chat", "explain-completions", "policy"]))
    model = draw(st.sampled_from([MODEL, MODEL, MODEL])) if draw(st.booleans()) else draw(texty)
    headers: dict[str, str] = {}
    if draw(st.integers(0, 4)) == 0:
        headers["x-kvlb-weights"] = json.dumps(draw(st.dictionaries(texty, json_values, max_size=2)))
    if kind == "policy":
        body: dict[str, Any] = draw(
            st.sampled_from(
                [
                    {"name": draw(texty)},
                    {"weights": draw(st.dictionaries(texty, json_values, max_size=2))},
                    {draw(texty): draw(json_values)},
                ]
            )
        )
        return "PUT", "/admin/policy", body, headers
    body = {"model": model, "max_tokens": 1}
    if kind.endswith("chat"):
        content: Any = draw(texty)
        if draw(st.booleans()):
            content = [{"type": "text", "text": draw(texty)}]
        body["messages"] = [
            {"role": draw(st.sampled_from(["user", "system", "assistant"])), "content": content}
        ]
        if draw(st.integers(0, 3)) == 0:
            body["tools"] = [
                {"type": "function", "function": {"name": draw(texty), "description": draw(texty)}}
            ]
        if draw(st.integers(0, 3)) == 0:
            body["chat_template_kwargs"] = draw(st.dictionaries(texty, json_values, max_size=2))
    else:
        body["prompt"] = draw(texty)
    if draw(st.integers(0, 3)) == 0:
        body["user"] = draw(texty)
    if draw(st.integers(0, 3)) == 0:
        body[draw(texty)] = draw(json_values)
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}.get(kind, "/admin/explain")
    return "POST", path, body, headers


CHAT_SURROGATE = {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 1}
PROMPT_SURROGATE = {"model": MODEL, "prompt": "a\udfff", "max_tokens": 1}


@FUZZ
@given(request=http_requests(), raw=st.booleans())
@example(request=("POST", "/v1/chat/completions", CHAT_SURROGATE, {}), raw=False)  # the attack run's
@example(request=("POST", "/v1/completions", PROMPT_SURROGATE, {}), raw=False)
@example(request=("POST", "/admin/explain", CHAT_SURROGATE, {}), raw=True)
@example(
    request=("POST", "/admin/explain", PROMPT_SURROGATE, {"x-kvlb-weights": '{"\\ud800": 1}'}), raw=False
)
def test_http_text_never_gets_a_5xx(
    service: LiveService,
    session: requests.Session,
    request: tuple[str, str, dict[str, Any], dict[str, str]],
    raw: bool,
) -> None:
    method, path, body, headers = request
    data = encode(body, raw)
    response = session.request(method, service.url + path, data=data, headers=headers, timeout=30)
    where = f"{method} {path} {data[:200]!r} {headers}"
    assert response.status_code < 500, f"{where} -> {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        error = json.loads(
            response.content, parse_constant=lambda c: pytest.fail(f"{where}: {c} in the answer")
        )
        assert error["error"]["message"], where
        assert "Traceback" not in response.text, where


@st.composite
def grpc_calls(draw: st.DrawFn) -> tuple[str, Any, tuple[tuple[str, str], ...]]:
    """(method, message, metadata): UTF-8 text in string fields, any text inside JSON strings."""
    generate = pb.GenerateRequest(model=MODEL if draw(st.booleans()) else draw(utf8_text), max_tokens=1)
    which = draw(st.sampled_from(["text", "chat"]))
    if which == "text":
        generate.prompt_text = draw(utf8_text)
    else:
        generate.chat_messages.messages.add(
            role=draw(st.sampled_from(["user", "system"])), content=draw(utf8_text)
        )
    if draw(st.booleans()):
        extra = {
            draw(st.sampled_from(["tools", "chat_template_kwargs", "stop", "logit_bias"])): draw(json_values)
        }
        generate.extra_json = json.dumps(extra)  # ASCII: surrogates as escapes
    if draw(st.integers(0, 3)) == 0:
        generate.session_key = draw(utf8_text)
    metadata: tuple[tuple[str, str], ...] = ()
    if draw(st.integers(0, 3)) == 0:
        metadata = (("x-kvlb-weights", json.dumps(draw(st.dictionaries(texty, json_values, max_size=2)))),)
    method = draw(st.sampled_from(["Generate", "Route", "Explain", "SetPolicy"]))
    message: Any
    if method == "Generate":
        message = generate
    elif method == "Route":
        message = pb.RouteRequest(request=generate)
    elif method == "Explain":
        message = pb.ExplainRequest(request=generate)
    else:
        weights = struct_pb2.Struct()
        weights.update({draw(utf8_text): draw(st.floats(allow_nan=False, allow_infinity=False) | st.none())})
        message = pb.SetPolicyRequest(name=draw(utf8_text), weights=weights)
    return method, message, metadata


SURROGATE_WEIGHTS = (("x-kvlb-weights", '{"\\ud800": null}'),)
"""An unknown weight name echoed in the status detail: gRPC could not send it, and the call hung."""


@FUZZ
@given(call=grpc_calls())
@example(
    call=(
        "Route",
        pb.RouteRequest(request=pb.GenerateRequest(model=MODEL, prompt_text="hi")),
        SURROGATE_WEIGHTS,
    )
)
@example(
    call=(
        "Explain",
        pb.ExplainRequest(request=pb.GenerateRequest(model=MODEL, prompt_text="hi")),
        SURROGATE_WEIGHTS,
    )
)
@example(
    call=(
        "Generate",
        pb.GenerateRequest(model=MODEL, prompt_text="hi", extra_json='{"tools": [{"x": "a\\ud800"}]}'),
        (),
    )
)
def test_grpc_text_never_gets_internal_or_unknown(
    channel: grpc.Channel, call: tuple[str, Any, tuple[tuple[str, str], ...]]
) -> None:
    method, message, metadata = call
    balancer, admin = pb_grpc.BalancerStub(channel), pb_grpc.AdminStub(channel)
    where = f"{method} {message} {metadata}"
    try:
        if method == "Generate":
            for _ in balancer.Generate(message, metadata=metadata, timeout=10):
                pass
        elif method == "Route":
            balancer.Route(message, metadata=metadata, timeout=10)
        elif method == "Explain":
            admin.Explain(message, metadata=metadata, timeout=10)
        else:
            admin.SetPolicy(message, metadata=metadata, timeout=10)
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        details = exc.details() or ""  # type: ignore[attr-defined]
        assert code not in FORBIDDEN, f"{where} -> {code.name}: {details}"
        assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{where}: hung ({details})"
        assert "Traceback" not in details, where
