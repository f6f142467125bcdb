"""The gRPC front (I/O): ``kvlb.v1.Balancer`` and ``kvlb.v1.Admin`` on one ``grpc.aio`` server, with
the standard health and reflection services. The contract is ``proto/kvlb/v1/balancer.proto``.

* ``Generate`` runs the HTTP face's own path (:func:`balancer.service.dispatch.dispatch`: route and
  commit → forward with retries before the first byte → relay → release). The replica is always asked for an
  event stream with usage; each of its events becomes one ``GenerateChunk`` (raw JSON plus the text
  delta), and a last chunk carries the replica, the predicted and reported cached tokens and the usage.
  A replica failing mid-stream ends the call with UNAVAILABLE after the chunks already sent; a client
  going away (or its deadline passing) closes the upstream response so the replica stops generating.
  A client that takes no message for ``timeouts.client_write_stall_s`` (grpc's write waits while
  HTTP/2 flow control keeps its window shut), or has one still waiting at ``timeouts.total_s``, ends
  the call with CANCELLED (:func:`client_stalled`), its slot, bytes, load and replica stream given
  back at once.
* ``Route`` is the decision only. With ``reserve`` it is committed like a forwarded request and held
  in :class:`Reservations` until ``Release`` or ``timeouts.total_s``: at most ``limits.max_inflight``
  of them and ``limits.max_reserved_bytes`` of their token ids and keys (:func:`reservation_bytes`).
* Limits: ``grpc.max_receive_message_length`` is ``limits.max_body_bytes`` (grpc refuses a larger
  message with RESOURCE_EXHAUSTED); admission, prompt and timeout limits are the HTTP API's. Every
  method is served as a stream-request method that reads its one message itself
  (:func:`balancer.api.grpc.calls.receive`), with the BDP probe off so that HTTP/2 flow control
  keeps an unread message at the client (about its 64 KiB window reaches kvlb). Before the read a call
  reserves ``limits.max_body_bytes`` of ``limits.max_inflight_body_bytes``, as an HTTP body its
  declared length: ``Generate`` with its admission slot, ``Route`` and ``Release`` bytes only
  (``Route`` still takes no slot), the admin methods not at all (as ``/admin`` over HTTP); once the
  message is in, the rest is given back. ``Generate`` then holds
  the message's bytes, the JSON body it forwards and the token ids, and (``Route`` too) the
  estimate of the parsed chat or text prompt and of the tokenizer's work while it waits for and runs
  in the tokenizer's threads (:func:`~balancer.api.openai.tokenizing_hold_bytes`); the parsed
  protobuf message is held until the call ends (:func:`~balancer.api.grpc.calls.parse_held`), and a
  message of 256 KiB or more holds the estimate of its parse and of its conversion to the OpenAI
  body while they run (:mod:`balancer.api.parse_cost`).
* Health: ``""`` and ``kvlb.v1.Admin`` are SERVING while the server runs; ``kvlb.v1.Balancer``
  follows readiness (``/readyz``); all go NOT_SERVING when shutdown starts.
* The health and reflection services are grpcio's own, which decode their messages before their
  code runs: :class:`UndecodableRequests` makes a message they cannot decode an INVALID_ARGUMENT
  (grpcio answered UNKNOWN and logged a traceback at ERROR, for any client, every call).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.client_writes import ClientWrites
from balancer.api.errors import ApiError
from balancer.api.grpc.admin import ADMIN_SERVICE, admin_handlers
from balancer.api.grpc.calls import Call, CallError, method_handler, no_parts
from balancer.api.grpc.messages import (
    decision_message,
    error_body_text,
    openai_call,
    read_chunk,
)
from balancer.api.openai import (
    SSE_CONTENT_TYPE,
    Reparsed,
    check_sequences,
    find_pool,
    hold_parse,
    tokenize_held,
    tokenize_in_thread,
    tokenize_inline,
)
from balancer.api.parse_cost import PARSE_HOLD_MIN_BYTES, chat_convert_bytes
from balancer.api.parsing import ParsedRequest
from balancer.errors import ConfigError, UpstreamError, bind_error
from balancer.index.hashing import TOKEN_ID_BYTES
from balancer.routing.left_out import left_out_names
from balancer.routing.router import Lease, RoutePlan
from balancer.service.dispatch import (
    Forward,
    Opened,
    commit,
    dispatch,
    failure_message,
    on_first_chunk,
    on_relayed,
    relay_deadline,
    select,
)
from balancer.service.state import ServiceState
from balancer.service.tls import grpc_key_pair
from balancer.upstream.client import forwardable_headers
from balancer.upstream.sse import SseEvents

log = logging.getLogger(__name__)

BALANCER_SERVICE: str = pb.DESCRIPTOR.services_by_name["Balancer"].full_name
MAX_ERROR_BODY_BYTES = 64 * 1024
"""Most of a replica's error answer read to quote its message."""
MAINTENANCE_INTERVAL_S = 1.0
"""Longest period of the reservation expiry and health refresh (shorter with ``health_interval_s``)."""


RESERVATION_BYTES = 1024
"""What a reservation holds besides its token ids and keys (:func:`reservation_bytes`): its lease,
plan and decision and the dict slots (the decision's per-replica terms are shared with the console's
decision ring, which bounds them itself)."""
RESERVED_KEY_BYTES = 44
"""A reserved plan's block key: a pointer in its tuple and the key's int (36 bytes traced; shared
with the prefix table and the key memo while they hold it, so an upper bound). ``tracemalloc`` of 40
reservations of 8,192 ids over gRPC (2,048 keys each): their ids 32 KiB, their keys' tuple 16 KiB
and the keys' ints 72 KiB each, where this counts 121 KiB; the rest of what the process grew by is
held by the structures with bounds of their own (the speculative entries, the key and token-id
memos, the console's decision ring)."""


def reservation_bytes(plan: RoutePlan) -> int:
    """What a reservation of ``plan`` counts against ``limits.max_reserved_bytes`` (pure, O(1)):
    its token ids (4 bytes each, as the request path keeps them), its keys
    (:data:`RESERVED_KEY_BYTES` each) and :data:`RESERVATION_BYTES`."""
    return RESERVATION_BYTES + TOKEN_ID_BYTES * len(plan.token_ids) + RESERVED_KEY_BYTES * len(plan.keys)


class Reservations:
    """Decisions reserved by ``Route(reserve=true)``: at most ``capacity`` at once and ``max_bytes``
    of them (:func:`reservation_bytes`), each held until released or for ``ttl_s`` (then released by
    :meth:`expire`, so a lost ``Release`` cannot pin load). ``on_refused`` is told the bound
    (``count``, ``bytes``) of each reservation refused at its cap (metric)."""

    def __init__(
        self,
        capacity: int,
        ttl_s: float,
        max_bytes: int = 256 * 1024 * 1024,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._on_refused = on_refused
        self._held: dict[str, tuple[Lease, float, int]] = {}
        self.held_bytes = 0
        """The bytes counted for the reservations held (at most :attr:`max_bytes`)."""
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._held)

    def check(self, request_id: str, now: float, size: int = 0) -> None:
        """Raise unless a reservation for ``request_id`` of ``size`` bytes can be held now (call
        before committing)."""
        self.expire(now)
        if request_id in self._held:
            raise CallError(grpc.StatusCode.ALREADY_EXISTS, f"a reservation for {request_id!r} is held")
        if len(self._held) >= self.capacity:
            self._refused("count")
            raise CallError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.capacity} reservations are held (the cap)", 1.0
            )
        if self.held_bytes + size > self.max_bytes:
            self._refused("bytes")
            raise CallError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the reservations held count {self.held_bytes} bytes; this one's {size} would pass "
                f"limits.max_reserved_bytes ({self.max_bytes})",
                1.0,
            )

    def _refused(self, bound: str) -> None:
        if self._on_refused is not None:
            self._on_refused(bound)

    def hold(self, request_id: str, lease: Lease, now: float, size: int = 0) -> None:
        self._held[request_id] = (lease, now + self.ttl_s, size)
        self.held_bytes += size

    def pop(self, request_id: str, now: float) -> Lease | None:
        self.expire(now)
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        self.held_bytes -= held[2]
        return held[0]

    def expire(self, now: float) -> int:
        """Release reservations past their TTL; returns how many. Insertion order is expiry order."""
        count = 0
        while self._held:
            request_id, (lease, expires_at, size) = next(iter(self._held.items()))
            if expires_at > now:
                break
            del self._held[request_id]
            self.held_bytes -= size
            lease.release(now)
            count += 1
        self.expired_total += count
        return count

    def release_all(self, now: float) -> None:
        held, self._held = self._held, {}
        self.held_bytes = 0
        for lease, _, _ in held.values():
            lease.release(now)


@dataclass(slots=True)
class _Progress:
    """What a relayed stream said so far."""

    index: int = 0
    finish_reason: str = ""
    usage: pb.Usage | None = None
    error: str | None = None


async def prepare(
    state: ServiceState,
    request: pb.GenerateRequest,
    call: Call,
    arrived: float,
    *,
    stream: bool,
    raw: bytes = b"",
) -> Forward:
    """Validate ``request`` as the HTTP API validates a body, find its pool, weights and token ids.
    Token ids come packed from the message (:func:`~balancer.api.grpc.messages.openai_call`): no JSON
    is decoded; runs of their packed varints are memoised in ``state.token_id_memo`` beside the HTTP
    face's runs of id text. ``raw``: the bytes ``request`` was parsed from, if at hand (their varints
    are looked up as they came, not serialized again). A message of 256 KiB or more holds the estimate
    of its conversion to the OpenAI body (:func:`~balancer.api.parse_cost.chat_convert_bytes`) while
    it is made (:func:`~balancer.api.openai.hold_parse`)."""
    admission = call.admission
    convert_bytes = 0
    if admission is not None and call.message_bytes >= PARSE_HOLD_MIN_BYTES:
        chats, ids = generate_parts(request)
        convert_bytes = chat_convert_bytes(call.message_bytes, chats, request.extra_json, ids)
    if convert_bytes:
        assert admission is not None
        await hold_parse(admission, convert_bytes, state, "grpc")
        try:
            openai = openai_call(request, stream=stream, memo=state.token_id_memo, raw=raw)
        finally:
            admission.give_back_tokenizing()
    else:
        openai = openai_call(request, stream=stream, memo=state.token_id_memo, raw=raw)
    parsed = openai.parsed
    check_sequences(parsed, state.settings.limits.max_n)
    pool = find_pool(state, parsed.model)
    weights = call.weights()
    max_prompt_tokens = state.settings.limits.max_prompt_tokens
    token_ids = tokenize_inline(pool, parsed, max_prompt_tokens)
    if token_ids is None:  # to a thread: its parsed form and the tokenizer's work are held
        if admission is not None:
            made = [openai]

            def make() -> ParsedRequest:
                made.append(openai_call(request, stream=stream, memo=state.token_id_memo, raw=raw))
                return made[-1].parsed

            form = Reparsed(parsed, make, made.clear)
            del openai, parsed  # only ``made`` and ``form`` hold them: dropped while it waits for its bytes
            token_ids = await tokenize_held(admission, pool, form, max_prompt_tokens)
            openai = made[-1]
            parsed = openai.parsed
        else:
            token_ids = await tokenize_in_thread(pool, parsed, max_prompt_tokens)
    return Forward(
        pool,
        token_ids,
        weights,
        parsed.session_key,
        parsed.max_tokens,
        openai.body,
        openai.path,
        call.request_id,
        arrived,
        call.metadata.get(state.settings.tenant_header.lower()),
        sequences=parsed.sequences,  # OpenAI's ``n`` (``extra_json``): the load counts every sequence
    )


def chat_messages(request: pb.GenerateRequest) -> int:
    """How many chat messages ``request`` holds (0 for a prompt)."""
    return len(request.chat_messages.messages) if request.HasField("chat_messages") else 0


def generate_parts(request: pb.GenerateRequest) -> tuple[int, int]:
    """The chat messages and token ids of ``request`` (``parts`` of
    :func:`~balancer.api.grpc.calls.method_handler`)."""
    ids = len(request.prompt_token_ids.ids) if request.HasField("prompt_token_ids") else 0
    return chat_messages(request), ids


def route_parts(request: pb.RouteRequest) -> tuple[int, int]:
    """:func:`generate_parts` of a ``RouteRequest``'s request."""
    return generate_parts(request.request) if request.HasField("request") else (0, 0)


def client_stalled(state: ServiceState, writes: ClientWrites) -> CallError:
    """The end of a ``Generate`` call whose client stopped reading (:attr:`ClientWrites.writing`),
    counted in ``kvlb_http_client_write_stalls_total`` by the limit that ended it. The call ends
    with CANCELLED, and its slot, bytes, replica stream and load are given back at once; the status
    reaches the client after the messages grpc already queued for it, if it reads again (grpcio has
    no public way for a server to reset one stream, and the connection may carry other calls)."""
    metrics = state.metrics
    if writes.stalled:
        limit = "client_write_stall_s"
        stall_s = state.settings.timeouts.client_write_stall_s
        message = f"the client took no message for timeouts.client_write_stall_s = {stall_s}s"
    else:
        limit = "total_s"
        message = (
            f"the client did not read its answer by timeouts.total_s = {state.settings.timeouts.total_s}s"
        )
    metrics.children.of(metrics.client_write_stalls_total, "grpc", limit).inc()
    return CallError(grpc.StatusCode.CANCELLED, message)


class BalancerService:
    """``kvlb.v1.Balancer``: Generate, Route, Release."""

    def __init__(self, state: ServiceState, reservations: Reservations) -> None:
        self.state = state
        self.reservations = reservations

    def handlers(self) -> Any:
        name = BALANCER_SERVICE

        def handler(
            method: str,
            run: Any,
            request: Any,
            response: Any,
            streaming: bool = False,
            shape: str = "plain",
            parts: Any = no_parts,
        ) -> Any:
            return method_handler(
                self.state,
                f"/{name}/{method}",
                "client",
                run,
                request,
                response,
                streaming=streaming,
                keep_raw=streaming,  # Generate: its token ids are read from the bytes as received
                slot=streaming,  # Generate takes an admission slot; Route and Release bytes only
                shape=shape,
                parts=parts,
            )

        return grpc.method_handlers_generic_handler(
            name,
            {
                "Generate": handler(
                    "Generate",
                    self.generate,
                    pb.GenerateRequest,
                    pb.GenerateChunk,
                    True,
                    "generate",
                    generate_parts,
                ),
                "Route": handler(
                    "Route", self.route, pb.RouteRequest, pb.RouteResponse, False, "route", route_parts
                ),
                "Release": handler("Release", self.release, pb.ReleaseRequest, pb.ReleaseResponse),
            },
        )

    async def generate(self, request: pb.GenerateRequest, call: Call) -> None:
        state, admission = self.state, call.admission
        assert admission is not None  # made with slot=True: a slot and the message's bytes
        call.adopt_request_id(request.request_id)
        job = await prepare(state, request, call, call.arrived, stream=True, raw=call.raw)
        admission.give_back(len(call.raw))  # its ids are read: the bytes go, the parsed message stays held
        call.raw = b""
        admission.add(len(job.body) + TOKEN_ID_BYTES * len(job.token_ids))  # what is forwarded
        headers = forwardable_headers(call.metadata, call.request_id)
        headers.update({"content-type": "application/json", "accept": SSE_CONTENT_TYPE})
        if state.admission.limits.max_inflight_prompt_tokens_per_tenant is not None:  # off: no await
            await admission.take_prompt_tokens(len(job.token_ids))
        await admission.wait_for_replica(job.pool)
        await dispatch(state, job, headers, call.outcome, functools.partial(self._relay, call, job))

    async def _relay(self, call: Call, job: Forward, lease: Lease, opened: Opened) -> None:
        state, stream = self.state, opened.stream
        on_first_chunk(state, job, lease, stream)
        admission = call.admission
        if admission is not None and admission.prompt_tokens:  # prefill done: the allowance passes on
            admission.give_back_prompt_tokens()
        if stream.status != 200 or not stream.content_type.startswith(SSE_CONTENT_TYPE):
            await self._refused(job, lease, opened)
        await call.context.send_initial_metadata(
            (
                ("x-request-id", call.request_id),
                ("x-kvlb-replica", lease.replica),
                ("x-kvlb-cached-tokens", str(lease.plan.cached_tokens)),
            )
        )
        progress = _Progress()
        try:
            failure = await self._pump(call, lease, opened, relay_deadline(state, job), progress)
        except BaseException:  # the client went away (cancelled) or could not be written to
            stream.close()
            raise
        finally:
            await opened.chunks.aclose()
        on_relayed(state, job, lease, stream, complete=failure is None)
        if failure is not None:
            raise failure
        if progress.error is not None:
            message = f"replica {lease.replica} reported an error: {progress.error}"
            raise CallError(grpc.StatusCode.UNAVAILABLE, message)
        done = pb.GenerateDone(
            request_id=call.request_id,
            replica_id=lease.replica,
            predicted_cached_tokens=lease.plan.cached_tokens,
            finish_reason=progress.finish_reason,
            usage=progress.usage,
        )
        writes = ClientWrites(relay_deadline(state, job), state.settings.timeouts.client_write_stall_s)
        try:
            async with writes:
                writes.begin()
                await call.context.write(pb.GenerateChunk(index=progress.index, done=done))
                writes.end()
        except TimeoutError:  # the last message not taken either
            raise client_stalled(state, writes) from None

    async def _pump(
        self, call: Call, lease: Lease, opened: Opened, deadline: float, progress: _Progress
    ) -> CallError | None:
        """Relay every event; a replica failure (or ``timeouts.total_s``) is returned, not raised."""
        events = SseEvents()
        writes = ClientWrites(deadline, self.state.settings.timeouts.client_write_stall_s)
        try:
            async with writes:
                await self._emit(call, writes, events.feed(opened.first), progress)
                async for chunk in opened.chunks:
                    await self._emit(call, writes, events.feed(chunk), progress)
                await self._emit(call, writes, events.close(), progress)
        except (UpstreamError, TimeoutError) as exc:
            if writes.writing:  # the client stopped reading: nothing more can reach it
                return client_stalled(self.state, writes)
            message = failure_message(self.state, lease, exc)
            log.warning(
                "request %s: replica %s broke mid-stream: %s", call.request_id, lease.replica, message
            )
            call.outcome.status = "stream_error"
            timed_out = isinstance(exc, TimeoutError)
            code = grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else grpc.StatusCode.UNAVAILABLE
            return CallError(code, f"replica {lease.replica} failed mid-stream: {message}")
        return None

    async def _emit(
        self, call: Call, writes: ClientWrites, payloads: list[bytes], progress: _Progress
    ) -> None:
        for data in payloads:
            if data == b"[DONE]":
                continue
            info = read_chunk(data)
            progress.finish_reason = info.finish_reason or progress.finish_reason
            progress.usage = info.usage or progress.usage
            progress.error = progress.error or info.error
            writes.begin()  # grpc's write waits while HTTP/2 flow control holds the client's window shut
            await call.context.write(pb.GenerateChunk(raw_json=data, text=info.text, index=progress.index))
            writes.end()
            progress.index += 1

    async def _refused(self, job: Forward, lease: Lease, opened: Opened) -> NoReturn:
        """End the call for an answer that is not a 200 event stream, quoting the replica's message."""
        stream = opened.stream
        body = bytearray(opened.first)
        try:
            async with asyncio.timeout_at(relay_deadline(self.state, job)):
                async for chunk in opened.chunks:
                    body += chunk
                    if len(body) >= MAX_ERROR_BODY_BYTES:
                        break
        except (UpstreamError, TimeoutError):
            pass  # quote what arrived
        finally:
            await opened.chunks.aclose()
            on_relayed(self.state, job, lease, stream, complete=False)
        replica = lease.replica
        if stream.status == 200:
            message = f"replica {replica} answered {stream.content_type}, not an event stream"
            raise CallError(grpc.StatusCode.UNAVAILABLE, message)
        text = error_body_text(bytes(body[:MAX_ERROR_BODY_BYTES]))
        refused = stream.status in (400, 413, 422)  # the request's fault, not the replica's
        code = grpc.StatusCode.INVALID_ARGUMENT if refused else grpc.StatusCode.UNAVAILABLE
        raise CallError(code, f"replica {replica} answered {stream.status}: {text}")

    async def route(self, request: pb.RouteRequest, call: Call) -> pb.RouteResponse:
        state = self.state
        if not request.HasField("request"):
            raise ApiError(400, "'request' is required")
        call.adopt_request_id(request.request.request_id)
        job = await prepare(state, request.request, call, state.monotonic(), stream=False)
        plan = select(state, job)
        decision = plan.decision
        call.outcome.replica, call.outcome.policy = decision.replica, decision.policy
        if request.reserve:
            now = state.monotonic()
            size = reservation_bytes(plan)
            self.reservations.check(call.request_id, now, size)
            lease = commit(state, job, plan)
            self.reservations.hold(call.request_id, lease, now, size)
        return pb.RouteResponse(
            request_id=call.request_id,
            replica_id=decision.replica,
            replica_url=job.pool.replicas[decision.replica].url,
            prompt_tokens=plan.prompt_tokens,
            predicted_cached_tokens=plan.cached_tokens,
            decision=decision_message(decision),
            reserved=request.reserve,
            left_out=left_out_names(plan.left_out),
        )

    async def release(self, request: pb.ReleaseRequest, call: Call) -> pb.ReleaseResponse:
        if not request.request_id:
            raise ApiError(400, "'request_id' is required")
        lease = self.reservations.pop(request.request_id, self.state.monotonic())
        if lease is None:
            raise CallError(
                grpc.StatusCode.NOT_FOUND,
                f"no reservation for {request.request_id!r} is held (released, expired after "
                f"{self.reservations.ttl_s}s, or never made)",
            )
        lease.release(self.state.monotonic())
        call.outcome.replica = lease.replica
        return pb.ReleaseResponse(request_id=request.request_id, replica_id=lease.replica)


class _Undecodable:
    """What a guarded deserializer returns for bytes its message type cannot decode."""


UNDECODABLE = _Undecodable()
MALFORMED = "malformed request: the message cannot be decoded"


class UndecodableRequests(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Makes a message a method cannot decode an INVALID_ARGUMENT, not an UNKNOWN and a traceback
    logged at ERROR: for the methods that decode their messages before their code runs (grpcio's
    health and reflection services; kvlb's own read raw bytes and parse them themselves,
    :func:`~balancer.api.grpc.calls.parse_message`, and pass through untouched)."""

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return guarded(handler)


def guarded(handler: Any) -> Any:
    """``handler`` (a ``grpc.RpcMethodHandler``) whose deserializer returns :data:`UNDECODABLE`
    instead of raising, and whose behaviour aborts with INVALID_ARGUMENT on it."""
    decode = handler.request_deserializer

    def deserialize(raw: bytes) -> Any:
        try:
            return decode(raw)
        except Exception:  # protobuf's DecodeError, or anything a deserializer raises on bad bytes
            return UNDECODABLE

    async def refuse(context: Any) -> NoReturn:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MALFORMED)
        raise AssertionError("abort returned")  # pragma: no cover - abort always raises

    async def checked(requests: Any, context: Any) -> Any:
        async for request in requests:
            if request is UNDECODABLE:
                await refuse(context)
            yield request

    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: Any) -> Any:
            if request is UNDECODABLE:
                await refuse(context)
            return await inner_uu(request, context)

        return handler._replace(request_deserializer=deserialize, unary_unary=unary_unary)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: Any) -> Any:
            if request is UNDECODABLE:
                await refuse(context)
            async for response in inner_us(request, context):
                yield response

        return handler._replace(request_deserializer=deserialize, unary_stream=unary_stream)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(requests: Any, context: Any) -> Any:
            return await inner_su(checked(requests, context), context)

        return handler._replace(request_deserializer=deserialize, stream_unary=stream_unary)
    inner_ss = handler.stream_stream

    async def stream_stream(requests: Any, context: Any) -> Any:
        async for response in inner_ss(checked(requests, context), context):
            yield response

    return handler._replace(request_deserializer=deserialize, stream_stream=stream_stream)


def refuse_port_in_use(host: str, port: int, *, reuse_port: bool) -> None:
    """A :class:`ConfigError` naming ``listen.grpc_port`` when ``host:port`` cannot be bound the way
    the gRPC core will bind it: found by a socket of kvlb's own, bound and closed at once, so that the
    core's own log line for a port in use (``add_port.cc ... Failed to add port``) is not printed
    before kvlb's one-line error. A port taken in between still fails in the core, as before."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind((host, port))
        except (OSError, OverflowError) as exc:
            raise bind_error("listen.grpc_port", host, port, exc) from None


class GrpcServer:
    """The server and what it owns: the reservations and the maintenance task."""

    def __init__(self, state: ServiceState, *, reuse_port: bool = False) -> None:
        """``reuse_port``: bind with ``SO_REUSEPORT`` (the workers of ``kvlb serve --workers``)."""
        self.reuse_port = reuse_port
        self.state = state
        limits, timeouts = state.settings.limits, state.settings.timeouts
        metrics = state.metrics
        self.reservations = Reservations(
            limits.max_inflight,
            timeouts.total_s,
            limits.max_reserved_bytes,
            lambda bound: metrics.children.of(metrics.grpc_reservations_refused_total, bound).inc(),
        )
        metrics.grpc_reservations_bytes.set_function(lambda: self.reservations.held_bytes)
        for bound in ("count", "bytes"):
            metrics.grpc_reservations_refused_total.labels(bound)
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._server: Any = None
        self._maintenance: asyncio.Task[None] | None = None
        self._ready: bool | None = None

    async def start(self, host: str, port: int) -> int:
        """Bind ``host:port`` (0 picks a free port) and serve; returns the bound port."""
        options = [
            ("grpc.max_receive_message_length", self.state.settings.limits.max_body_bytes),
            # no window growth beyond 64 KiB per stream: a call's message is received only as it is
            # read, after its bytes are reserved (a read asks for the message's size at once)
            ("grpc.http2.bdp_probe", 0),
            # a port in use is an error, not silently shared (workers share theirs on purpose)
            ("grpc.so_reuseport", 1 if self.reuse_port else 0),
        ]
        server = self._server = grpc.aio.server(options=options, interceptors=[UndecodableRequests()])
        server.add_generic_rpc_handlers(
            (BalancerService(self.state, self.reservations).handlers(), admin_handlers(self.state))
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        services = (BALANCER_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(services, server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        key_pair = grpc_key_pair(self.state.settings.listen)
        if port != 0:
            refuse_port_in_use(host, port, reuse_port=self.reuse_port)
        try:
            if key_pair is None:
                self.port = server.add_insecure_port(address)
            else:
                self.port = server.add_secure_port(address, grpc.ssl_server_credentials([key_pair]))
        except RuntimeError as exc:
            raise ConfigError(f"listen.grpc_port: cannot bind {address}: {exc}") from None
        if self.port == 0:
            raise ConfigError(f"listen.grpc_port: cannot bind {address}")
        await server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(ADMIN_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self._refresh_health()
        self._maintenance = asyncio.create_task(self._maintain(), name="kvlb-grpc-maintenance")
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING, refuse new calls, give running ones ``grace_s`` (then cancel them),
        and release every reservation (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        await self.health.enter_graceful_shutdown()
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintenance
            self._maintenance = None
        await server.stop(grace_s)
        self.reservations.release_all(self.state.monotonic())

    async def _maintain(self) -> None:
        interval_s = min(MAINTENANCE_INTERVAL_S, max(0.05, self.state.settings.health_interval_s))
        while True:
            await asyncio.sleep(interval_s)
            expired = self.reservations.expire(self.state.monotonic())
            if expired:
                log.warning("%d route reservation(s) expired without Release", expired)
            await self._refresh_health()

    async def _refresh_health(self) -> None:
        ready = not self.state.readiness(self.state.monotonic())
        if ready != self._ready:
            self._ready = ready
            serving = health_pb2.HealthCheckResponse
            await self.health.set(BALANCER_SERVICE, serving.SERVING if ready else serving.NOT_SERVING)
