"""Shared set-up of the gRPC integration tests: the HTTP harness's replicas and balancer, with the gRPC
server on a free port of 127.0.0.1 and a real ``grpc.aio`` channel to it (nothing is mocked)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from kvlb_harness import MODEL, Harness, running

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer._proto.kvlb.v1 import balancer_pb2_grpc as pb_grpc
from balancer.tokenizer.tokenizer import Tokenizer

Metadata = tuple[tuple[str, str], ...]


@dataclass
class GrpcHarness:
    http: Harness
    channel: grpc.aio.Channel
    balancer: pb_grpc.BalancerStub
    admin: pb_grpc.AdminStub


@asynccontextmanager
async def grpc_running(tokenizer: Tokenizer, count: int = 2, **overrides: Any) -> AsyncIterator[GrpcHarness]:
    """``count`` emulated replicas and a ready balancer serving gRPC too (``overrides`` as in
    :func:`kvlb_harness.settings_for`)."""
    async with running(tokenizer, count, listen__grpc_port=0, **overrides) as h:
        port = h.balancer.grpc_port
        assert port, "the balancer did not start its gRPC server"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield GrpcHarness(h, channel, pb_grpc.BalancerStub(channel), pb_grpc.AdminStub(channel))


def bearer(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


def token_request(prompt: list[int], max_tokens: int = 2, **fields: Any) -> pb.GenerateRequest:
    """A greedy token-id request for the harness's model; ``fields`` override any field."""
    defaults: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0}
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), **{**defaults, **fields})


async def failure(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    """The error ``call`` ends with (the test fails if it succeeds)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value
