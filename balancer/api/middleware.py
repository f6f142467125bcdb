"""The one middleware every request passes (I/O): request id, auth, error mapping, request metrics.

* ``x-request-id``: the client's (if printable and ≤ 128 characters) or a new one; echoed on every
  answer and forwarded to the replica.
* Auth: ``/v1/*`` needs ``Authorization: Bearer <key>`` with a key from ``auth.api_keys`` (when any
  is set); ``/admin/*`` needs ``auth.admin_token`` (when set). A missing or unknown token is a 401
  with ``WWW-Authenticate: Bearer``; a valid client key on ``/admin`` a 403 (authenticated, not
  allowed), as gRPC's PERMISSION_DENIED. Both with a JSON message.
  An admin write (not GET/HEAD/OPTIONS) whose ``Origin`` header names another origin is a 403
  (:func:`check_origin`): the console's writes are CSRF-safe.
* CORS (``listen.cors_allow_origins``, :mod:`balancer.api.cors`): a browser's preflight of a
  ``/v1/*`` path or ``/openapi.json`` is answered here, before auth (a preflight carries no
  credentials); every answer on those paths to a listed origin gets its CORS headers
  (:func:`add_cors_headers`, run as aiohttp prepares it, so streams and errors get them too).
* Errors: :class:`~balancer.api.errors.ApiError`, kvlb's own errors and aiohttp's HTTP errors become
  OpenAI-shaped JSON; anything unexpected is logged with its traceback and becomes a generic 500.
* ``kvlb_http_requests_total{endpoint,status,replica,policy}`` is counted here, once per request.
* In flight: the request's task is kept in the service's :class:`~balancer.api.inflight.InflightRequests`
  from the middleware's first line to its last, so shutdown cancels it at ``shutdown_grace_s``.
  One middleware for all of it: aiohttp adds a layer of its own as soon as an app has any, and each
  more costs a ``partial``, a coroutine and an ``await`` a request (docs/benchmark-history.md,
  round 22).
* ``Expect: 100-continue`` on a route that takes a body (:func:`expect_continue`, which aiohttp runs
  before any middleware): what the headers alone refuse (a ``Content-Length`` over
  ``limits.max_body_bytes``, a missing key or token, a foreign ``Origin``, a serving request's tenant
  over ``limits.tenant_rate_per_s``) is answered at once in
  the JSON shape *instead of* ``100 Continue``, so the client never sends the body; one sent
  anyway is dropped unparsed and kvlb's side is shut down after the answer (:func:`answer_and_close`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
from asyncio import current_task
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from balancer.api.body_memo import BodyMemo
from balancer.api.cors import CorsPolicy, cors_path, is_preflight
from balancer.api.errors import ApiError, error_response, from_balancer_error, too_large
from balancer.api.inflight import InflightRequests
from balancer.api.prefix_memo import PrefixMemo
from balancer.config import AuthConfig
from balancer.service.state import Outcome, ServiceState

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

STATE = web.AppKey("kvlb_state", ServiceState)
"""The service state the app serves (set by :func:`balancer.api.http.build_web_app`)."""
BODY_MEMO = web.AppKey("kvlb_body_memo", BodyMemo)
"""The application's memo of whole request bodies (:func:`~balancer.api.http.build_web_app` sizes it
from ``limits.body_memo_entries``/``body_memo_bytes``; one per process)."""
PREFIX_MEMO = web.AppKey("kvlb_prefix_memo", PrefixMemo)
"""The application's memo of chat body prefixes (:func:`~balancer.api.http.build_web_app` sizes it
from ``limits.prefix_memo_entries``/``prefix_memo_bytes``; one per process)."""
CORS = web.AppKey("kvlb_cors", CorsPolicy)
"""The app's CORS policy; absent when ``listen.cors_allow_origins`` is empty."""
REQUEST_ID = web.RequestKey("kvlb_request_id", str)
OUTCOME = web.RequestKey("kvlb_outcome", Outcome)
RATE_TAKEN = web.RequestKey("kvlb_rate_taken", bool)
"""Set when the request's token of its tenant's ``limits.tenant_rate_per_s`` was taken before its
``100 Continue`` (:func:`balancer.api.openai.rate_before_body`): the handler takes no second one."""

MAX_REQUEST_ID_CHARS = 128
UNAUTHENTICATED = {"WWW-Authenticate": "Bearer"}
_KEPT_ERROR_HEADERS = frozenset({"allow", "retry-after"})
"""Headers of aiohttp's own HTTP errors that survive the JSON error mapping."""


def request_id_of(request: web.Request) -> str:
    given = request.headers.get("x-request-id", "")
    if 0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable():
        return given
    return os.urandom(16).hex()  # 32 random hex digits, as uuid4().hex but a quarter of the cost


def bearer_token(value: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (HTTP header or gRPC metadata)."""
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _bearer(request: web.Request) -> str | None:
    return bearer_token(request.headers.get("Authorization", ""))


def token_matches(token: str | None, allowed: tuple[str, ...]) -> bool:
    if token is None:
        return False
    candidate = token.encode("utf-8", "surrogatepass")  # HTTP headers decode bytes as surrogates
    # compare_digest on every key: no early exit that would leak which key matched.
    return sum(hmac.compare_digest(candidate, key.encode("utf-8")) for key in allowed) > 0


def check_auth(request: web.Request, auth: AuthConfig) -> None:
    path = request.path
    if path.startswith("/v1/") and auth.api_keys and not token_matches(_bearer(request), auth.api_keys):
        raise ApiError(
            401, "a valid API key is required: Authorization: Bearer <key>", headers=UNAUTHENTICATED
        )
    admin_token = auth.admin_token
    if not path.startswith("/admin") or admin_token is None:
        return
    token = _bearer(request)
    if token_matches(token, (admin_token,)):
        return
    if token_matches(token, auth.api_keys):
        raise ApiError(
            403,
            "this API key may call /v1 only: /admin needs the admin token (Authorization: Bearer "
            "<admin token>)",
        )
    raise ApiError(401, "the admin token is required: Authorization: Bearer <token>", headers=UNAUTHENTICATED)


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def check_origin(request: web.Request) -> None:
    """Refuse (403) an admin write that a browser sent from another origin: the ``Origin`` header,
    when present, must name this server's own host and port (the ``Host`` header). Browsers add
    ``Origin`` to every cross-origin request and to same-origin writes; ``curl``, ``kvlb admin`` and
    the gRPC face send none. The admin token travels in a header and never in a cookie, so a foreign
    page cannot send it anyway; this is the second lock on the door."""
    if request.method in SAFE_METHODS or not request.path.startswith("/admin"):
        return
    origin = request.headers.get("Origin")
    if origin is None:
        return
    own = request.host.lower()
    try:
        parts = urlsplit(origin.strip())
        given = parts.netloc.lower() if parts.scheme in ("http", "https") else ""
    except ValueError:
        given = ""
    if not given or given != own:
        raise ApiError(
            403, f"admin writes are refused from another origin: Origin {origin[:200]!r} is not {own!r}"
        )


def caller(request: web.Request) -> str:
    """Who made an admin call, for the audit log: a token fingerprint (never the token) and address."""
    return caller_of(_bearer(request), request.remote)


def caller_of(token: str | None, address: str | None) -> str:
    # surrogatepass: an HTTP header's non-UTF-8 bytes arrive as surrogates, which must not be a 500
    who = (
        f"token:{hashlib.sha256(token.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"
        if token
        else "anonymous"
    )
    return f"{who}@{address or '?'}"


def _explain(request: web.Request, exc: web.HTTPException) -> str:
    """A client-facing message for aiohttp's own errors (no route, wrong method, bad request...)."""
    where = f"{request.method} {request.path}"
    if exc.status == 404:
        return f"{where}: {exc.reason}: no such endpoint (the API is described at /openapi.json)"
    if exc.status == 405:
        return f"{where}: {exc.reason}; allowed: {exc.headers.get('Allow', 'none')}"
    return f"{where}: {exc.text or exc.reason}"


def _endpoint(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


async def expect_continue(
    request: web.Request, admit: Callable[[web.Request], None] | None = None
) -> web.StreamResponse | None:
    """aiohttp's ``expect_handler`` for the routes that take a body: ``None`` after writing
    ``100 Continue`` (the handler then reads the body), or the refusal the headers alone decide, as
    the middleware would answer it after the body (413 over ``limits.max_body_bytes``, 401, 403;
    417 for an ``Expect`` other than ``100-continue``) with ``Connection: close``: the client may
    send the body anyway, which kvlb drops unparsed, its side of the connection shut down once the
    answer is out (:func:`answer_and_close`; aiohttp read and parsed it for its 10 s lingering time,
    the connection open meanwhile). HTTP/1.0 ignores ``Expect`` (RFC 9110, 10.1.1). ``admit``: the
    route's own check on the headers alone, after those (it raises :class:`ApiError`; the serving
    routes' is their tenant's request rate, :func:`balancer.api.openai.rate_before_body`)."""
    if request.version < (1, 1):
        return None
    state: ServiceState = request.app[STATE]
    expect = request.headers.get("Expect", "")
    try:
        if expect.lower() != "100-continue":
            raise ApiError(417, f"unsupported Expect {expect[:100]!r}; only 100-continue is understood")
        check_auth(request, state.settings.auth)
        check_origin(request)
        declared = request.content_length
        max_bytes = state.settings.limits.max_body_bytes
        if declared is not None and declared > max_bytes:
            raise too_large(declared, max_bytes)
        if admit is not None:
            admit(request)
    except ApiError as error:
        response = error_response(error, request_id_of(request))
        response.force_close()
        metrics = state.metrics
        metrics.children.of(metrics.requests_total, _endpoint(request), str(error.status), "", "").inc()
        await answer_and_close(request, response)  # a body sent anyway is dropped unparsed
        return response
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the interim answer is not the response: an error may follow
    return None


class _Discarding(asyncio.Protocol):
    """What a connection kvlb stopped reading gets instead of aiohttp's parser: bytes dropped as
    they come, one call a read of the socket (not one a chunk of the body). Its end is passed on to
    aiohttp's protocol, which then stops waiting for the rest of the request."""

    def __init__(self, parser: asyncio.BaseProtocol) -> None:
        self._parser = parser

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self._parser.connection_lost(exc)


async def answer_and_close(request: web.Request, response: web.Response) -> None:
    """Write ``response`` and end the connection without parsing more of the request: what the
    client still sends is dropped unparsed, and kvlb's side is shut down once the answer is out, so
    the client reads the answer, then the end of the stream (closing with unread bytes would reset
    the connection and lose the answer). It closes when the client closes it, or after aiohttp's
    lingering time (10 s)."""
    with contextlib.suppress(ConnectionError):
        await response.prepare(request)
        await response.write_eof()
    transport = request.transport
    if transport is None or transport.is_closing():
        return
    transport.set_protocol(_Discarding(transport.get_protocol()))
    if transport.can_write_eof():
        transport.write_eof()
    else:  # TLS: no half-close
        transport.close()


def preflight(cors: CorsPolicy, request: web.Request) -> web.StreamResponse:
    """The answer to a browser's preflight of a ``/v1/*`` path or ``/openapi.json``: 204 with the
    CORS headers for a listed origin, else 403 (:class:`ApiError`) without them, which the browser
    reports as a CORS failure."""
    origin = request.headers["Origin"]
    if not cors.allowed(origin):
        raise ApiError(403, f"CORS: origin {origin[:200]!r} is not in listen.cors_allow_origins")
    return web.Response(status=204, headers=cors.preflight_headers(origin, request.headers))


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the CORS headers of an answer on ``/v1/*`` to a listed origin."""
    cors = request.app.get(CORS)
    origin = request.headers.get("Origin")
    if cors is None or origin is None or "Access-Control-Allow-Origin" in response.headers:
        return
    if cors.applies(request.path, origin):
        response.headers.update(cors.answer_headers(origin))


def kvlb_middleware(
    state: ServiceState, cors: CorsPolicy | None = None, inflight: InflightRequests | None = None
) -> Middleware:
    """The app's one middleware of its own (see the module doc): request id, CORS preflight, auth,
    origin, error mapping and ``kvlb_http_requests_total``, and, with ``inflight``, the request's
    task kept in it for the whole of the middleware (outermost: :mod:`balancer.api.inflight`). One
    coroutine a request where two middlewares made two (each a ``partial``, a coroutine and an
    ``await`` more), the state, CORS policy and auth settings read once here instead of from the app
    on every request."""
    auth = state.settings.auth
    metrics = state.metrics
    child = metrics.children.of
    requests_total = metrics.requests_total
    replica_label = metrics.replica_label
    tasks: set[asyncio.Task[Any]] = inflight.tasks if inflight is not None else set()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        task = current_task()
        if task is not None:
            tasks.add(task)
        try:
            request_id = request_id_of(request)
            method = request.method
            request[REQUEST_ID] = request_id
            outcome = request[OUTCOME] = Outcome()
            status = "500"
            try:
                try:
                    if cors is not None and cors_path(request.path) and is_preflight(method, request.headers):
                        response = preflight(cors, request)
                    else:
                        check_auth(request, auth)
                        check_origin(request)
                        response = await handler(request)
                except asyncio.CancelledError:
                    status = "499"
                    raise
                except web.HTTPException as exc:
                    if exc.status < 400:
                        raise
                    kept = {k: v for k, v in exc.headers.items() if k.lower() in _KEPT_ERROR_HEADERS}
                    response = error_response(
                        ApiError(exc.status, _explain(request, exc), headers=kept), request_id
                    )
                except Exception as exc:
                    error = from_balancer_error(exc)
                    if error is None:
                        log.exception("request %s: unexpected error on %s", request_id, request.path)
                        error = ApiError(
                            500, f"internal error; see the balancer log for request {request_id}"
                        )
                    response = error_response(error, request_id)
                    if error.close:
                        await answer_and_close(request, response)
                status = str(response.status)
            finally:
                replica = replica_label(outcome.replica)
                child(
                    requests_total, _endpoint(request), outcome.status or status, replica, outcome.policy
                ).inc()
            if not response.prepared:
                response.headers.setdefault("x-request-id", request_id)
            return response
        finally:
            if task is not None:
                tasks.discard(task)

    return middleware
