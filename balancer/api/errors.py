"""HTTP error responses in OpenAI's shape, and the mapping from kvlb's errors to them (pure).

Every error a client sees is ``{"error": {"message", "type", "param", "code"}}``, OpenAI's shape, with
the HTTP status in ``code`` (an integer, as vLLM and SGLang send it) and ``param`` null. Messages are
written for the client; internal exception text never reaches it (unexpected errors become a
generic 500 and are logged with their traceback).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from aiohttp import web

from balancer import strict_json
from balancer.errors import ConfigError, NoReplicasAvailable, Overloaded, UpstreamError, UpstreamTimeout
from balancer.service.admission import AdmissionRefused
from balancer.tokenizer.tokenizer import TokenizeError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


class ApiError(Exception):
    """An error answer: status, client-facing message and extra headers (e.g. ``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        kind: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})
        self.kind = kind or _TYPES.get(status, "error")
        self.close = close
        """Close the connection once the answer is written, reading nothing more of the request
        (a body kvlb stopped reading part way, which aiohttp would otherwise read and parse to its
        end, or for up to 10 s, before closing)."""


def too_large(declared: int, max_bytes: int) -> ApiError:
    """413 for a body that declares more than ``limits.max_body_bytes``."""
    return ApiError(413, f"request body of {declared} bytes exceeds limits.max_body_bytes = {max_bytes}")


def retry_after(seconds: float) -> dict[str, str]:
    """A ``Retry-After`` header in whole seconds (at least 1)."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def error_body(status: int, message: str, kind: str | None = None) -> bytes:
    kind = kind or _TYPES.get(status, "error")
    payload = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return strict_json.dumps(payload).encode("utf-8")


def refusal_response(refused: AdmissionRefused, request_id: str) -> web.Response:
    """The answer to ``refused`` as :func:`error_response` writes it (the same JSON shape, with
    ``Retry-After`` and ``x-request-id``), made directly: a flood of refusals (the tenant's request
    rate, :func:`balancer.service.admitted.tenant_rate_refusal`) costs no exception's way through
    the middleware and no dict encoded (its message is kvlb's own ASCII text)."""
    status = refused.status
    kind = _TYPES.get(status, "error")
    body = f'{{"error": {{"message": {json.dumps(refused.message)}, "type": "{kind}", "code": {status}}}}}'
    return web.Response(
        status=status,
        body=body.encode(),
        headers={
            "Content-Type": "application/json",
            "Retry-After": str(max(1, math.ceil(refused.retry_after_s))),
            "x-request-id": request_id,
        },
    )


def error_response(error: ApiError, request_id: str | None = None) -> web.Response:
    headers = dict(error.headers)
    if request_id is not None:
        headers["x-request-id"] = request_id
    response = web.Response(
        status=error.status,
        body=error_body(error.status, error.message, error.kind),
        content_type="application/json",
        headers=headers,
    )
    if error.close:
        response.force_close()  # Connection: close, and no keep-alive after it
    return response


def from_balancer_error(exc: Exception) -> ApiError | None:
    """The HTTP answer for one of kvlb's own errors; ``None`` for anything unexpected."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, AdmissionRefused):
        return ApiError(exc.status, exc.message, headers=retry_after(exc.retry_after_s))
    if isinstance(exc, Overloaded):
        return ApiError(429, str(exc), headers=retry_after(exc.retry_after_s))
    if isinstance(exc, NoReplicasAvailable):
        return ApiError(503, str(exc), headers=retry_after(1.0))
    if isinstance(exc, TokenizeError | ConfigError):
        return ApiError(400, str(exc))
    if isinstance(exc, UpstreamTimeout):
        return ApiError(504, str(exc))
    if isinstance(exc, UpstreamError):
        return ApiError(502, str(exc))
    return None
