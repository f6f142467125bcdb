"""A gRPC ``Generate`` call whose client stops reading gives back what it holds within
``timeouts.client_write_stall_s``: grpc's write of a message waits while HTTP/2 flow control keeps
the client's window shut, so before, such a call held its slot, its replica's stream and load until
``timeouts.total_s``. A real balancer serving gRPC, the fake replica of ``test_http_write_stall``
streaming as fast as kvlb takes it, and real ``grpc.aio`` clients.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from kvlb_harness import MODEL, balancer_over, metric_value
from test_http_write_stall import STALL_S, metrics_text, streaming_replica, wait_metric

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer._proto.kvlb.v1 import balancer_pb2_grpc as pb_grpc

GENERATE = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2, 3, 4]), model=MODEL, max_tokens=4096)
LISTEN = {"host": "127.0.0.1", "port": 0, "grpc_port": 0}


async def test_a_generate_call_whose_client_stops_reading_ends_at_the_bound() -> None:
    """The call's slot, load and replica stream are given back within the bound (the only slot
    is free for the next call), it is counted, and a client that reads again gets what grpc
    had queued, then CANCELLED naming the limit."""
    async with (
        streaming_replica() as (url, streams),
        balancer_over(
            url,
            listen=LISTEN,
            timeouts={"total_s": 60.0, "client_write_stall_s": STALL_S},
            limits={"max_inflight": 1, "max_queued": 0},
        ) as (balancer, session),
        grpc.aio.insecure_channel(f"127.0.0.1:{balancer.grpc_port}") as channel,
    ):
        stub = pb_grpc.BalancerStub(channel)
        call = stub.Generate(GENERATE)
        assert (await call.read()).raw_json  # then nothing is read
        began = time.monotonic()
        await wait_metric(
            session,
            balancer.url,
            "kvlb_http_client_write_stalls_total",
            1,
            10.0,
            face="grpc",
            limit="client_write_stall_s",
        )
        assert time.monotonic() - began < STALL_S * 1.25 + 3.0
        text = await metrics_text(session, balancer.url)
        assert metric_value(text, "kvlb_http_inflight_requests") == 0
        assert metric_value(text, "kvlb_replica_inflight_seqs", replica="r0") == 0
        assert metric_value(text, "kvlb_admission_body_bytes") == 0
        async with asyncio.timeout(5.0):
            while not streams.ended_by_kvlb:  # noqa: ASYNC110 - another component's state
                await asyncio.sleep(0.02)
        # the only slot is free: another call is served
        short = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2, 3, 4]), model=MODEL, max_tokens=1)
        chunks = [chunk async for chunk in stub.Generate(short)]
        assert chunks[-1].HasField("done")
        # the stalled client reads again: what was queued, then the status
        try:
            async with asyncio.timeout(10.0):
                while await call.read() is not grpc.aio.EOF:
                    pass
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.CANCELLED
            assert "client_write_stall_s" in (exc.details() or "")
        else:
            raise AssertionError("the stalled call ended without an error")


async def test_a_generate_client_that_reads_steadily_is_not_cut() -> None:
    """A client reading far slower than the replica answers (grpc's writes waiting for its window),
    but taking messages every tenth of the bound, keeps its call for four times the bound and gets
    all of it. Its window is grpc's default 64 KiB (its BDP probe off): the credit a reader gets
    comes in half windows, so a client whose probe grew its window must read that much faster."""
    async with (
        streaming_replica(2 * 1024 * 1024) as (url, streams),
        balancer_over(url, listen=LISTEN, timeouts={"total_s": 60.0, "client_write_stall_s": STALL_S}) as (
            balancer,
            session,
        ),
        grpc.aio.insecure_channel(
            f"127.0.0.1:{balancer.grpc_port}", options=[("grpc.http2.bdp_probe", 0)]
        ) as channel,
    ):
        call = pb_grpc.BalancerStub(channel).Generate(GENERATE)
        read = 0
        slow_until = time.monotonic() + 4 * STALL_S
        while time.monotonic() < slow_until:
            await asyncio.sleep(STALL_S / 10)
            for _ in range(4):
                await call.read()
                read += 1
        text = await metrics_text(session, balancer.url)
        assert metric_value(text, "kvlb_http_client_write_stalls_total") == 0
        assert metric_value(text, "kvlb_http_inflight_requests") == 1
        last = None
        async with asyncio.timeout(30.0):
            while (chunk := await call.read()) is not grpc.aio.EOF:
                last = chunk
                read += 1
        assert await call.code() == grpc.StatusCode.OK
        assert last is not None and last.HasField("done")
        assert not streams.ended_by_kvlb
