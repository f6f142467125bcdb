"""A large gRPC message's parse in the byte budget (``limits.max_inflight_body_bytes``) over real
sockets: a balancer and an emulated replica on 127.0.0.1, a real ``grpc.aio`` client. A message of
256 KiB or more holds the estimate of its protobuf parse, then of its conversion to the OpenAI body,
while each runs (``kvlb_admission_parse_holds_total{face="grpc"}``); the parsed message is held while
the call lasts (its bytes as received are given back once read), a message of tiny chat messages
(2 to 5 bytes on the wire, about 300 B each once made into the body) gets a clear status without
stalling a small call beside it, and every byte comes back."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_harness import GrpcHarness, grpc_running, token_request
from kvlb_harness import MODEL, metric_value, shared_deepseek, wait_for

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.parse_cost import PARSE_HOLD_MIN_BYTES, parsed_message_bytes
from balancer.tokenizer.tokenizer import Tokenizer
from loadtests.faults.body_budget import padded_message

GENERATE = "/kvlb.v1.Balancer/Generate"
HOLDS = "kvlb_admission_parse_holds_total"
SLACK_BYTES = 4096
"""The JSON a call forwards and its ids (a few hundred bytes), held besides its parsed message."""


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def metrics(g: GrpcHarness) -> str:
    async with g.http.session.get(g.http.url + "/metrics") as response:
        return await response.text()


async def is_zero(g: GrpcHarness) -> bool:
    return metric_value(await metrics(g), "kvlb_admission_body_bytes") == 0


async def test_a_large_call_holds_its_parsed_message_not_its_bytes_twice(tokenizer: Tokenizer) -> None:
    """A ``Generate`` of 1 MiB (4 ids, padded by an unknown field): while it streams it holds its
    parsed message (its bytes again: the unknown field is kept) and what it forwards; its bytes as
    received were given back once its ids were read."""
    async with grpc_running(tokenizer, 1, time_scale=0.05, limits__max_body_bytes=8 * 1024 * 1024) as g:
        head = token_request([80, 2, 3, 4], max_tokens=60).SerializeToString()
        message = padded_message(head, 1024 * 1024)
        call = g.channel.unary_stream(GENERATE, response_deserializer=pb.GenerateChunk.FromString)(message)
        try:
            assert (await call.read()).index == 0  # in flight, streaming
            text = await metrics(g)
            held = metric_value(text, "kvlb_admission_body_bytes")
            kept = parsed_message_bytes(len(message), 0, 4)
            assert kept <= held <= kept + SLACK_BYTES, held
            assert metric_value(text, HOLDS, face="grpc", waited="no") == 2  # its parse, its conversion
        finally:
            call.cancel()
        await wait_for("every byte given back", lambda: is_zero(g), timeout_s=5.0)


async def test_a_message_of_tiny_chat_messages_is_held_and_stalls_no_one(tokenizer: Tokenizer) -> None:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="u")] * 60_000)
    request = pb.GenerateRequest(model=MODEL, chat_messages=chat, max_tokens=1)
    message = request.SerializeToString()
    assert len(message) >= PARSE_HOLD_MIN_BYTES
    async with grpc_running(tokenizer, 1, limits__max_body_bytes=8 * 1024 * 1024) as g:

        async def generate(data: bytes) -> grpc.StatusCode:
            call = g.channel.unary_stream(GENERATE, response_deserializer=pb.GenerateChunk.FromString)
            try:
                chunks = [chunk async for chunk in call(data, timeout=60.0)]
            except grpc.aio.AioRpcError as error:
                assert error.code() != grpc.StatusCode.INTERNAL, error.details()
                return error.code()
            assert chunks[-1].HasField("done")
            return grpc.StatusCode.OK

        small = token_request([5, 6, 7, 8]).SerializeToString()
        codes = await asyncio.gather(generate(message), generate(small))
        assert codes[0] in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), codes
        assert codes[1] == grpc.StatusCode.OK
        # its parse and its conversion to the OpenAI body: two holds (the small call holds none)
        assert metric_value(await metrics(g), HOLDS, face="grpc", waited="no") == 2
        await wait_for("every byte given back", lambda: is_zero(g), timeout_s=10.0)
