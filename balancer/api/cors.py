"""CORS for ``/v1/*`` and ``/openapi.json`` (pure): what kvlb answers a browser's preflight and which
headers mark an answer readable by a page of another origin (``listen.cors_allow_origins``). The
middleware (:mod:`balancer.api.middleware`) applies it; ``/admin``, the console and the other paths
never get it (the console is same-origin, and its writes refuse a foreign ``Origin``). The API
description is public (no key needed) and a page of a listed origin (an API explorer, a generated
client) may read it, as it may call ``/v1/*``.

Like vLLM's and SGLang's servers (Starlette's ``CORSMiddleware``), but with exact origins: a
preflight from a listed origin gets 204 with the methods and the request headers it asked for that
kvlb accepts (``Authorization``, ``Content-Type``, the OpenAI SDKs' ``x-stainless-*``, kvlb's
``x-kvlb-*``...); one from another origin gets 403 with no CORS header, so the browser refuses the
call. An answer to a listed origin exposes kvlb's own headers (``x-kvlb-replica``...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from balancer.config import ListenConfig

PATH_PREFIX = "/v1/"
"""The paths CORS applies to, with :data:`OPENAPI_PATH`."""
OPENAPI_PATH = "/openapi.json"
"""The API description, readable cross-origin by a listed origin too."""
ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOWED_HEADERS = frozenset(
    {
        "authorization",
        "content-type",
        "accept",
        "x-request-id",
        "traceparent",
        "tracestate",
        "openai-organization",
        "openai-project",
        "openai-beta",
        "idempotency-key",
    }
)
"""Request headers a page may send besides the prefixed ones (:data:`ALLOWED_HEADER_PREFIXES`)."""
ALLOWED_HEADER_PREFIXES = ("x-stainless-", "x-kvlb-")
EXPOSE_HEADERS = "x-request-id, x-kvlb-replica, x-kvlb-cached-tokens, retry-after"
"""kvlb's answer headers a page may read."""
MAX_AGE_S = 600
"""How long a browser may keep a preflight's answer (seconds)."""
MAX_REQUESTED_HEADERS = 64
"""Most names of ``Access-Control-Request-Headers`` considered (the rest are not allowed)."""


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """``listen.cors_allow_origins`` and ``cors_allow_credentials``, plus the tenant header."""

    origins: frozenset[str]
    any_origin: bool
    credentials: bool
    tenant_header: str

    @classmethod
    def of(cls, listen: ListenConfig, tenant_header: str) -> CorsPolicy | None:
        """The policy, or ``None`` when CORS is off (no origin listed)."""
        if not listen.cors_allow_origins:
            return None
        origins = frozenset(o for o in listen.cors_allow_origins if o != "*")
        return cls(
            origins, "*" in listen.cors_allow_origins, listen.cors_allow_credentials, tenant_header.lower()
        )

    def applies(self, path: str, origin: str | None) -> bool:
        """Whether an answer on ``path`` to a page of ``origin`` is CORS-readable."""
        return origin is not None and cors_path(path) and self.allowed(origin)

    def allowed(self, origin: str) -> bool:
        return origin in self.origins or self.any_origin

    def _allow_origin(self, origin: str) -> dict[str, str]:
        if origin in self.origins or self.credentials:
            headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        else:
            headers = {"Access-Control-Allow-Origin": "*"}
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    def answer_headers(self, origin: str) -> dict[str, str]:
        """Headers of an actual answer (any status) to an allowed ``origin``."""
        return {**self._allow_origin(origin), "Access-Control-Expose-Headers": EXPOSE_HEADERS}

    def preflight_headers(self, origin: str, request_headers: Mapping[str, str]) -> dict[str, str]:
        """Headers of the 204 answering an allowed ``origin``'s preflight: the methods, and the
        requested headers kvlb accepts (others left out: the browser then refuses the call)."""
        requested = request_headers.get("Access-Control-Request-Headers", "")
        names = [n.strip().lower() for n in requested.split(",")[:MAX_REQUESTED_HEADERS] if n.strip()]
        allowed = [n for n in names if self._header_allowed(n)]
        headers = {
            **self._allow_origin(origin),
            "Access-Control-Allow-Methods": ALLOW_METHODS,
            "Access-Control-Max-Age": str(MAX_AGE_S),
        }
        if allowed:
            headers["Access-Control-Allow-Headers"] = ", ".join(allowed)
        if "Vary" in headers:
            headers["Vary"] = "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"
        return headers

    def _header_allowed(self, name: str) -> bool:
        return (
            name in ALLOWED_HEADERS or name == self.tenant_header or name.startswith(ALLOWED_HEADER_PREFIXES)
        )


def cors_path(path: str) -> bool:
    """Whether CORS applies to ``path``: ``/v1/*`` and ``/openapi.json``."""
    return path.startswith(PATH_PREFIX) or path == OPENAPI_PATH


def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
    """An ``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``: a browser's preflight."""
    return method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers
