"""Route and proxy one OpenAI request (I/O): choose → commit → forward → relay → release.

* **Choose**: candidates are the pool's routable replicas (:class:`~balancer.health.book.HealthBook`)
  that are below ``limits.max_inflight_per_replica``; :meth:`PoolRouter.plan` picks one.
* **Commit**: a :class:`Lease` reserves load and adds speculative index entries; it is released in
  ``finally`` whatever happens (end, error, client gone).
* **Forward**: the client's original body bytes go to the replica. The client response is not
  started until the replica's first body chunk arrives, so a replica that fails before it (connect
  error, 429/503, broken or silent stream) is retried on another one, up to ``limits.max_retries``.
* **Relay**: SSE chunks are written as they arrive, never re-parsed. A replica failing mid-stream ends
  the stream with one ``data: {"error": ...}`` event. A client going away closes the upstream
  response, so the replica stops generating.

Choose, commit, forward and release do not depend on the transport: :func:`dispatch` runs them and
hands the opened answer to a ``deliver`` callback (:func:`relay` for HTTP, the gRPC servicer's own
relay for ``Generate``); both relays share :func:`on_first_chunk` and :func:`on_relayed`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web

from balancer.api.errors import ApiError, retry_after
from balancer.api.parsing import ParsedRequest
from balancer.config import ReplicaConfig
from balancer.errors import NoReplicasAvailable, Overloaded, UpstreamError
from balancer.policy import PolicyWeights
from balancer.routing.router import RoutePlan
from balancer.service.state import OUTCOME, Outcome, Pool, ServiceState
from balancer.types import CostTerms, ReplicaId
from balancer.upstream.client import RetryableUpstream, UpstreamStream, forwardable_headers

log = logging.getLogger(__name__)

SSE_CONTENT_TYPE = "text/event-stream"
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
"""Largest non-streaming replica answer buffered before relaying; larger → 502."""
ERROR_EVENT_TIMEOUT_S = 1.0
"""How long writing the final error event to a slow client may take."""

T = TypeVar("T")


class _TermsLog:
    """Formats a decision's per-replica terms only when a DEBUG line is actually emitted."""

    __slots__ = ("_terms",)

    def __init__(self, terms: Sequence[CostTerms]) -> None:
        self._terms = terms

    def __str__(self) -> str:
        return "; ".join(
            f"{t.replica}: cost={t.cost} overlap={t.overlap_blocks}/{t.request_blocks} "
            f"prefill={t.prefill_term:.2f} duplication={t.duplication_term:.2f} "
            f"decode={t.decode_term:.2f} queue={t.queue_term:.2f}"
            + (f" excluded={t.excluded}" if t.excluded else "")
            for t in self._terms
        )


def candidates(
    state: ServiceState, pool: Pool, now: float, exclude: Collection[ReplicaId]
) -> list[ReplicaId]:
    """Routable replicas of ``pool`` below their in-flight cap; raises when there are none."""
    routable = [r for r in state.health.routable(now, pool.replicas) if r not in exclude]
    if not routable:
        raise NoReplicasAvailable(f"no healthy replica serves model {pool.model!r}")
    cap = state.settings.limits.max_inflight_per_replica
    eligible = [r for r in routable if state.inflight_by_replica.get(r, 0) < cap]
    if not eligible:
        raise Overloaded(f"every replica of model {pool.model!r} has {cap} requests in flight", 1.0)
    return eligible


def choose(
    state: ServiceState,
    pool: Pool,
    token_ids: Sequence[int],
    parsed: ParsedRequest,
    weights: PolicyWeights,
    request_id: str,
    exclude: Collection[ReplicaId] = (),
) -> RoutePlan:
    """A side-effect-free routing plan for one request (nothing is reserved yet)."""
    now = state.monotonic()
    eligible = candidates(state, pool, now, exclude)
    started = time.perf_counter()
    plan = pool.router.plan(
        token_ids,
        eligible,
        state.policy.policy_for(pool.model),
        weights,
        state.rng,
        now,
        session_key=parsed.session_key,
        request_id=request_id,
        max_tokens=parsed.max_tokens,
    )
    state.metrics.route_decision_seconds.observe(time.perf_counter() - started)
    decision = plan.decision
    log.debug(
        "route %s model=%s policy=%s -> %s (%s) cached_tokens=%d of %d; terms: %s",
        request_id,
        pool.model,
        decision.policy,
        decision.replica,
        decision.reason,
        plan.cached_tokens,
        plan.prompt_tokens,
        _TermsLog(decision.terms),
    )
    return plan


class Lease:
    """One committed decision: load reserved on the replica until :meth:`release` (idempotent)."""

    def __init__(self, state: ServiceState, pool: Pool, plan: RoutePlan, tracking_id: str) -> None:
        self.state = state
        self.pool = pool
        self.plan = plan
        self.replica = plan.decision.replica
        self.tracking_id = tracking_id
        self._released = False
        now = state.monotonic()
        pool.router.commit(
            plan,
            tracking_id,
            now,
            state.settings.limits.speculative_ttl_s,
            pending_ttl_s=state.settings.timeouts.first_byte_s,
        )
        state.inflight_by_replica[self.replica] = state.inflight_by_replica.get(self.replica, 0) + 1
        state.health.on_routed(self.replica, now)
        state.metrics.route_decisions_total.labels(plan.decision.policy, self.replica).inc()
        state.metrics.predicted_cached_tokens_total.labels(self.replica).inc(plan.cached_tokens)

    def first_token(self) -> None:
        self.pool.router.first_token(self.tracking_id, self.state.monotonic())

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.pool.router.release(self.tracking_id, self.state.monotonic())
        left = self.state.inflight_by_replica.get(self.replica, 0) - 1
        if left > 0:
            self.state.inflight_by_replica[self.replica] = left
        else:
            self.state.inflight_by_replica.pop(self.replica, None)


@dataclass(slots=True)
class Opened:
    """An upstream answer whose first body chunk has arrived (nothing sent to the client yet)."""

    stream: UpstreamStream
    chunks: AsyncGenerator[bytes, None]
    first: bytes


async def open_first(
    state: ServiceState, replica: ReplicaConfig, path: str, body: bytes, headers: dict[str, str]
) -> Opened:
    """Send the request and wait for the first body chunk; any failure so far is retryable."""
    stream = await state.upstream.open(replica.url, path, body, headers)
    chunks = stream.chunks()
    try:
        first = await anext(chunks, b"")
    except UpstreamError as exc:
        stream.close()
        raise RetryableUpstream("first_byte", str(exc)) from None
    except BaseException:
        stream.close()
        raise
    return Opened(stream, chunks, first)


@dataclass(frozen=True, slots=True)
class Forward:
    """One request ready to go: where, what, and who asked."""

    pool: Pool
    parsed: ParsedRequest
    token_ids: Sequence[int]
    weights: PolicyWeights
    body: bytes
    path: str
    request_id: str
    arrived: float
    """Monotonic arrival time (TTFT, end-to-end latency and the ``timeouts.total_s`` deadline)."""


async def forward(request: web.Request, state: ServiceState, job: Forward) -> web.StreamResponse:
    """Route, forward with retries before the first byte, relay; always release the load."""
    headers = forwardable_headers(request.headers, job.request_id)
    deliver = functools.partial(relay, request, state, job)
    return await dispatch(state, job, headers, request[OUTCOME], deliver)


async def dispatch(
    state: ServiceState,
    job: Forward,
    headers: Mapping[str, str],
    outcome: Outcome,
    deliver: Callable[[Lease, Opened], Awaitable[T]],
) -> T:
    """Choose → commit → forward (retried on another replica until the first byte) → ``deliver`` →
    release; the load is released whatever happens. Raises :class:`ApiError` 429/502 when every
    attempt failed, and :class:`NoReplicasAvailable` / :class:`Overloaded` when none could start."""
    exclude: set[ReplicaId] = set()
    last_error: RetryableUpstream | None = None
    max_retries = state.settings.limits.max_retries
    for attempt in range(max_retries + 1):
        try:
            plan = choose(state, job.pool, job.token_ids, job.parsed, job.weights, job.request_id, exclude)
        except (NoReplicasAvailable, Overloaded) as exc:
            if last_error is None:
                reason = "no_healthy" if isinstance(exc, NoReplicasAvailable) else "replica_full"
                state.metrics.shed_total.labels(reason).inc()
                raise
            break
        outcome.replica, outcome.policy = plan.decision.replica, plan.decision.policy
        lease = Lease(state, job.pool, plan, state.tracking_id(job.request_id))
        try:
            replica = job.pool.replicas[lease.replica]
            try:
                opened = await open_first(state, replica, job.path, job.body, dict(headers))
            except RetryableUpstream as exc:
                if exc.status != 429:  # a busy replica is not a broken one
                    state.health.on_failure(lease.replica, state.monotonic(), str(exc))
                log.warning(
                    "request %s: replica %s failed before answering: %s", job.request_id, replica.id, exc
                )
                exclude.add(lease.replica)
                last_error = exc
                if attempt < max_retries:
                    state.metrics.retries_total.labels(exc.reason).inc()
                continue
            return await deliver(lease, opened)
        finally:
            lease.release()
    failed = ", ".join(sorted(exclude))
    if last_error is not None and last_error.status == 429:
        raise ApiError(429, f"replica(s) {failed} are busy (429)", headers=retry_after(1.0))
    raise ApiError(502, f"replica(s) {failed} failed before answering and no other could: {last_error}")


async def relay(
    request: web.Request, state: ServiceState, job: Forward, lease: Lease, opened: Opened
) -> web.StreamResponse:
    """Send the replica's answer to the client; closes the upstream if the client goes away."""
    outcome = request[OUTCOME]
    stream = opened.stream
    on_first_chunk(state, job, lease, stream)
    headers = {
        "Content-Type": stream.content_type,
        "x-request-id": job.request_id,
        "x-kvlb-replica": lease.replica,
        "x-kvlb-cached-tokens": str(lease.plan.cached_tokens),
    }
    deadline = relay_deadline(state, job)
    try:
        if stream.content_type.startswith(SSE_CONTENT_TYPE):
            response = await _relay_stream(request, state, lease, opened, headers, deadline)
        else:
            response = await _relay_whole(state, lease, opened, headers, deadline)
    except asyncio.CancelledError:  # the client went away (handler cancellation)
        stream.close()
        outcome.status = "499"
        raise
    except BaseException:
        stream.close()
        raise
    finally:
        await opened.chunks.aclose()
    on_relayed(state, job, lease, stream, complete=outcome.status is None)
    return response


def on_first_chunk(state: ServiceState, job: Forward, lease: Lease, stream: UpstreamStream) -> None:
    """Bookkeeping once the replica's first body chunk is in: first token, health, TTFT."""
    lease.first_token()
    if stream.status < 500:
        state.health.on_success(lease.replica)
    else:
        state.health.on_failure(lease.replica, state.monotonic(), f"replica answered {stream.status}")
    policy = lease.plan.decision.policy
    state.metrics.ttft_seconds.labels(lease.replica, policy).observe(state.monotonic() - job.arrived)


def relay_deadline(state: ServiceState, job: Forward) -> float:
    """The loop time at which ``timeouts.total_s`` since the request's arrival runs out."""
    remaining_s = state.settings.timeouts.total_s - (state.monotonic() - job.arrived)
    return asyncio.get_running_loop().time() + max(0.0, remaining_s)


def on_relayed(
    state: ServiceState, job: Forward, lease: Lease, stream: UpstreamStream, complete: bool
) -> None:
    """Bookkeeping once relaying ended: a complete answer returns its connection to the pool and
    reports the engine's cached tokens; anything else closes the connection."""
    if complete:
        stream.release()
        usage = stream.usage()
        if usage.cached_tokens is not None:
            state.metrics.reported_cached_tokens_total.labels(lease.replica).inc(usage.cached_tokens)
    else:
        stream.close()
    policy = lease.plan.decision.policy
    state.metrics.e2e_seconds.labels(lease.replica, policy).observe(state.monotonic() - job.arrived)


async def _relay_stream(
    request: web.Request,
    state: ServiceState,
    lease: Lease,
    opened: Opened,
    headers: dict[str, str],
    deadline: float,
) -> web.StreamResponse:
    outcome = request[OUTCOME]
    response = web.StreamResponse(status=opened.stream.status, headers=headers)
    response.headers["Cache-Control"] = "no-cache"
    try:
        await response.prepare(request)
        await response.write(opened.first)
        try:
            async with asyncio.timeout_at(deadline):
                async for chunk in opened.chunks:
                    await response.write(chunk)
        except (UpstreamError, TimeoutError) as exc:
            message = failure_message(state, lease, exc)
            log.warning(
                "request %s: replica %s broke mid-stream: %s", headers["x-request-id"], lease.replica, message
            )
            outcome.status = "stream_error"
            async with asyncio.timeout(ERROR_EVENT_TIMEOUT_S):
                await response.write(sse_error_event(f"replica {lease.replica} failed mid-stream: {message}"))
        await response.write_eof()
    except (ConnectionResetError, TimeoutError):  # the client went away or stopped reading
        outcome.status = "499"
    return response


async def _relay_whole(
    state: ServiceState, lease: Lease, opened: Opened, headers: dict[str, str], deadline: float
) -> web.Response:
    parts = [opened.first]
    size = len(opened.first)
    try:
        async with asyncio.timeout_at(deadline):
            async for chunk in opened.chunks:
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise UpstreamError(f"answer larger than {MAX_RESPONSE_BYTES} bytes")
                parts.append(chunk)
    except (UpstreamError, TimeoutError) as exc:
        message = failure_message(state, lease, exc)
        raise ApiError(502, f"replica {lease.replica} failed while answering: {message}") from None
    return web.Response(status=opened.stream.status, body=b"".join(parts), headers=headers)


def failure_message(state: ServiceState, lease: Lease, exc: Exception) -> str:
    """Describe a failure after the first byte; only the replica's own failures count against it
    (not the request's overall ``timeouts.total_s`` deadline)."""
    if isinstance(exc, UpstreamError):
        state.health.on_failure(lease.replica, state.monotonic(), str(exc))
        return str(exc)
    return f"request exceeded timeouts.total_s = {state.settings.timeouts.total_s}s"


def sse_error_event(message: str, status: int = 502) -> bytes:
    payload = {"error": {"message": message, "type": "upstream_error", "code": status}}
    return b"data: " + json.dumps(payload).encode("utf-8") + b"\n\n"
