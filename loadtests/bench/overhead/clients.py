"""How ``kvlb bench overhead`` sends one request (I/O): an HTTP POST read to its end, or, for the gRPC
kinds (:data:`~loadtests.bench.overhead.workload.GRPC_KINDS`) on the kvlb paths, one
``kvlb.v1.Balancer/Generate`` call read to its last chunk.

Each is a :data:`Send`: a body of the kind (the JSON the HTTP paths get) → the request's latency in
seconds. A gRPC send takes the message built from that body before the run (:func:`generate_message`),
so the client's own conversion is not timed. A :class:`GrpcClient` holds ``connections`` channels,
each its own HTTP/2 connection, taken in turn: one connection would reach one worker of ``kvlb serve
--workers N`` only, since the kernel spreads connections, not calls, over the workers' shared port.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp
import grpc

from balancer._proto.kvlb.v1 import balancer_pb2 as pb

Send = Callable[[bytes], Awaitable[float]]
"""One request of the given body, read to its end; its latency in seconds (raises :class:`BenchError`)."""

REQUEST_TIMEOUT_S = 30.0
JSON_HEADERS = {"Content-Type": "application/json"}
GENERATE = "/kvlb.v1.Balancer/Generate"


class BenchError(RuntimeError):
    """A request of the benchmark failed (the figures would be wrong)."""


async def send(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    """One streamed HTTP request, read to its end."""
    started = time.perf_counter()
    async with session.post(url, data=body, headers=JSON_HEADERS) as response:
        data = await response.read()
    latency_s = time.perf_counter() - started
    if response.status != 200 or not data.endswith(b"data: [DONE]\n\n"):
        raise BenchError(f"{url} answered {response.status}: {data[:300]!r}")
    return latency_s


def generate_message(body: bytes) -> bytes:
    """A bench ``/v1/completions`` body of token ids (``model``, ``prompt``, ``max_tokens``; it always
    streams, as ``Generate`` does) as a serialized ``GenerateRequest``."""
    fields = json.loads(body)
    request = pb.GenerateRequest(
        model=fields["model"],
        prompt_token_ids=pb.TokenIds(ids=fields["prompt"]),
        max_tokens=fields.get("max_tokens", 0),
    )
    return request.SerializeToString()


class GrpcClient:
    """``Generate`` calls to one kvlb path over ``connections`` channels (see the module docstring)."""

    def __init__(self, address: str, bodies: Iterable[bytes], connections: int) -> None:
        # a local subchannel pool: channels to one address would share one connection otherwise
        options = [("grpc.use_local_subchannel_pool", 1)]
        self.address = address
        self._channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(connections)]
        self._calls: Any = itertools.cycle(
            [
                c.unary_stream(GENERATE, response_deserializer=pb.GenerateChunk.FromString)
                for c in self._channels
            ]
        )
        self._messages = {body: generate_message(body) for body in set(bodies)}

    async def send(self, body: bytes) -> float:
        """One ``Generate`` call of ``body``'s message, read to its last chunk."""
        started = time.perf_counter()
        call = next(self._calls)(self._messages[body], timeout=REQUEST_TIMEOUT_S)
        chunks: list[pb.GenerateChunk] = []
        try:
            async for chunk in call:
                chunks.append(chunk)
        except grpc.aio.AioRpcError as exc:
            raise BenchError(f"{self.address} Generate ended {exc.code().name}: {exc.details()}") from None
        latency_s = time.perf_counter() - started
        if len(chunks) < 2 or not chunks[-1].HasField("done"):
            raise BenchError(f"{self.address} Generate ended without its done chunk ({len(chunks)} chunks)")
        return latency_s

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
