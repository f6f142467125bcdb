"""gRPC status codes for bad input and limits, health, reflection and shutdown (real grpc.aio server)."""

from __future__ import annotations

import json
import logging

import grpc
import pytest
from grpc_harness import failure, grpc_running, token_request
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from kvlb_harness import MODEL, shared_deepseek, wait_for

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.tokenizer.tokenizer import Tokenizer

PROMPT = list(range(100, 140))
INTERNALS = ("Traceback", "Exception", "internal", "File ")


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def route(request: pb.GenerateRequest) -> pb.RouteRequest:
    return pb.RouteRequest(request=request)


async def test_bad_messages_and_limits_get_clear_client_errors(tokenizer: Tokenizer) -> None:
    limits = {"limits__max_body_bytes": 4096, "limits__max_prompt_tokens": 64}
    async with grpc_running(tokenizer, **limits) as g:
        raw_route = g.channel.unary_unary("/kvlb.v1.Balancer/Route")
        bad_utf8 = b"\x0a\x05\x0a\x03\xff\xfe\xfd"  # RouteRequest.request.model = invalid UTF-8
        cases: list[tuple[object, grpc.StatusCode, str]] = [
            (raw_route(b"\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT, "malformed request"),
            (raw_route(bad_utf8), grpc.StatusCode.INVALID_ARGUMENT, "UTF-8"),
            (g.balancer.Route(pb.RouteRequest()), grpc.StatusCode.INVALID_ARGUMENT, "'request' is required"),
            (
                g.balancer.Route(route(pb.GenerateRequest(model=MODEL))),
                grpc.StatusCode.INVALID_ARGUMENT,
                "one of 'chat_messages', 'prompt_token_ids' or 'prompt_text'",
            ),
            (
                g.balancer.Route(route(pb.GenerateRequest(prompt_text="hi"))),
                grpc.StatusCode.INVALID_ARGUMENT,
                "'model' is required",
            ),
            (
                g.balancer.Route(route(pb.GenerateRequest(model="gpt-x", prompt_text="hi"))),
                grpc.StatusCode.NOT_FOUND,
                f"known models: {MODEL}",
            ),
            (
                g.balancer.Route(route(token_request(PROMPT, extra_json="[1]"))),
                grpc.StatusCode.INVALID_ARGUMENT,
                "'extra_json' must be a JSON object",
            ),
            (
                g.balancer.Route(route(token_request(PROMPT, extra_json='{"stream": false}'))),
                grpc.StatusCode.INVALID_ARGUMENT,
                "may not set ['stream']",
            ),
            (
                g.balancer.Route(route(token_request(PROMPT, temperature=-1.0))),
                grpc.StatusCode.INVALID_ARGUMENT,
                "'temperature'",
            ),
            (
                g.balancer.Route(route(token_request(list(range(100, 180))))),
                grpc.StatusCode.INVALID_ARGUMENT,
                "over limits.max_prompt_tokens = 64",
            ),
            (
                g.balancer.Route(route(token_request(PROMPT, extra_json='{"n": 129}'))),
                grpc.StatusCode.INVALID_ARGUMENT,
                "'n' must be at most 128 (limits.max_n), got 129",
            ),
            (g.balancer.Release(pb.ReleaseRequest()), grpc.StatusCode.INVALID_ARGUMENT, "'request_id'"),
        ]
        for call, code, detail in cases:
            error = await failure(call)  # type: ignore[arg-type]
            assert (error.code(), detail in error.details()) == (code, True), error.details()
            assert not any(word in error.details() for word in INTERNALS), error.details()
            assert len(dict(error.trailing_metadata() or ())["x-request-id"]) == 32

        oversized = token_request(list(range(1000, 4000)))  # 3000 two-byte varints > 4096 bytes
        assert oversized.ByteSize() > 4096
        for call in (
            g.balancer.Route(route(oversized)),
            g.balancer.Generate(oversized).read(),
            g.admin.Explain(pb.ExplainRequest(request=oversized)),
        ):
            error = await failure(call)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "4096" in error.details()

        # The replica itself refuses (prompt + max_tokens over its 512-token context): its message.
        refused = await failure(g.balancer.Generate(token_request(PROMPT, max_tokens=500)).read())
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "answered 400: prompt (40) + max_tokens (500) exceeds 512" in refused.details()

        for replica in ("r0", "r1"):
            await g.http.admin("POST", f"/admin/replicas/{replica}/drain")
        unavailable = await failure(g.balancer.Generate(token_request(PROMPT)).read())
        assert (
            unavailable.code() == grpc.StatusCode.UNAVAILABLE
            and "no healthy replica" in unavailable.details()
        )
        assert dict(unavailable.trailing_metadata() or ())["retry-after"] == "1"


async def test_a_long_name_echoed_in_a_detail_keeps_the_status_code(tokenizer: Tokenizer) -> None:
    """The SRE walk of 2026-12-01: an unknown model, pool or replica named with 20 000 characters
    came back as RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" (the detail echoing
    the name, percent-encoded in a trailer, passed the client's 16 KiB) instead of NOT_FOUND."""
    async with grpc_running(tokenizer) as g:
        long_ascii, long_utf8 = "x" * 20_000, "é" * 10_000  # é: 2 bytes, 6 once percent-encoded
        for call in (
            g.balancer.Generate(pb.GenerateRequest(model=long_ascii, prompt_text="hi")).read(),
            g.balancer.Route(route(pb.GenerateRequest(model=long_utf8, prompt_text="hi"))),
            g.admin.WhatIf(pb.WhatIfRequest(pool=long_ascii)),
            g.admin.DrainReplica(pb.DrainReplicaRequest(replica_id=long_utf8)),
        ):
            error = await failure(call)
            assert error.code() == grpc.StatusCode.NOT_FOUND, error.details()
            assert "bytes more)" in error.details() and len(error.details().encode()) <= 2_048


async def test_token_id_prompts_are_refused_as_the_http_face_refuses_them(tokenizer: Tokenizer) -> None:
    """Token ids come packed from the message, checked against the same limits as an HTTP body: an
    empty prompt and one over ``limits.max_prompt_tokens`` are refused by Generate, Route and Explain
    with the HTTP face's message (as is a lone surrogate in ``extra_json``); the limit itself passes."""
    async with grpc_running(tokenizer, limits__max_prompt_tokens=64) as g:
        over = list(range(100, 165))
        surrogate = '{"stop": ["\\ud800"]}'
        http_over = await g.http.post("/v1/completions", {"model": MODEL, "prompt": over})
        raw = json.dumps({"model": MODEL, "prompt": PROMPT, "stop": ["\ud800"]}).encode()
        http_surrogate = await g.http.post("/v1/completions", raw)
        assert (http_over.status, http_surrogate.status) == (400, 400)
        cases = [
            (token_request([]), "'prompt_token_ids.ids' must not be empty"),
            (token_request(over), http_over.json()["error"]["message"]),
            (token_request(PROMPT, extra_json=surrogate), http_surrogate.json()["error"]["message"]),
        ]
        for request, message in cases:
            for call in (
                g.balancer.Generate(request).read(),
                g.balancer.Route(route(request)),
                g.admin.Explain(pb.ExplainRequest(request=request)),
            ):
                error = await failure(call)
                assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        assert "over limits.max_prompt_tokens = 64" in cases[1][1] and "lone UTF-16" in cases[2][1]
        at_limit = over[:64]
        routed = await g.balancer.Route(route(token_request(at_limit)))
        assert routed.prompt_tokens == 64
        chunks = [
            chunk async for chunk in g.balancer.Generate(token_request(at_limit, extra_json='{"seed": 1}'))
        ]
        assert chunks[-1].done.usage.prompt_tokens == 64  # the replica got the ids as sent


async def test_health_reflection_and_shutdown(tokenizer: Tokenizer) -> None:
    async with grpc_running(tokenizer) as g:
        health = health_pb2_grpc.HealthStub(g.channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        for service in ("", "kvlb.v1.Admin"):
            assert (await health.Check(health_pb2.HealthCheckRequest(service=service))).status == serving

        async def balancer_serving() -> bool:
            answer = await health.Check(health_pb2.HealthCheckRequest(service="kvlb.v1.Balancer"))
            return bool(answer.status == serving)

        await wait_for("kvlb.v1.Balancer to report SERVING", balancer_serving)
        unknown = await failure(health.Check(health_pb2.HealthCheckRequest(service="nope")))
        assert unknown.code() == grpc.StatusCode.NOT_FOUND

        reflection = reflection_pb2_grpc.ServerReflectionStub(g.channel)
        asks = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvlb.v1.Balancer"),
        ]
        answers = [answer async for answer in reflection.ServerReflectionInfo(iter(asks))]
        services = {s.name for s in answers[0].list_services_response.service}
        assert {"kvlb.v1.Balancer", "kvlb.v1.Admin", "grpc.health.v1.Health"} <= services
        files = answers[1].file_descriptor_response.file_descriptor_proto
        assert files and b"kvlb/v1/balancer.proto" in files[0]

        held = await g.balancer.Route(pb.RouteRequest(request=token_request(PROMPT), reserve=True))
        state = g.http.balancer.state
        assert state is not None
        (router,) = [pool.router for pool in state.pools.values()]
        in_flight = {r: router.in_flight(r) for r in router.space_of}
        assert in_flight == {r: int(r == held.replica_id) for r in router.space_of}
        await g.http.balancer.stop()
        assert all(router.in_flight(r) == 0 for r in router.space_of)  # released at shutdown
        gone = await failure(g.balancer.Route(pb.RouteRequest(request=token_request(PROMPT))))
        assert gone.code() == grpc.StatusCode.UNAVAILABLE


async def test_undecodable_health_and_reflection_messages_are_invalid_argument(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """grpcio's own services decode a message before their code runs: bytes that are no message
    were UNKNOWN and a traceback logged at ERROR on every call (the adversarial run of 2026-11-30,
    branch h-adversary). Now INVALID_ARGUMENT, nothing logged, and the services still answer."""
    caplog.set_level(logging.INFO)
    garbage = b"\xff\xff\xff"
    async with grpc_running(tokenizer) as g:
        calls = [
            g.channel.unary_unary("/grpc.health.v1.Health/Check")(garbage),
            g.channel.unary_unary("/grpc.health.v1.Health/List")(garbage),
        ]
        for call in calls:
            refused = await failure(call)
            assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.details() == "malformed request: the message cannot be decoded"
        watch = g.channel.unary_stream("/grpc.health.v1.Health/Watch")(garbage)
        refused = await failure(watch.read())
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        info = g.channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        refused = await failure(info(iter([garbage])).read())
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []
        health = health_pb2_grpc.HealthStub(g.channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(g.channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        answers = [a async for a in reflection.ServerReflectionInfo(iter([ask]))]
        assert answers and answers[0].list_services_response.service
