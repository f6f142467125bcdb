"""gRPC messages inside the byte budget (``limits.max_inflight_body_bytes``) over real sockets: a
balancer and an emulated replica on 127.0.0.1, a real ``grpc.aio`` client. A call reserves
``limits.max_body_bytes`` before its message is received; while the budget is full the message stays
at the client (HTTP/2 flow control: its write does not complete), auth comes before the read, one
message exactly, and every byte comes back however the call ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from grpc_harness import GrpcHarness, bearer, failure, grpc_running, token_request
from kvlb_harness import metric_value, shared_deepseek, wait_for

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.tokenizer.tokenizer import Tokenizer
from loadtests.faults.body_budget import padded_message

MIB = 1024 * 1024
MESSAGE_BYTES = 4 * MIB
BUDGET_BYTES = 16 * MIB
LIMITS = {
    "limits__max_body_bytes": MESSAGE_BYTES + 64 * 1024,  # each call reserves this before its read
    "limits__max_inflight_body_bytes": BUDGET_BYTES,  # three reservations, not four
}
SLACK_BYTES = 4096
"""What the calls in flight add without waiting (the JSON they forward and their ids: a few hundred
bytes each), by which the bytes held may pass the budget."""
GENERATE = "/kvlb.v1.Balancer/Generate"
ROUTE = "/kvlb.v1.Balancer/Route"


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def padded(message: Any, size: int = MESSAGE_BYTES) -> bytes:
    """``message`` serialized, padded to ``size`` bytes by an unknown field (received and parsed, but
    neither forwarded nor routed on)."""
    return padded_message(message.SerializeToString(), size)


def generate_bytes(first: int, max_tokens: int = 8, size: int = MESSAGE_BYTES) -> bytes:
    return padded(token_request([first, 2, 3, 4], max_tokens=max_tokens), size)


async def held_bytes(g: GrpcHarness) -> float:
    async with g.http.session.get(g.http.url + "/metrics") as response:
        return metric_value(await response.text(), "kvlb_admission_body_bytes")


async def is_zero(g: GrpcHarness) -> bool:
    return await held_bytes(g) == 0


def queued(g: GrpcHarness) -> int:
    return g.http.balancer.state.admission.queued


async def raw_generate(g: GrpcHarness, data: bytes, **kwargs: Any) -> list[pb.GenerateChunk]:
    """A ``Generate`` of ``data`` as it is on the wire; every chunk of its answer."""
    call = g.channel.unary_stream(GENERATE, response_deserializer=pb.GenerateChunk.FromString)(data, **kwargs)
    return [chunk async for chunk in call]


class CountingProxy:
    """A TCP relay on 127.0.0.1 to the balancer's gRPC port that counts the bytes the client sent
    through it (what kvlb's gRPC server was let to receive); with ``stall_after_bytes`` it passes on
    no more than that many, as a client stalling mid-message; :meth:`drop` is the client going away."""

    def __init__(self, port: int, stall_after_bytes: int | None = None) -> None:
        self.port = port
        self.stall_after_bytes = stall_after_bytes
        self.sent_bytes = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: bool) -> None:
        try:
            while data := await reader.read(65536):
                if count:
                    stall = self.stall_after_bytes
                    if stall is not None and self.sent_bytes + len(data) > stall:
                        data = data[: max(0, stall - self.sent_bytes)]
                    self.sent_bytes += len(data)
                writer.write(data)
                await writer.drain()
                if count and self.sent_bytes == self.stall_after_bytes:
                    await asyncio.Event().wait()  # until drop()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += (writer, up_writer)
        for task in (self._pump(reader, up_writer, True), self._pump(up_reader, writer, False)):
            self._tasks.add(asyncio.create_task(task))

    async def drop(self) -> None:
        """Close every connection through the relay, both ways."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()

    @asynccontextmanager
    async def channel(self) -> AsyncIterator[grpc.aio.Channel]:
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                yield channel
        finally:
            server.close()
            await self.drop()
            await server.wait_closed()


@asynccontextmanager
async def budget_full(g: GrpcHarness) -> AsyncIterator[None]:
    """Three slow ``Generate`` calls of 4 MiB in flight (their first chunk read): the budget has no
    room for a fourth reservation. They are cancelled on exit."""
    calls = []
    try:
        for index in range(3):
            call = g.channel.unary_stream(GENERATE, response_deserializer=pb.GenerateChunk.FromString)(
                generate_bytes(10 + index, max_tokens=60)
            )
            calls.append(call)
            assert (await call.read()).index == 0
        assert 3 * MESSAGE_BYTES <= await held_bytes(g) <= BUDGET_BYTES
        yield
    finally:
        for call in calls:
            call.cancel()


async def test_a_burst_of_large_messages_never_holds_more_than_the_budget(tokenizer: Tokenizer) -> None:
    """Twelve ``Generate`` calls of 4 MiB at once with room for three: the bytes held (sampled) never
    pass the budget, each call ends OK or RESOURCE_EXHAUSTED/UNAVAILABLE with ``retry-after``, and
    every byte comes back."""
    async with grpc_running(
        tokenizer, 1, time_scale=0.25, limits__max_queued=4, limits__queue_timeout_s=2.0, **LIMITS
    ) as g:
        peak = 0.0
        done = asyncio.Event()

        async def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, await held_bytes(g))
                await asyncio.sleep(0.005)

        async def send(index: int) -> grpc.StatusCode:
            try:
                chunks = await raw_generate(g, generate_bytes(100 + index), timeout=30.0)
            except grpc.aio.AioRpcError as error:
                assert error.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
                assert "max_inflight_body_bytes" in (error.details() or "")
                assert int(dict(error.trailing_metadata() or ())["retry-after"]) >= 1
                return error.code()
            assert chunks[-1].HasField("done")
            return grpc.StatusCode.OK

        sampler = asyncio.create_task(sample())
        codes = await asyncio.gather(*(send(i) for i in range(12)))
        done.set()
        await sampler
        assert codes.count(grpc.StatusCode.OK) >= 3, codes
        # a call's parse holds its parsed copy (4 MiB) beside its bytes for a moment, as a tokenizing
        # hold: it may pass the budget alone (one parse at a time), never more
        assert MESSAGE_BYTES <= peak <= BUDGET_BYTES + MESSAGE_BYTES + SLACK_BYTES, peak
        await wait_for("every byte given back", lambda: is_zero(g), timeout_s=5.0)
        async with g.http.session.get(g.http.url + "/metrics") as response:
            shed = metric_value(await response.text(), "kvlb_admission_shed_total", reason="body_bytes")
        assert shed == 12 - codes.count(grpc.StatusCode.OK)


async def test_a_call_whose_message_is_in_holds_its_bytes_not_the_reservation(tokenizer: Tokenizer) -> None:
    """A small ``Generate`` reserves ``limits.max_body_bytes`` before its read; once the message is
    in, the rest comes back: while it streams it holds its message, the JSON it forwards and its ids
    (a few hundred bytes), not the reservation."""
    async with grpc_running(tokenizer, 1, time_scale=0.05, **LIMITS) as g:
        message = token_request([80, 2, 3, 4], max_tokens=60).SerializeToString()
        call = g.channel.unary_stream(GENERATE, response_deserializer=pb.GenerateChunk.FromString)(message)
        try:
            assert (await call.read()).index == 0  # in flight, streaming
            held = await held_bytes(g)
            assert len(message) <= held <= len(message) + SLACK_BYTES, held
        finally:
            call.cancel()
        await wait_for("every byte given back", lambda: is_zero(g), timeout_s=5.0)


async def test_a_message_stays_at_the_client_while_the_budget_is_full(tokenizer: Tokenizer) -> None:
    """With the budget full, a ``Generate`` and a ``Route`` of 4 MiB wait for their reservation: their
    writes do not complete (grpc has not received the messages) and the bytes held stay within the
    budget; once the budget frees, both are received and answered."""
    async with grpc_running(
        tokenizer, 1, time_scale=0.05, limits__max_queued=8, limits__queue_timeout_s=20.0, **LIMITS
    ) as g:
        async with budget_full(g):  # a call starts as it is made: made now, it finds no room
            generate = g.channel.stream_stream(GENERATE, response_deserializer=pb.GenerateChunk.FromString)()
            route = g.channel.stream_unary(ROUTE, response_deserializer=pb.RouteResponse.FromString)()
            writes = [
                asyncio.create_task(generate.write(generate_bytes(30))),
                asyncio.create_task(route.write(padded(pb.RouteRequest(request=token_request([31, 2, 3]))))),
            ]
            await wait_for("both calls queued", lambda: asyncio.sleep(0, queued(g) == 2), timeout_s=5.0)
            finished, _ = await asyncio.wait(writes, timeout=1.0)
            assert not finished, "a message was received while the budget had no room for it"
            assert await held_bytes(g) <= BUDGET_BYTES
        await asyncio.wait_for(asyncio.gather(*writes), timeout=10.0)
        await generate.done_writing()
        await route.done_writing()
        chunks = [chunk async for chunk in generate]
        assert chunks[-1].HasField("done")
        assert (await route).replica_id == "r0"
        await wait_for("every byte given back", lambda: is_zero(g), timeout_s=5.0)


async def test_an_admin_call_is_answered_while_the_budget_is_full(tokenizer: Tokenizer) -> None:
    """Admin methods read their message outside the budget, as ``/admin`` over HTTP does: an SRE's
    call is not queued behind the traffic it manages."""
    async with (
        grpc_running(
            tokenizer, 1, time_scale=0.05, limits__max_queued=8, limits__queue_timeout_s=20.0, **LIMITS
        ) as g,
        budget_full(g),
    ):
        replicas = await asyncio.wait_for(g.admin.ListReplicas(pb.ListReplicasRequest()), timeout=2.0)
        assert [r.id for r in replicas.replicas] == ["r0"]
        policy = await asyncio.wait_for(g.admin.GetPolicy(pb.GetPolicyRequest()), timeout=2.0)
        assert policy.version >= 1
        assert queued(g) == 0


async def test_an_unauthenticated_call_is_refused_before_its_message_is_received(
    tokenizer: Tokenizer,
) -> None:
    """Auth comes before the read: a call without a key gets UNAUTHENTICATED and kvlb lets in no more
    than the flow-control window of its 4 MiB message (counted by a relay in front of the port), for
    Generate, Route and an admin method; with the key, the whole message goes through."""
    async with grpc_running(tokenizer, 1, auth__api_keys=["k1"], auth__admin_token="adm", **LIMITS) as g:
        proxy = CountingProxy(g.http.balancer.grpc_port)
        async with proxy.channel() as channel:
            for path in (GENERATE, ROUTE, "/kvlb.v1.Admin/Explain"):
                before = proxy.sent_bytes
                call = channel.stream_stream(path)()
                write = asyncio.create_task(call.write(generate_bytes(40)))
                error = await failure(call.read())
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED, path
                with contextlib.suppress(BaseException):  # it may end with the call, or raise
                    await asyncio.wait_for(write, timeout=5.0)
                assert write.done()
                await asyncio.sleep(0.2)
                assert proxy.sent_bytes - before < MIB, (path, proxy.sent_bytes - before)
            before = proxy.sent_bytes
            call = channel.unary_stream(GENERATE, response_deserializer=pb.GenerateChunk.FromString)(
                generate_bytes(41), metadata=bearer("k1")
            )
            chunks = [chunk async for chunk in call]
            assert chunks[-1].HasField("done")
            assert proxy.sent_bytes - before > MESSAGE_BYTES
        assert await held_bytes(g) == 0


async def test_a_call_is_answered_from_its_first_message(tokenizer: Tokenizer) -> None:
    """No message → INVALID_ARGUMENT; two → answered from the first, the second never read (Generate
    and Route); one over ``max_body_bytes`` → RESOURCE_EXHAUSTED (grpc's check, as the handler reads
    it); every byte comes back."""
    async with grpc_running(tokenizer, 1, **LIMITS) as g:
        message = token_request([50, 2, 3]).SerializeToString()
        for path in (GENERATE, ROUTE):
            route = pb.RouteRequest(request=token_request([50, 2, 3])).SerializeToString()
            body = message if path == GENERATE else route
            call = g.channel.stream_stream(path)()
            await call.done_writing()
            error = await failure(call.read())
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, path
            assert "no request message" in (error.details() or ""), error.details()
            call = g.channel.stream_stream(path, response_deserializer=bytes)()
            for _ in range(2):
                await call.write(body)
            await call.done_writing()
            answers = [answer async for answer in call]
            assert answers, path
            assert await call.code() == grpc.StatusCode.OK, (path, await call.details())
        oversized = generate_bytes(51, size=LIMITS["limits__max_body_bytes"] + 1)  # grpc's own refusal
        error = await failure(raw_generate(g, oversized))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await held_bytes(g) == 0


async def test_a_client_going_away_while_it_waits_or_mid_read_gives_every_byte_back(
    tokenizer: Tokenizer,
) -> None:
    """Calls cancelled or past their deadline while they wait for a reservation, and a client whose
    connection drops in the middle of its message (the call holds its reservation until then): the
    queue empties and the bytes held return to 0."""
    async with grpc_running(
        tokenizer, 1, time_scale=0.05, limits__max_queued=8, limits__queue_timeout_s=20.0, **LIMITS
    ) as g:
        async with budget_full(g):
            waiting = g.channel.stream_stream(GENERATE)()
            write = asyncio.create_task(waiting.write(generate_bytes(60)))
            route = g.channel.stream_unary(ROUTE)(timeout=0.5)
            route_write = asyncio.create_task(route.write(padded(pb.RouteRequest(), MESSAGE_BYTES)))
            await wait_for("both calls queued", lambda: asyncio.sleep(0, queued(g) == 2), timeout_s=5.0)
            waiting.cancel()
            # the client reports its write cut short by the deadline as INTERNAL "from Core"
            error = await failure(route)
            assert error.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL), error
            await wait_for("the queue empty", lambda: asyncio.sleep(0, queued(g) == 0), timeout_s=5.0)
            for task in (write, route_write):
                with contextlib.suppress(BaseException):  # the call ended under the write
                    await asyncio.wait_for(task, timeout=5.0)
                assert task.done()
        await wait_for("every byte given back", lambda: is_zero(g), timeout_s=5.0)

        proxy = CountingProxy(g.http.balancer.grpc_port, stall_after_bytes=MIB)
        async with proxy.channel() as channel:
            call = channel.stream_stream(GENERATE)()
            write = asyncio.create_task(call.write(generate_bytes(70)))
            reserved = LIMITS["limits__max_body_bytes"]
            await wait_for("a message half received", lambda: asyncio.sleep(0, proxy.sent_bytes == MIB))
            assert await held_bytes(g) == reserved  # its reservation, while its message comes in
            await proxy.drop()  # the client goes away mid-message
            await wait_for("every byte given back", lambda: is_zero(g), timeout_s=5.0)
            call.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(write, timeout=5.0)
        chunks = await raw_generate(g, generate_bytes(71))
        assert chunks[-1].HasField("done")
        assert await held_bytes(g) == 0
