"""The pure gRPC conversions: request → OpenAI body, chunk reading (of SSE payloads), decisions."""

from __future__ import annotations

import dataclasses
import json

import pytest

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.errors import ApiError
from balancer.api.grpc.messages import decision_message, openai_call, read_chunk
from balancer.types import CostTerms, Decision, ReplicaId
from balancer.upstream.sse import SseEvents

STREAM = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}\n\n'
    b": keep-alive comment\n\n"
    b'data: {"choices":[{"index":0,"delta":{"content":" there"},"finish_reason":"stop"}]}\r\n\r\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9,'
    b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
    b"data: [DONE]\n\n"
)


def test_a_chat_request_becomes_a_streaming_chat_body() -> None:
    request = pb.GenerateRequest(
        model="m",
        chat_messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hello")]),
        max_tokens=5,
        temperature=0.5,
        session_key="alice",
        extra_json='{"top_p": 0.9, "stop": ["\\n"]}',
    )
    call = openai_call(request, stream=True)
    assert (call.kind, call.path) == ("chat", "/v1/chat/completions")
    assert json.loads(call.body) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "temperature": 0.5,
        "user": "alice",
        "top_p": 0.9,
        "stop": ["\n"],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_token_ids_and_text_become_completions_with_engine_defaults_left_alone() -> None:
    ids = openai_call(pb.GenerateRequest(model="m", prompt_token_ids=pb.TokenIds(ids=[1, 2])), stream=False)
    assert (ids.kind, ids.path, json.loads(ids.body)) == (
        "completions",
        "/v1/completions",
        {"model": "m", "prompt": [1, 2]},
    )
    text = openai_call(pb.GenerateRequest(model="m", prompt_text="", temperature=0.0), stream=False)
    assert json.loads(text.body) == {"model": "m", "prompt": "", "temperature": 0.0}


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.GenerateRequest(prompt_text="x"), "'model' is required"),
        (pb.GenerateRequest(model="m"), "one of 'chat_messages'"),
        (pb.GenerateRequest(model="m", chat_messages=pb.ChatMessages()), "'chat_messages.messages'"),
        (pb.GenerateRequest(model="m", prompt_token_ids=pb.TokenIds()), "'prompt_token_ids.ids'"),
        (pb.GenerateRequest(model="m", prompt_text="x", temperature=float("nan")), "'temperature'"),
        (pb.GenerateRequest(model="m", prompt_text="x", extra_json="{"), "not valid JSON"),
        (pb.GenerateRequest(model="m", prompt_text="x", extra_json='"s"'), "must be a JSON object"),
        (
            pb.GenerateRequest(model="m", prompt_text="x", extra_json='{"model": "n"}'),
            "may not set ['model']",
        ),
    ],
)
def test_incomplete_requests_are_refused_naming_the_field(request_: pb.GenerateRequest, message: str) -> None:
    with pytest.raises(ApiError) as info:
        openai_call(request_, stream=True)
    assert info.value.status == 400 and message in info.value.message


def test_sse_payloads_are_read_whole_with_text_finish_and_usage() -> None:
    events = SseEvents()
    payloads = events.feed(STREAM) + events.close()
    assert payloads[-1] == b"[DONE]" and len(payloads) == 4
    infos = [read_chunk(p) for p in payloads[:3]]
    assert [i.text for i in infos] == ["Hi", " there", ""]
    assert infos[1].finish_reason == "stop"
    usage = infos[2].usage
    assert usage is not None and (usage.prompt_tokens, usage.total_tokens, usage.cached_tokens) == (7, 9, 4)
    assert read_chunk(b'{"choices":[{"text":"abc","finish_reason":"length"}]}').text == "abc"
    assert read_chunk(b'{"error": {"message": "engine aborted"}}').error == "engine aborted"
    assert read_chunk(b"not json") == read_chunk(b"[1, 2]") == read_chunk(b'{"usage": null}')


def test_a_decision_keeps_every_term_and_leaves_absent_values_unset() -> None:
    terms = (
        CostTerms(ReplicaId("a"), 3, 4, 0.0, 1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 2.0),
        CostTerms(ReplicaId("b"), 0, 4, 2.0, 0.0, 0.0, None, 6.0, 0.0, 0.0, None, excluded="kv_usage"),
    )
    decision = Decision(ReplicaId("a"), "cost", 3, 4, 12, terms, reason="argmin")
    message = decision_message(decision)
    assert (message.replica, message.cached_tokens, message.reason) == ("a", 12, "argmin")
    first, second = message.terms
    assert first.kv_usage == 0.5 and first.cost == 2.0 and first.excluded == ""
    assert not second.HasField("kv_usage") and not second.HasField("cost") and second.excluded == "kv_usage"
    assert not second.HasField("overlap_credit")


def test_every_cost_term_has_its_field_in_the_grpc_message() -> None:
    """The gRPC explanation carries every term the HTTP one does (a new term needs its field)."""
    names = [f.name for f in dataclasses.fields(CostTerms)]
    assert set(names) <= set(pb.CostTerms.DESCRIPTOR.fields_by_name)
    terms = CostTerms(
        ReplicaId("a"), 3, 4, 0.5, 1.0, 2.0, 0.25, 1.5, 1.0, 0.5, 2.0, 0.75, None, 1.0, 2.5,
        3.5, 0.5, 0.875, 1.5,
    )  # fmt: skip
    message = decision_message(Decision(ReplicaId("a"), "cost", 3, 4, 12, (terms,))).terms[0]
    for name in names:
        value = getattr(terms, name)
        assert getattr(message, name) == ("" if value is None else value), name
