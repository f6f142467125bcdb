"""The pure gRPC conversions: request → OpenAI body, chunk reading (of SSE payloads), decisions."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import math
from array import array
from typing import Any

import pytest
from google.protobuf import json_format, struct_pb2

from balancer import strict_json
from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.errors import ApiError
from balancer.api.grpc.admin import REPLICAS_PER_STEP, replica_parts
from balancer.api.grpc.messages import decision_message, openai_call, read_chunk, received_ids, struct_of
from balancer.api.grpc.replica_messages import replica_message
from balancer.api.parsing import parse_request
from balancer.tokenizer.token_ids import TokenIdMemo
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


CHAT = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])


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
        (
            pb.GenerateRequest(
                model="m", prompt_token_ids=pb.TokenIds(ids=[1]), extra_json='{"stop": ["\\ud800"]}'
            ),
            "'stop[0]' holds a lone UTF-16 surrogate",
        ),
        (pb.GenerateRequest(model="m", prompt_text="x", temperature=float("nan")), "'temperature'"),
        (pb.GenerateRequest(model="m", prompt_text="x", extra_json="{"), "not valid JSON"),
        (pb.GenerateRequest(model="m", prompt_text="x", extra_json='"s"'), "must be a JSON object"),
        (
            pb.GenerateRequest(model="m", prompt_text="x", extra_json='{"model": "n"}'),
            "may not set ['model']",
        ),
        # the chat template's fields in extra_json: the HTTP face's checks of a chat body
        (
            pb.GenerateRequest(model="m", chat_messages=CHAT, extra_json='{"tools": 5}'),
            "'tools' must be an array",
        ),
        (
            pb.GenerateRequest(
                model="m", chat_messages=CHAT, extra_json='{"chat_template_kwargs": {"tools": []}}'
            ),
            "'chat_template_kwargs' may not set ['tools']",
        ),
    ],
)
def test_incomplete_requests_are_refused_naming_the_field(request_: pb.GenerateRequest, message: str) -> None:
    with pytest.raises(ApiError) as info:
        openai_call(request_, stream=True)
    assert info.value.status == 400 and message in info.value.message


INPUTS: dict[str, dict[str, Any]] = {
    "chat": {"chat_messages": pb.ChatMessages(messages=[
        pb.ChatMessage(role="system", content="Be brief. caf\u00e9 \u2603 \U0001f600 \"quoted\" \\ back\n"),
        pb.ChatMessage(role="user", content="hello"),
    ])},
    "prompt_text": {"prompt_text": "Once upon a time, \u00e9t\u00e9 \u2603\t</script>"},
    "prompt_token_ids": {"prompt_token_ids": pb.TokenIds(ids=[0, 1, 255, 256, 151_643, 2**31, 2**32 - 1])},
}  # fmt: skip
EXTRA = (
    '{"top_p": 0.9, "stop": ["\\n", "\u00e9"], "seed": 3, "logit_bias": {"7": -1e400}, "n": 1e2,'
    ' "tools": [{"type": "function", "function": {"name": "f", "parameters": {"maximum": 1e400}}}]}'
)
"""Non-ASCII text, numbers too large for a float (``null`` in the body), a chat's ``tools``."""


def old_body(request: pb.GenerateRequest, stream: bool) -> bytes:
    """The body as kvlb wrote it before token ids were written apart: one ``strict_json.dumps``."""
    body: dict[str, Any] = strict_json.loads(request.extra_json) if request.extra_json else {}
    body["model"] = request.model
    which = request.WhichOneof("input")
    if which == "chat_messages":
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.chat_messages.messages]
    else:
        body["prompt"] = (
            list(request.prompt_token_ids.ids) if which == "prompt_token_ids" else request.prompt_text
        )
    if request.max_tokens:
        body["max_tokens"] = request.max_tokens
    if request.HasField("temperature"):
        body["temperature"] = request.temperature
    if request.HasField("session_key"):
        body["user"] = request.session_key
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return strict_json.dumps(body, separators=(",", ":")).encode("utf-8")


@pytest.mark.parametrize(
    ("which", "extra", "temperature", "session", "max_tokens", "stream"),
    list(itertools.product(INPUTS, ("", EXTRA), (None, 0.7), (None, "alice"), (0, 5), (False, True))),
)
def test_the_body_is_the_same_bytes_and_reads_as_the_http_face_reads_it(
    which: str, extra: str, temperature: float | None, session: str | None, max_tokens: int, stream: bool
) -> None:
    """Every kind of input with every optional field: the body is byte for byte the one a single
    ``strict_json.dumps`` wrote (ASCII, compact), and what routing reads of it is what the HTTP
    face's :func:`parse_request` reads of those bytes (a token-id prompt packed as ``array('I')``)."""
    fields: dict[str, Any] = {"model": "m", "extra_json": extra, "max_tokens": max_tokens, **INPUTS[which]}
    if temperature is not None:
        fields["temperature"] = temperature
    if session is not None:
        fields["session_key"] = session
    request = pb.GenerateRequest.FromString(pb.GenerateRequest(**fields).SerializeToString())
    call = openai_call(request, stream=stream)
    assert call.body == old_body(request, stream) and call.body.isascii()
    assert (call.kind, call.path) == (
        ("chat", "/v1/chat/completions") if which == "chat" else ("completions", "/v1/completions")
    )
    reread = parse_request(call.body, call.kind)
    parsed = call.parsed
    if which == "prompt_token_ids":
        assert type(parsed.prompt) is array and parsed.packed is parsed.prompt and parsed.ids_checked
        assert parsed.prompt.typecode == "I" and list(parsed.prompt) == reread.prompt
        assert dataclasses.replace(parsed, prompt=reread.prompt) == reread
    else:
        assert parsed == reread
    if which == "chat" and extra:
        assert parsed.chat_kwargs["tools"][0]["function"]["parameters"] == {"maximum": None}


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_sent_again_through_the_memo_give_the_same_body(stream: bool) -> None:
    """Through a memo (the server passes ``state.token_id_memo``), ids sent again are found as runs of
    their packed varints: the body and what routing reads are those made without one."""
    memo = TokenIdMemo(256, run_bytes=64)
    prefix = [(i * 104_729) % 2**32 for i in range(500)]
    for _ in range(4):
        for tail in ([], [1, 2, 3], list(range(100_000, 100_400))):
            ids = pb.TokenIds(ids=prefix + tail)
            request = pb.GenerateRequest.FromString(
                pb.GenerateRequest(
                    model="m", prompt_token_ids=ids, max_tokens=9, session_key="s"
                ).SerializeToString()
            )
            plain, through = (
                openai_call(request, stream=stream),
                openai_call(request, stream=stream, memo=memo),
            )
            assert through.body == plain.body == old_body(request, stream)
            assert through.parsed == plain.parsed and through.parsed.packed is through.parsed.prompt
    assert memo.hits > 0


def varint(value: int, pad: int = 0) -> bytes:
    """``value`` as a varint, with ``pad`` more bytes than it needs (as a lax encoder may write)."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if not value and not pad:
            return bytes(out + bytes([byte]))
        if not value:
            pad -= 1
        out.append(byte | 0x80)


def length_delimited(number: int, value: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(value)) + value


PROMPT_IDS = [(i * 104_729) % 2**32 for i in range(700)]
MODEL_FIELD = length_delimited(1, b"m")
PACKED = length_delimited(1, b"".join(varint(i) for i in PROMPT_IDS))
RECEIVED = {
    "as protobuf writes it": MODEL_FIELD + length_delimited(3, PACKED) + b"\x28\x09",
    "fields in another order": b"\x28\x09" + length_delimited(3, PACKED) + MODEL_FIELD,
    "text first, ids last (the oneof's last wins)": length_delimited(4, b"hi")
    + MODEL_FIELD
    + length_delimited(3, PACKED),
    "longer varints than needed": MODEL_FIELD
    + length_delimited(3, length_delimited(1, b"".join(varint(i, i % 3) for i in PROMPT_IDS))),
    "unpacked ids": MODEL_FIELD + length_delimited(3, b"".join(b"\x08" + varint(i) for i in PROMPT_IDS)),
    "two packed runs": MODEL_FIELD
    + length_delimited(3, PACKED + length_delimited(1, b"".join(varint(i) for i in PROMPT_IDS[:9]))),
    "an unknown field in TokenIds": MODEL_FIELD + length_delimited(3, PACKED + b"\x10\x05"),
    "the field twice (merged)": MODEL_FIELD + length_delimited(3, PACKED) + length_delimited(3, PACKED),
    "an unknown field after": MODEL_FIELD + length_delimited(3, PACKED) + length_delimited(99, b"x" * 300),
}


@pytest.mark.parametrize("name", list(RECEIVED))
def test_ids_looked_up_as_received_give_the_same_body(name: str) -> None:
    """Token ids looked up as the bytes of the request as received (``raw``) hold them, in any
    encoding protobuf reads: the body and what routing reads are those made without a memo, sent
    again and again (misses, runs remembered, hits)."""
    raw = RECEIVED[name]
    request = pb.GenerateRequest.FromString(raw)
    assert request.WhichOneof("input") == "prompt_token_ids" and request.model == "m"
    memo = TokenIdMemo(64, run_bytes=256)
    for _ in range(4):
        plain, through = (
            openai_call(request, stream=True),
            openai_call(request, stream=True, memo=memo, raw=raw),
        )
        assert through.body == plain.body and through.parsed == plain.parsed
    # an unknown field stays in the message serialized again too: its ids are read whole every time
    assert (memo.hits > 0) is (name != "an unknown field in TokenIds")


def test_the_ids_bytes_are_the_ones_received_when_they_are_one_packed_field() -> None:
    """The varints are taken as they came (not serialized again) when field 3 occurs once and holds
    one packed field; else the message is serialized again."""
    lax = length_delimited(1, b"".join(varint(i, 1) for i in PROMPT_IDS))
    raw = MODEL_FIELD + length_delimited(3, lax)
    request = pb.GenerateRequest.FromString(raw)
    assert received_ids(raw, request.prompt_token_ids) == lax != request.prompt_token_ids.SerializeToString()
    for other in ("the field twice (merged)", "unpacked ids", "an unknown field in TokenIds"):
        request = pb.GenerateRequest.FromString(RECEIVED[other])
        ids = request.prompt_token_ids
        assert received_ids(RECEIVED[other], ids) == ids.SerializeToString()
    assert received_ids(b"", ids) == received_ids(raw[:-1], ids) == ids.SerializeToString()


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
    assert not second.HasField("held_roots")  # the held-roots charge off: unknown, not 0
    assert not message.HasField("ramp_share")  # the ramp without memory
    assert not message.HasField("busy_share")


def test_a_decision_carries_the_ramps_averaged_share() -> None:
    """With ``ramp_memory_s`` the decision's averaged busy share reaches gRPC as HTTP shows it."""
    decision = Decision(
        ReplicaId("a"), "cost", 3, 4, 12, (), reason="argmin", ramp_share=0.71, busy_share=0.875
    )
    message = decision_message(decision)
    assert message.ramp_share == 0.71 and message.busy_share == 0.875
    fields = {f.name for f in dataclasses.fields(Decision)} - {"terms"}
    assert fields <= set(pb.Decision.DESCRIPTOR.fields_by_name)  # a new decision field needs its own


def test_every_cost_term_has_its_field_in_the_grpc_message() -> None:
    """The gRPC explanation carries every term the HTTP one does (a new term needs its field)."""
    names = [f.name for f in dataclasses.fields(CostTerms)]
    assert set(names) <= set(pb.CostTerms.DESCRIPTOR.fields_by_name)
    terms = CostTerms(
        ReplicaId("a"), 3, 4, 0.5, 1.0, 2.0, 0.25, 1.5, 1.0, 0.5, 2.0, 0.75, None, 1.0, 2.5,
        3.5, 0.5, 0.875, 1.5, 0.25, 3.0, 7,
    )  # fmt: skip
    message = decision_message(Decision(ReplicaId("a"), "cost", 3, 4, 12, (terms,))).terms[0]
    for name in names:
        value = getattr(terms, name)
        assert getattr(message, name) == ("" if value is None else value), name


def bare_view(**load: Any) -> dict[str, Any]:
    """A replica's ``GET /admin/replicas`` view as a replica with no health record, events nor
    scraper shows it (:func:`~balancer.api.admin_replicas.replica_views`), with ``load`` laid over
    an idle one."""
    idle = {
        "replica": "r0", "pending_prefill_seqs": 0, "pending_prefill_tokens": 0,
        "pending_prefill_blocks": 0.0, "active_decode_seqs": 0, "active_decode_blocks": 0,
        "waiting_reqs": None, "running_reqs": None, "kv_usage": None, "stats_age_s": None,
        "capacity_blocks": None, "peer_seqs": 0,
    }  # fmt: skip
    prediction = {"receipts": 0, "accuracy": None, "within_one_block": None, "mean_error_blocks": None}
    return {
        "id": "r0", "model": "m", "url": "http://127.0.0.1:1", "engine": "vllm", "block_size": 16,
        "dp_size": 1, "api_key": None, "inflight": 0, "health": None, "routable": False,
        "unroutable": "failing health probes", "load": {**idle, **load}, "index": {"blocks": 0},
        "prediction": prediction, "events": None, "scrape": None,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("reported", "typed"), [(-3, -3), (10**12, 10**12), (10**30, 2**63 - 1), (-(10**30), -(2**63))]
)
def test_an_engines_odd_queue_report_is_typed_as_reported_and_never_fails_the_call(
    reported: int, typed: int
) -> None:
    """A scraped gauge is not checked (``vllm:num_requests_waiting -3`` is read as -3): the typed
    ``waiting_reqs`` and ``running_reqs`` say it (within ``int64``) where a ``uint32`` raised, which
    would make ``ListReplicas`` fail for every replica."""
    message = replica_message(bare_view(waiting_reqs=reported, running_reqs=reported))
    assert (message.load.waiting_reqs, message.load.running_reqs) == (typed, typed)


def test_a_replica_with_nothing_known_has_its_optional_fields_unset() -> None:
    message = replica_message(bare_view())
    for name in ("key_refused", "events_stalled_s", "probe_ok", "events_last_lag_s", "scrape", "drain"):
        assert not message.HasField(name), name
    for name in ("waiting_reqs", "running_reqs", "kv_usage", "stats_age_s", "capacity_blocks"):
        assert not message.load.HasField(name), name
    assert not message.prediction.HasField("accuracy") and message.prediction.receipts == 0
    assert message.unroutable == "failing health probes" and message.consecutive_failures == 0


class Level(enum.IntEnum):
    HIGH = 3


class Colour(enum.StrEnum):
    RED = "red"


def json_way(data: Any) -> struct_pb2.Struct:
    """What ``struct_of`` gave before h-grpclist: ``data`` written as strict JSON and read back."""
    struct = struct_pb2.Struct()
    json_format.ParseDict(json.loads(strict_json.dumps(data)), struct)
    return struct


EDGES: list[Any] = [
    {"empty_list": [], "empty_dict": {}, "nested": [[], [{}], ()], "tuple": (1, 2.5, None, True, "s")},
    {"nan": math.nan, "inf": math.inf, "minus_inf": -math.inf, "in_list": [math.nan, 1.0], "zero": -0.0},
    {"big": 10**20, "small": -(2**63), "fraction": 0.1, "true": True, "false": False, "none": None},
    {"int_enum": Level.HIGH, "str_enum": Colour.RED, "text": 'é\u2028"\\\n', "": "empty key"},
    {"deep": {"a": {"b": {"c": [{"d": [1, {"e": None}]}]}}}},
]


@pytest.mark.parametrize("data", EDGES)
def test_struct_of_sets_what_the_json_way_set(data: Any) -> None:
    """``struct_of`` sets the ``Struct`` field by field (h-grpclist): the same message, the same
    bytes, as the strict-JSON round trip it replaced (a non-finite float a null, an empty list or
    object present and empty, an enum its value)."""
    made, before = struct_of(data), json_way(data)
    assert made == before
    assert made.SerializeToString(deterministic=True) == before.SerializeToString(deterministic=True)
    assert made.SerializeToString() == before.SerializeToString()


@pytest.mark.parametrize("data", [{1: "int key", None: "none key"}, {"x": {1, 2}}, {"x": "\ud800"}])
def test_struct_of_gives_what_the_json_way_gave_for_what_it_does_not_take(data: Any) -> None:
    """A key that is not a string is converted as ``json`` converts it; a set, or a lone surrogate
    (which protobuf refuses), fails as it failed."""
    try:
        before: Any = json_way(data)
    except Exception as exc:  # the error itself is compared
        with pytest.raises(type(exc)) as raised:
            struct_of(data)
        assert str(raised.value) == str(exc)
    else:
        assert struct_of(data) == before


def test_list_replicas_makes_and_encodes_its_messages_a_few_at_a_time_with_the_loop_let_run_between() -> None:
    """``ListReplicas`` makes ``REPLICAS_PER_STEP`` messages and encodes them, then lets the loop run
    (h-grpclist; h-listreplicas: encoded in the step): 12 replicas are built in three steps (two
    yields), and the parts laid end to end read as one answer holding the messages
    :func:`replica_message` makes, in order."""
    views = [{**bare_view(), "id": f"r{index}"} for index in range(12)]
    steps = replica_parts(views)
    yields = 0
    while True:
        try:
            steps.send(None)
        except StopIteration as done:
            parts = done.value
            break
        yields += 1
    assert REPLICAS_PER_STEP == 5 and yields == 2 and len(parts) == 3
    answer = pb.ListReplicasResponse.FromString(b"".join(parts))
    assert [len(pb.ListReplicasResponse.FromString(part).replicas) for part in parts] == [5, 5, 2]
    assert list(answer.replicas) == [replica_message(view) for view in views]
    assert list(answer.replicas) == [replica_message(view, pb.Replica()) for view in views]
