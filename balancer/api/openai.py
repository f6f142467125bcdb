"""The OpenAI-compatible endpoints (I/O): ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Per request: admission (``limits.max_inflight`` with a queue of ``limits.max_queued``: full → 429,
waited ``limits.queue_timeout_s`` → 503; see :mod:`balancer.service.admission`), a bounded body read
(``limits.max_body_bytes`` → 413, ``timeouts.body_read_s`` → 408), JSON validation (400), the pool
by ``model`` (404 listing the known models), tokenisation with the pool's tokenizer (long prompts in a
thread), a wait in the same queue while every replica is full, then :func:`balancer.api.proxy.forward`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from balancer.api.errors import ApiError, retry_after
from balancer.api.parsing import ParsedRequest, RequestKind, parse_request, parse_weights_header
from balancer.api.proxy import Forward, forward
from balancer.policy import PolicyWeights
from balancer.service.admission import Admission, AdmissionLimits, AdmissionRefused
from balancer.service.state import REQUEST_ID, STATE, Pool, ServiceState
from balancer.tokenizer.tokenizer import TokenizeError

INLINE_TOKENIZE_CHARS = 4096
"""Prompts with fewer characters are tokenized on the event loop; longer ones in a thread."""
BODY_READ_CHUNK_BYTES = 64 * 1024
WEIGHTS_HEADER = "x-kvlb-weights"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat", "/v1/chat/completions")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completions", "/v1/completions")


async def models(request: web.Request) -> web.Response:
    """Every pool's model (the balancer's configuration, not a query of the replicas)."""
    state = request.app[STATE]
    data = [
        {"id": model, "object": "model", "created": 0, "owned_by": "kvlb", "replicas": len(pool.replicas)}
        for model, pool in state.pools.items()
    ]
    return web.json_response({"object": "list", "data": data})


async def _serve(request: web.Request, kind: RequestKind, path: str) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = state.monotonic()
    limits = state.settings.limits
    async with admitted(state) as admission:
        body = await read_body(request, limits.max_body_bytes, state.settings.timeouts.body_read_s)
        parsed = parse_request(body, kind)
        pool = find_pool(state, parsed.model)
        weights = request_weights(request, state)
        token_ids = await tokenize(pool, parsed, limits.max_prompt_tokens)
        job = Forward(pool, parsed, token_ids, weights, body, path, request[REQUEST_ID], arrived)
        await admission.wait_for_replica(pool)
        return await forward(request, state, job)


class Admitted:
    """What :func:`admitted` yields: the request's queue deadline, for its wait for a replica slot."""

    def __init__(self, state: ServiceState, admission: Admission, deadline: float) -> None:
        self.state = state
        self.admission = admission
        self.deadline = deadline

    async def wait_for_replica(self, pool: Pool) -> None:
        """Wait in the admission queue while every routable replica of ``pool`` is full (then the
        request goes on; with no routable replica it goes on at once, to get its 503)."""
        cap = self.state.settings.limits.max_inflight_per_replica
        what = f"every replica of model {pool.model!r} has {cap} requests in flight"
        try:
            await self.admission.wait_until(
                functools.partial(_replica_free, self.state, pool), self.deadline, what
            )
        except AdmissionRefused as exc:
            raise _refusal(self.state, exc, "replica_full") from None


@contextlib.asynccontextmanager
async def admitted(state: ServiceState) -> AsyncIterator[Admitted]:
    """Hold one of ``limits.max_inflight`` slots (waiting in the bounded queue if need be) for the
    body of the ``async with``; refusals are :class:`ApiError` 429 (queue full) or 503 (timeout)."""
    admission = admission_of(state)
    deadline = admission.deadline()
    try:
        await admission.enter(deadline)
    except AdmissionRefused as exc:
        raise _refusal(state, exc, "max_inflight") from None
    state.inflight += 1
    state.metrics.inflight_requests.inc()
    try:
        yield Admitted(state, admission, deadline)
    finally:
        state.inflight -= 1
        state.metrics.inflight_requests.dec()
        admission.leave()


def admission_of(state: ServiceState) -> Admission:
    """The service's admission queue, built from ``settings.limits`` on first use."""
    if state.admission is None:
        limits = state.settings.limits
        state.admission = Admission(
            AdmissionLimits(limits.max_inflight, limits.max_queued, limits.queue_timeout_s)
        )
    return state.admission


def _replica_free(state: ServiceState, pool: Pool) -> bool:
    routable = state.health.routable(state.monotonic(), pool.replicas)
    cap = state.settings.limits.max_inflight_per_replica
    return not routable or any(state.inflight_by_replica.get(r, 0) < cap for r in routable)


def _refusal(state: ServiceState, exc: AdmissionRefused, full_reason: str) -> ApiError:
    state.metrics.shed_total.labels(full_reason if exc.reason == "queue_full" else exc.reason).inc()
    return ApiError(exc.status, exc.message, headers=retry_after(exc.retry_after_s))


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, at most ``max_bytes`` (413) read within ``timeout_s`` (408)."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise ApiError(413, f"request body of {declared} bytes exceeds limits.max_body_bytes = {max_bytes}")
    buffer = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_chunked(BODY_READ_CHUNK_BYTES):
                buffer += chunk
                if len(buffer) > max_bytes:
                    raise ApiError(413, f"request body exceeds limits.max_body_bytes = {max_bytes}")
    except TimeoutError:
        raise ApiError(408, f"request body not received within {timeout_s}s") from None
    return bytes(buffer)


def find_pool(state: ServiceState, model: str) -> Pool:
    pool = state.pools.get(model)
    if pool is None:
        known = ", ".join(sorted(state.pools)) or "none"
        raise ApiError(
            404, f"model {model!r} is not served here; known models: {known}", kind="model_not_found"
        )
    return pool


def request_weights(request: web.Request, state: ServiceState) -> PolicyWeights:
    """The policy weights in force, or the ``x-kvlb-weights`` override when it is allowed (else 403)."""
    base = state.policy.view.weights
    header = request.headers.get(WEIGHTS_HEADER)
    if header is None:
        return base
    if not state.settings.auth.allow_weight_override:
        raise ApiError(403, f"{WEIGHTS_HEADER} is not allowed here (auth.allow_weight_override is off)")
    return parse_weights_header(header, base)


async def tokenize(pool: Pool, parsed: ParsedRequest, max_prompt_tokens: int) -> list[int]:
    """The prompt's token ids as the engine will compute them; 400 when it cannot be tokenized
    or has more than ``max_prompt_tokens``."""
    tokenizer = pool.tokenizer
    encode: Callable[[], list[int]]
    if parsed.kind == "chat":
        assert parsed.messages is not None
        encode = functools.partial(tokenizer.encode_chat, parsed.messages, **parsed.chat_kwargs)
    else:
        assert parsed.prompt is not None
        encode = functools.partial(tokenizer.encode_prompt, parsed.prompt)
    try:
        if parsed.text_chars > INLINE_TOKENIZE_CHARS:
            token_ids = await asyncio.to_thread(encode)
        else:
            token_ids = encode()
    except TokenizeError as exc:
        raise ApiError(400, str(exc)) from None
    if len(token_ids) > max_prompt_tokens:
        raise ApiError(
            400, f"prompt has {len(token_ids)} tokens, over limits.max_prompt_tokens = {max_prompt_tokens}"
        )
    return token_ids


def add_openai_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
