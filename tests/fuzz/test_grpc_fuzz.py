"""gRPC fuzzing: malformed, mutated and oversized messages on every method never crash the server.

Every kvlb method gets random messages: valid ones with hostile field values (unknown models, empty
inputs, NaN temperatures, broken ``extra_json``, huge ``max_tokens``), byte-level mutations of
valid ones (bit flips, truncation, random tails, bogus varints and wire types), random metadata (bad
bearer tokens, garbage ``x-kvlb-weights`` and ``x-request-id``) and messages over
``limits.max_body_bytes``. What must hold for each call: it ends with a client-facing status
(never ``INTERNAL`` or ``UNKNOWN``), its details never leak a traceback, and afterwards the server is
healthy and still serves. ``KVLBTEST_GRPC_FUZZ_CALLS`` sets the number of calls (default 300).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections import Counter
from typing import Any

import grpc
from fuzz_results import save_result
from google.protobuf.message import Message
from grpc_harness import GrpcHarness, grpc_running, token_request
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvlb_harness import MODEL, shared_deepseek

from balancer._proto.kvlb.v1 import balancer_pb2 as pb

CALLS = int(os.environ.get("KVLBTEST_GRPC_FUZZ_CALLS", "300"))
SEED = int(os.environ.get("KVLBTEST_FUZZ_SEED", "20261122"))
MAX_BODY_BYTES = 8192
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
LEAKS = ("Traceback", 'File "', "Exception:")

METHODS: dict[str, bool] = {  # full name → server streaming
    "/kvlb.v1.Balancer/Generate": True,
    "/kvlb.v1.Balancer/Route": False,
    "/kvlb.v1.Balancer/Release": False,
    "/kvlb.v1.Admin/GetPolicy": False,
    "/kvlb.v1.Admin/SetPolicy": False,
    "/kvlb.v1.Admin/Explain": False,
    "/kvlb.v1.Admin/ListReplicas": False,
    "/kvlb.v1.Admin/DrainReplica": False,
    "/kvlb.v1.Admin/WhatIf": False,
}


def generate_request(rng: random.Random) -> pb.GenerateRequest:
    request = pb.GenerateRequest(model=rng.choice((MODEL, MODEL, "", "no-such-model", "\u0000" * 3)))
    which = rng.randrange(4)
    if which == 0:
        ids = [rng.choice((rng.randrange(200), rng.getrandbits(32))) for _ in range(rng.randint(0, 40))]
        request.prompt_token_ids.ids.extend(ids)
    elif which == 1:
        request.prompt_text = rng.choice(
            (
                "hello",
                "",
                "x" * rng.randint(1, 3000),
                "\ufffd\u202e\u0000",
            )
        )
    elif which == 2:
        for _ in range(rng.randint(0, 4)):
            request.chat_messages.messages.add(
                role=rng.choice(("user", "", "system", "\u202e")), content="hi"
            )
    request.max_tokens = rng.choice((0, 1, 2, 3, 4, 2**32 - 1))
    if rng.random() < 0.5:
        request.temperature = rng.choice((0.0, 0.7, -1.0, math.nan, math.inf, 1e308))
    if rng.random() < 0.4:
        request.extra_json = rng.choice(
            ('{"top_p": 0.5}', "{}", "[", "[1]", '{"stream": true}', '{"a": ' * 200, "null")
        )
    if rng.random() < 0.3:
        request.request_id = rng.choice(("r-1", "", "\n\t", "x" * 500))
    if rng.random() < 0.2:
        request.session_key = "s" * rng.randint(0, 300)
    return request


def valid_message(method: str, rng: random.Random) -> Message:
    name = method.rsplit("/", 1)[1]
    if name == "Generate":
        return generate_request(rng)
    if name == "Route":
        return pb.RouteRequest(request=generate_request(rng), reserve=rng.random() < 0.3)
    if name == "Release":
        return pb.ReleaseRequest(request_id=rng.choice(("", "r-1", "x" * 300)))
    if name == "SetPolicy":
        request = pb.SetPolicyRequest()
        if rng.random() < 0.5:
            request.name = rng.choice(("cost", "round_robin", "nope", ""))
        weights = {
            rng.choice(("overlap_credit", "temperature", "bogus", "queue_weight")): rng.choice(
                (0.5, -3.0, 1e300, None, "x")
            )
        }
        request.weights.update(weights)
        if rng.random() < 0.3:
            request.reason = rng.choice(("why", "", "r" * 600, "\u202e\u0000"))
        return request
    if name == "WhatIf":
        what = pb.WhatIfRequest()
        if rng.random() < 0.5:
            what.policy = rng.choice(("cost", "least_load", "round_robin", "nope", ""))
        if rng.random() < 0.3:
            what.pool = rng.choice((MODEL, "", "no-such-pool"))
        if rng.random() < 0.5:
            what.last = rng.choice((0, 1, 5, 2**32 - 1))
        if rng.random() < 0.5:
            what.sample = rng.choice((0, 3, 101, 2**32 - 1))
        what.weights.update(
            {
                rng.choice(("overlap_credit", "temperature", "bogus")): rng.choice(
                    (0.5, -3.0, 1e300, None, "x")
                )
            }
        )
        return what
    if name == "Explain":
        return pb.ExplainRequest(request=generate_request(rng))
    if name == "DrainReplica":
        return pb.DrainReplicaRequest(replica_id=rng.choice(("r0", "r1", "r9", "")), undrain=True)
    return pb.GetPolicyRequest() if name == "GetPolicy" else pb.ListReplicasRequest()


def mutate(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    roll = rng.random()
    if roll < 0.3 and buf:
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    elif roll < 0.5:
        buf = buf[: rng.randint(0, len(buf))]
    elif roll < 0.65:
        buf += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 30)))
    elif roll < 0.75:
        buf += b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, length 2^32 - 1
    elif roll < 0.85:
        buf = bytearray(b"\x0b" * rng.randint(1, 2000))  # unterminated start-group tags (deep nesting)
    else:
        buf += bytes([rng.choice((0x0E, 0x0F, 0x07, 0xF8))]) + b"\x80" * 11  # bad wire types, long varint
    return bytes(buf)


def metadata(rng: random.Random) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    if rng.random() < 0.2:
        out.append(("authorization", rng.choice(("Bearer ", "Basic abc", "Bearer " + "k" * 2000))))
    if rng.random() < 0.2:
        out.append(("x-kvlb-weights", rng.choice(("{", "[]", '{"temperature": -1}', "{}"))))
    if rng.random() < 0.2:
        out.append(("x-request-id", rng.choice(("", "id with spaces", "i" * 200))))
    if rng.random() < 0.1:
        out.append(("x-kvlb-actor", rng.choice(("", "alice", "a" * 100, "  "))))
    return tuple(out)


def payload(method: str, rng: random.Random) -> bytes:
    data = valid_message(method, rng).SerializeToString()
    roll = rng.random()
    if roll < 0.45:
        return data
    if roll < 0.95:
        return mutate(data, rng)
    return b"\x22" + (MAX_BODY_BYTES + 10).to_bytes(2, "little") + b"a" * (MAX_BODY_BYTES + 10)  # oversized


async def call(
    g: GrpcHarness, method: str, data: bytes, meta: tuple[tuple[str, str], ...]
) -> tuple[grpc.StatusCode, str]:
    identity: Any = lambda raw: raw  # noqa: E731 - bytes in, bytes out
    try:
        if METHODS[method]:
            stream = g.channel.unary_stream(
                method, request_serializer=identity, response_deserializer=identity
            )
            async for _ in stream(data, metadata=meta, timeout=15):
                pass
        else:
            unary = g.channel.unary_unary(method, request_serializer=identity, response_deserializer=identity)
            await unary(data, metadata=meta, timeout=15)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def test_mutated_messages_get_client_facing_statuses_and_the_server_survives() -> None:
    rng = random.Random(SEED)
    started = time.perf_counter()
    slowest_s = 0.0
    codes: Counter[str] = Counter()
    limits = {"limits__max_body_bytes": MAX_BODY_BYTES, "limits__max_prompt_tokens": 256}
    async with grpc_running(shared_deepseek(), **limits) as g:
        for index in range(CALLS):
            method = rng.choice(sorted(METHODS))
            data, meta = payload(method, rng), metadata(rng)
            begin = time.perf_counter()
            code, details = await call(g, method, data, meta)
            slowest_s = max(slowest_s, time.perf_counter() - begin)
            codes[code.name] += 1
            where = f"call {index}: {method} {data[:80].hex()} {meta}"
            assert code not in FORBIDDEN, f"{where} -> {code.name}: {details}"
            assert not any(leak in details for leak in LEAKS), f"{where} leaked: {details}"
        print(f"\ngrpc fuzz: {CALLS} calls: {dict(codes)}")
        figures = {
            "payloads": CALLS,
            "seconds": round(time.perf_counter() - started, 1),
            "slowest_ms": round(slowest_s * 1000, 1),
            "outcomes": dict(codes),
        }
        save_result("fuzz_grpc", figures)
        assert codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0
        health = health_pb2_grpc.HealthStub(g.channel)
        for replica in ("r0", "r1"):
            await g.http.admin("POST", f"/admin/replicas/{replica}/undrain")
        answer = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        chunks = [chunk async for chunk in g.balancer.Generate(token_request(list(range(100, 140))))]
        assert chunks[-1].done.replica_id in ("r0", "r1")
