"""What every kvlb gRPC method shares (I/O): metadata, auth, the request message within the byte
budget, malformed messages, status codes, metrics.

:func:`method_handler` wraps a method of :mod:`balancer.api.grpc.server` or :mod:`balancer.api.grpc.admin`
the way :mod:`balancer.api.middleware` wraps an HTTP handler, in this order:

1. the request id: the ``x-request-id`` metadata if printable and ≤ 128 characters, else a new one;
2. auth from the ``authorization: Bearer ...`` metadata and the same ``settings.auth`` as HTTP
   (:func:`authorize`), before anything is received: an unauthenticated call never makes kvlb take
   its message;
3. the message, received by the handler itself (:func:`receive`). Every method is served as a
   stream-request method (the wire is a unary call's: one message, then the half-close), so grpc
   receives a message only when it is read, and HTTP/2 flow control holds the rest at the client
   (``grpc.http2.bdp_probe`` off: the window stays at its 64 KiB default until a read asks for
   more). Before the read the call reserves ``limits.max_body_bytes`` of
   ``limits.max_inflight_body_bytes`` (the most a message may be: grpc refuses a larger one), as an
   HTTP body reserves its declared length: with an admission slot (``slot``: ``Generate``, through
   :func:`~balancer.service.admitted.admitted`) or bytes only (``Route``, ``Release``,
   :func:`~balancer.service.admitted.held`), waiting in the admission queue, refused with
   RESOURCE_EXHAUSTED or UNAVAILABLE and ``retry-after``; an ``admin`` method reads its message
   outside the budget, as ``/admin`` over HTTP does (an operator's call never queues behind the
   traffic it manages; its message comes only after the admin token). Right after the read the
   difference to the message's size is given back; the message's bytes are held until the call
   ends. No message → INVALID_ARGUMENT (more than one: answered from the first, the rest never
   read); not received within ``timeouts.body_read_s`` → DEADLINE_EXCEEDED;
   a message that does not parse → INVALID_ARGUMENT (and, for a method made with ``keep_raw``, the
   bytes as received are ``call.raw``). The parse holds its estimate meanwhile when the message is
   256 KiB or more (:func:`~balancer.api.parse_cost.protobuf_parse_bytes`, from its top-level
   fields: an empty chat message is 2 bytes on the wire and 56 B parsed), in the queue of tokenizing holds
   (:func:`~balancer.api.openai.hold_parse`); then the parsed message is held until the call ends
   (:func:`~balancer.api.parse_cost.parsed_message_bytes`: its bytes again, for its strings and
   unknown fields, 64 B a chat message and 8 B a token id, counted by the method's ``parts``), and
   its bytes as received are given back unless the method keeps them (``keep_raw``). Why the reservation
   before the read stays ``limits.max_body_bytes``: grpc's Python API shows a message only whole
   (``context.read()``, or a ``request_deserializer``, which is given the bytes grpc already holds),
   and once a read is asked for, grpc's HTTP/2 transport opens the stream's window to the rest of the
   message its 5-byte prefix announces (up to ``grpc.max_receive_message_length``) and buffers it
   all, however slowly it comes; only the reservation bounds what 128 such reads buffer;
4. errors become status codes: :class:`CallError` as it is, kvlb's own errors through the same HTTP
   mapping as the HTTP API (:data:`CODES`); anything unexpected is logged with its traceback and
   becomes INTERNAL with only the request id;
5. ``kvlb_http_requests_total{endpoint="/kvlb.v1.Balancer/Generate", status="OK", replica, policy}``
   is counted once per call (``status`` is the gRPC code name, or ``stream_error``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
from google.protobuf.message import DecodeError, Message

from balancer.api.errors import ApiError, from_balancer_error
from balancer.api.middleware import MAX_REQUEST_ID_CHARS, bearer_token, caller_of, token_matches
from balancer.api.openai import hold_parse
from balancer.api.parse_cost import parsed_message_bytes, protobuf_parse_bytes
from balancer.api.parsing import parse_weights_header
from balancer.config import AuthConfig
from balancer.policy import PolicyWeights
from balancer.service.admitted import Admitted, admitted, check_tenant_rate, held
from balancer.service.state import Outcome, ServiceState

log = logging.getLogger(__name__)

Access = Literal["client", "admin"]
Method = Callable[[Any, "Call"], Awaitable[Any]]

WEIGHTS_METADATA = "x-kvlb-weights"

CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
"""HTTP statuses of :class:`ApiError` (and so of kvlb's own errors) → gRPC codes; others: INTERNAL."""


class CallError(Exception):
    """End the call with ``code`` and a client-facing ``message``; ``retry_after_s`` is sent as the
    trailing metadata ``retry-after`` (whole seconds)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


def status_of(exc: Exception, request_id: str) -> CallError:
    """The status a failed call ends with; unexpected errors are logged and stay opaque."""
    if isinstance(exc, CallError):
        return exc
    error = from_balancer_error(exc)
    if error is None:
        log.error("grpc request %s: unexpected error", request_id, exc_info=exc)
        return CallError(
            grpc.StatusCode.INTERNAL, f"internal error; see the balancer log for request {request_id}"
        )
    retry = error.headers.get("Retry-After")
    code = CODES.get(error.status, grpc.StatusCode.INTERNAL)
    return CallError(code, error.message, float(retry) if retry is not None else None)


def parse_message(message_type: type[Message], raw: bytes) -> Message:
    """``raw`` as a ``message_type``; a message that does not parse → INVALID_ARGUMENT."""
    try:
        return message_type.FromString(raw)
    except DecodeError as exc:
        raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}") from None


async def receive(context: Any, admission: Admitted | None, timeout_s: float) -> bytes:
    """The call's one request message as received, read within ``timeout_s`` while ``admission``
    holds ``limits.max_body_bytes`` for it (``None``: an admin call, outside the budget); then the
    rest of that reservation is given back. No
    message → INVALID_ARGUMENT. Nothing after the first message is read: a client that sends more
    is answered from the first, and the rest never leave it beyond the flow-control window (reading
    on to check for a second message cost about 100 µs of CPU a call, in grpc's poller)."""
    try:
        async with asyncio.timeout(timeout_s):
            raw = await context.read()
            if raw is grpc.aio.EOF:
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT, "no request message: this method takes one")
    except TimeoutError:
        raise ApiError(408, f"request message not received within {timeout_s}s") from None
    if admission is not None:
        admission.give_back(admission.body_bytes - len(raw))
    return bytes(raw)


async def parse_held(
    state: ServiceState,
    admission: Admitted,
    message_type: type[Message],
    raw: bytes,
    shape: str,
    parts: Callable[[Any], tuple[int, int]],
) -> Message:
    """:func:`parse_message` of ``raw`` holding :func:`~balancer.api.parse_cost.protobuf_parse_bytes`
    (of ``shape``) while it parses, from 256 KiB, then
    :func:`~balancer.api.parse_cost.parsed_message_bytes` of the message (``parts``: its chat
    messages and token ids) until the call ends. The second is at most the first, so moving from one
    to the other passes nothing over the budget; a message under 256 KiB adds at most 8 times its
    bytes without waiting."""
    parse_bytes = protobuf_parse_bytes(raw, shape)
    if parse_bytes:
        await hold_parse(admission, parse_bytes, state, "grpc")
    try:
        request = parse_message(message_type, raw)
    finally:
        if parse_bytes:
            admission.give_back_tokenizing()
    admission.add(parsed_message_bytes(len(raw), *parts(request)))
    return request


def no_parts(_request: Any) -> tuple[int, int]:
    """``parts`` of a method whose message holds no chat messages and no token ids."""
    return 0, 0


def authorize(auth: AuthConfig, access: Access, token: str | None) -> None:
    """Client calls need a key of ``auth.api_keys`` (when any); admin calls need ``auth.admin_token``
    (when set). No or an unknown token → UNAUTHENTICATED; a client key on an admin call →
    PERMISSION_DENIED."""
    if access == "client":
        if auth.api_keys and not token_matches(token, auth.api_keys):
            raise CallError(
                grpc.StatusCode.UNAUTHENTICATED,
                "a valid API key is required: metadata authorization: Bearer <key>",
            )
        return
    if auth.admin_token is None or token_matches(token, (auth.admin_token,)):
        return
    if token_matches(token, auth.api_keys):
        raise CallError(grpc.StatusCode.PERMISSION_DENIED, "admin calls need the admin token, not an API key")
    raise CallError(
        grpc.StatusCode.UNAUTHENTICATED, "the admin token is required: metadata authorization: Bearer <token>"
    )


@dataclass(slots=True)
class Call:
    """One call as a method sees it."""

    state: ServiceState
    context: Any
    """The ``grpc.aio.ServicerContext``."""
    metadata: dict[str, str]
    """Text metadata (the first value of each key); binary (``-bin``) keys are left out."""
    request_id: str
    id_given: bool
    outcome: Outcome = field(default_factory=Outcome)
    raw: bytes = b""
    """The request message's bytes as received, for a method made with ``keep_raw``; else empty."""
    arrived: float = 0.0
    """Monotonic time the call started (before its wait for admission)."""
    admission: Admitted | None = None
    """What the call holds (its slot, for a method made with ``slot``, and its message's bytes)."""
    message_bytes: int = 0
    """Size of the request message as received, in bytes."""

    @classmethod
    def of(cls, state: ServiceState, context: Any) -> Call:
        metadata: dict[str, str] = {}
        for key, value in context.invocation_metadata() or ():
            if isinstance(value, str):
                metadata.setdefault(key, value)
        given = _valid_request_id(metadata.get("x-request-id", ""))
        return cls(
            state, context, metadata, given or uuid.uuid4().hex, given is not None, arrived=state.monotonic()
        )

    @property
    def token(self) -> str | None:
        return bearer_token(self.metadata.get("authorization", ""))

    def caller(self) -> str:
        """Who made the call, for the audit log (a token fingerprint, never the token)."""
        return caller_of(self.token, self.context.peer())

    def adopt_request_id(self, request_id: str) -> None:
        """Use the id in the message when the metadata carried none."""
        valid = _valid_request_id(request_id)
        if not self.id_given and valid is not None:
            self.request_id = valid

    def weights(self, *, always: bool = False) -> PolicyWeights:
        """The policy's weights, or the ``x-kvlb-weights`` override when it is allowed (``always``
        for admin calls; else ``auth.allow_weight_override``, otherwise PERMISSION_DENIED)."""
        base = self.state.policy.view.weights
        value = self.metadata.get(WEIGHTS_METADATA)
        if value is None:
            return base
        if not always and not self.state.settings.auth.allow_weight_override:
            raise ApiError(403, f"{WEIGHTS_METADATA} is not allowed here (auth.allow_weight_override is off)")
        return parse_weights_header(value, base)


MAX_DETAIL_BYTES = 2_048
"""Most UTF-8 bytes of a status detail. gRPC sends it percent-encoded in the ``grpc-message``
trailer (up to 3 bytes per byte), and a client refuses trailers over its metadata limit (16 KiB by
default) with RESOURCE_EXHAUSTED: a detail echoing a long input (an unknown model or replica named
with 20 000 characters) replaced the answer's own code with that."""


def wire_text(message: str) -> str:
    """``message`` as a status detail can carry it: gRPC sends details as UTF-8, and a lone
    surrogate echoed from the client's JSON (say, an unknown weight name) would make the server fail
    to send the status at all, leaving the call to hang until its deadline. It becomes ``\\udXXX``.
    Cut at :data:`MAX_DETAIL_BYTES` (saying how much was left out)."""
    data = message.encode("utf-8", "backslashreplace")
    if len(data) <= MAX_DETAIL_BYTES:
        return data.decode("utf-8")
    kept = data[: MAX_DETAIL_BYTES - 64].decode("utf-8", "ignore")
    return f"{kept}... ({len(data) - len(kept.encode('utf-8'))} bytes more)"


def _valid_request_id(given: str) -> str | None:
    return given if 0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable() else None


def method_handler(
    state: ServiceState,
    endpoint: str,
    access: Access,
    method: Method,
    request_type: type[Message],
    response_type: type[Message],
    *,
    streaming: bool = False,
    keep_raw: bool = False,
    slot: bool = False,
    shape: str = "plain",
    parts: Callable[[Any], tuple[int, int]] = no_parts,
) -> Any:
    """A ``grpc.RpcMethodHandler`` running ``method`` with auth, the message's bytes, errors and
    metrics (see the module docstring). A streaming ``method`` writes with ``call.context.write`` and
    returns ``None``. ``keep_raw``: the method finds the request's bytes as received in ``call.raw``.
    ``slot``: the call takes an admission slot (of its ``tenant_header`` tenant) with its bytes, held
    in ``call.admission`` until the method returns. ``shape`` and ``parts``: how the message's parse is
    estimated and counted (:func:`parse_held`)."""
    settings = state.settings
    max_body_bytes = settings.limits.max_body_bytes
    tenant_header = settings.tenant_header.lower()

    async def handle(requests: Any, context: Any) -> Any:
        call = Call.of(state, context)
        status = "OK"
        try:
            authorize(settings.auth, access, call.token)
            tenant = call.metadata.get(tenant_header)
            if slot and state.tenant_rates is not None:  # before the message is read
                check_tenant_rate(state, tenant, state.monotonic())
            hold: contextlib.AbstractAsyncContextManager[Admitted | None]
            if access == "admin":  # as /admin over HTTP: never queued behind the traffic it manages
                hold = contextlib.nullcontext()
            else:
                hold = admitted(state, max_body_bytes, tenant) if slot else held(state, max_body_bytes)
            async with hold as admission:
                raw = await receive(context, admission, settings.timeouts.body_read_s)
                call.message_bytes = len(raw)
                if admission is None:
                    request = parse_message(request_type, raw)
                else:
                    request = await parse_held(state, admission, request_type, raw, shape, parts)
                    if not keep_raw:  # the bytes go now: the parsed message stays, held
                        admission.give_back(len(raw))
                call.admission = admission
                if keep_raw:
                    call.raw = raw
                del raw
                return await method(request, call)
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        except Exception as exc:
            error = status_of(exc, call.request_id)
            status = error.code.name
        finally:
            label = call.outcome.status or status
            outcome = call.outcome
            metrics = state.metrics
            replica = metrics.replica_label(outcome.replica)
            metrics.children.of(metrics.requests_total, endpoint, label, replica, outcome.policy).inc()
        trailers: list[tuple[str, str]] = [("x-request-id", call.request_id)]
        if error.retry_after_s is not None:
            trailers.append(("retry-after", str(max(1, math.ceil(error.retry_after_s)))))
        await context.abort(error.code, wire_text(error.message), trailing_metadata=tuple(trailers))

    def serializer(answer: Message | bytes) -> bytes:
        """The answer's bytes: a method may return them already encoded (``ListReplicas`` encodes
        its answer a few replicas at a time, so that grpc does not in one go)."""
        return answer if isinstance(answer, bytes) else response_type.SerializeToString(answer)

    # stream-request handlers: the message is read by receive(), after the reservation
    if streaming:
        return grpc.stream_stream_rpc_method_handler(handle, response_serializer=serializer)
    return grpc.stream_unary_rpc_method_handler(handle, response_serializer=serializer)
