"""Serve one request whatever the face (I/O): admit → route → open → retry → deliver → release.

Both faces (HTTP :mod:`balancer.api.openai`, gRPC :mod:`balancer.api.grpc.server`) parse and
tokenize a request into a :class:`Forward`, and relay the opened answer in their own protocol; the
rest is here, once:

* **Admit** (:func:`balancer.service.admitted.admitted`, which the faces enter before the rest):
  one of ``limits.max_inflight`` slots and the body's bytes of ``limits.max_inflight_body_bytes``,
  waiting in the bounded queue of
  :mod:`balancer.service.admission` (full → 429, waited ``limits.queue_timeout_s`` → 503), and the
  same queue while every routable replica of the pool is at ``limits.max_inflight_per_replica``.
* **Route**: :meth:`PoolRouter.route <balancer.routing.router.PoolRouter.route>` picks the replica
  and commits the decision as a :class:`~balancer.routing.router.Lease` (load reserved, speculative
  index entries added); the lease is released in ``finally`` whatever happens.
* **Open**: the client's original body bytes go to the replica, and nothing is sent to the client
  until the replica's first body chunk arrives, so a replica that fails before it (connect error,
  429/503, broken or silent stream) is retried on another one, up to ``limits.max_retries``.
* **Deliver**: the face's relay gets the lease and the opened answer; :func:`on_first_chunk` and
  :func:`on_relayed` are the bookkeeping both relays share (first token, health, TTFT, usage).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from balancer.config import ReplicaConfig
from balancer.errors import NoReplicasAvailable, Overloaded, UpstreamError, UpstreamTimeout
from balancer.health.book import PROBES_FAILING
from balancer.policy import PolicyWeights
from balancer.routing.receipts import Settled
from balancer.routing.router import Lease, PoolRequest, RoutePlan, computed_blocks
from balancer.service.state import Outcome, Pool, ServiceState
from balancer.types import CostTerms, ReplicaId
from balancer.upstream.client import RetryableUpstream, UpstreamStream

log = logging.getLogger(__name__)

PROBE_CHECK_MIN_S = 0.05
"""Shortest period at which :class:`ProbeWatch` looks at the replica's probes (seconds)."""
BUSY_RETRY_AFTER_S = 1.0
"""``Retry-After`` when every replica tried answered 429 (seconds)."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Forward:
    """One parsed and tokenized request, ready to go: where, what, and who asked."""

    pool: Pool
    token_ids: Sequence[int]
    weights: PolicyWeights
    session_key: str | None
    """The OpenAI ``user`` field (the ``session`` policy)."""
    max_tokens: int
    """Completion tokens asked for; 0 when absent."""
    body: bytes
    """The client's body, forwarded byte for byte, but for ``stream_options.include_usage`` when
    kvlb asked the engine for usage (:attr:`usage_added`)."""
    path: str
    request_id: str
    arrived: float
    """Monotonic arrival time (TTFT, end-to-end latency and the ``timeouts.total_s`` deadline)."""
    tenant: str | None = None
    """The ``tenant_header`` value, kept with the decision in the console's ring."""
    whole_answer: bool = False
    """A non-streaming request: the engine sends its headers only with the whole answer, after its
    last token, so they are waited for until ``timeouts.total_s`` runs out, not
    ``timeouts.first_byte_s`` (:func:`open_first`)."""
    sequences: int = 1
    """OpenAI's ``n``: sequences the engine generates, each up to ``max_tokens`` (decode load)."""
    usage_added: bool = False
    """kvlb added ``stream_options.include_usage`` the client did not ask for (``pools[].stream_usage``):
    the relay takes the usage back out of the answer (:class:`~balancer.upstream.stream_usage.UsageStrip`)."""


@dataclass(slots=True)
class Opened:
    """An upstream answer whose first body chunk has arrived (nothing sent to the client yet)."""

    stream: UpstreamStream
    chunks: AsyncGenerator[bytes, None]
    first: bytes


class _TermsLog:
    """Formats a decision's per-replica terms only when a DEBUG line is actually emitted."""

    __slots__ = ("_terms",)

    def __init__(self, terms: Sequence[CostTerms]) -> None:
        self._terms = terms

    def __str__(self) -> str:
        return "; ".join(
            f"{t.replica}: cost={t.cost} overlap={t.overlap_blocks}/{t.request_blocks} "
            f"prefill={t.prefill_term:.2f} duplication={t.duplication_term:.2f} "
            f"interference={t.interference_term:.2f} admission={t.admission_term:.2f} "
            f"roots={t.root_term:.2f} "
            f"decode={t.decode_term:.2f} queue={t.queue_term:.2f}"
            + (f" excluded={t.excluded}" if t.excluded else "")
            for t in self._terms
        )


def pool_request(state: ServiceState, job: Forward, exclude: Collection[ReplicaId] = ()) -> PoolRequest:
    """``job`` as its pool's router sees it, under the policy in force for that pool."""
    return PoolRequest(
        token_ids=job.token_ids,
        policy=state.policy.policy_for(job.pool.model),
        weights=job.weights,
        request_id=job.request_id,
        session_key=job.session_key,
        max_tokens=job.max_tokens,
        sequences=job.sequences,
        exclude=frozenset(exclude),
    )


def select(state: ServiceState, job: Forward) -> RoutePlan:
    """The decision for ``job``, committing nothing (explain, gRPC ``Route`` without ``reserve``)."""
    started = time.perf_counter()
    plan = job.pool.router.select(pool_request(state, job), state.monotonic())
    state.metrics.route_decision_seconds.observe(time.perf_counter() - started)
    _log_decision(job, plan)
    return plan


def route(state: ServiceState, job: Forward, exclude: Collection[ReplicaId] = ()) -> Lease:
    """Route and commit ``job``: the lease holds its load until released. Raises
    :class:`NoReplicasAvailable` / :class:`Overloaded` when no replica can take it."""
    started = time.perf_counter()
    lease = job.pool.router.route(pool_request(state, job, exclude), state.monotonic())
    state.metrics.route_decision_seconds.observe(time.perf_counter() - started)
    _log_decision(job, lease.plan)
    record_commit(state, job, lease)
    return lease


def commit(state: ServiceState, job: Forward, plan: RoutePlan) -> Lease:
    """Commit a plan made by :func:`select` (gRPC ``Route`` with ``reserve``)."""
    lease = job.pool.router.lease(plan, job.request_id, state.monotonic())
    record_commit(state, job, lease)
    return lease


def record_commit(state: ServiceState, job: Forward, lease: Lease) -> None:
    """Count a committed decision, and keep it in the pool's decision ring (the console)."""
    plan = lease.plan
    metrics = state.metrics
    replica = metrics.replica_label(lease.replica)
    metrics.children.of(metrics.route_decisions_total, plan.decision.policy, replica).inc()
    metrics.children.of(metrics.predicted_cached_tokens_total, replica).inc(plan.cached_tokens)
    if plan.inputs is not None:
        record = state.decisions.record(
            job.pool.model,
            plan.inputs,
            plan.decision,
            job.weights,
            plan.prompt_tokens,
            plan.cached_tokens,
            job.tenant,
            state.wall_clock(),
            decode_blocks=plan.decode_blocks,
            sequences=plan.sequences,
            left_out=plan.left_out,
        )
        # the spans of its load (the what-if moves it for them): a partial, no closure cell kept
        lease.on_phase = partial(state.decisions.on_phase, job.pool.model, record.id, plan.inputs.load.now)
    if state.series is not None:
        state.series.on_commit(lease.replica, plan.prompt_tokens, plan.cached_tokens, state.wall_clock())


def _log_decision(job: Forward, plan: RoutePlan) -> None:
    if not log.isEnabledFor(logging.DEBUG):  # the arguments and their holder cost more than the check
        return
    decision = plan.decision
    log.debug(
        "route %s model=%s policy=%s -> %s (%s) cached_tokens=%d of %d; terms: %s",
        job.request_id,
        job.pool.model,
        decision.policy,
        decision.replica,
        decision.reason,
        plan.cached_tokens,
        plan.prompt_tokens,
        _TermsLog(decision.terms),
    )


async def open_first(
    state: ServiceState, replica: ReplicaConfig, job: Forward, headers: Mapping[str, str]
) -> Opened:
    """Send the request and wait for the first body chunk; any failure so far is retryable, but for
    the end of ``timeouts.total_s`` while the engine works on it (504, :class:`ProbeWatch`).

    What the engine does before its first byte is work, not silence: a whole answer's
    (:attr:`Forward.whole_answer`) headers come after its last token, and a stream's first chunk
    after its queueing and prefill (its headers come at once). Those two waits last until
    ``timeouts.total_s`` runs out, as long as the replica passes its health probes; a stream's
    headers still have ``timeouts.first_byte_s``, and a whole answer's body (sent right after its
    headers) ``timeouts.idle_s``."""
    remaining_s = max(0.0, state.settings.timeouts.total_s - (state.monotonic() - job.arrived))
    if job.whole_answer:
        async with ProbeWatch(state, replica):
            stream = await state.upstream.open(
                replica.url,
                job.path,
                job.body,
                headers,
                whole_answer_s=remaining_s,
                api_key=replica.api_key,
            )
        chunks = stream.chunks()
    else:
        stream = await state.upstream.open(replica.url, job.path, job.body, headers, api_key=replica.api_key)
        chunks = stream.chunks(first_wait_s=remaining_s)
    try:
        if job.whole_answer:
            first = await anext(chunks, b"")
        else:
            async with ProbeWatch(state, replica):
                first = await anext(chunks, b"")
    except UpstreamTimeout:  # timeouts.total_s passed while the engine worked: 504, not retried
        stream.close()
        raise
    except UpstreamError as exc:
        stream.close()
        raise RetryableUpstream("first_byte", str(exc)) from None
    except BaseException:
        stream.close()
        raise
    return Opened(stream, chunks, first)


async def dispatch(
    state: ServiceState,
    job: Forward,
    headers: Mapping[str, str],
    outcome: Outcome,
    deliver: Callable[[Lease, Opened], Awaitable[T]],
) -> T:
    """Route → open (retried on another replica until the first byte) → ``deliver`` → release; the
    load is released whatever happens. Raises :class:`Overloaded` (every replica tried answered 429),
    :class:`NoReplicasAvailable` (every one answered 503: a 503 with ``Retry-After`` for the client,
    as the engines answered, not a 502) or :class:`UpstreamError` (every attempt failed), and
    :class:`NoReplicasAvailable` /
    :class:`Overloaded` when none could start."""
    exclude: set[ReplicaId] = set()
    last_error: RetryableUpstream | None = None
    statuses: set[int | None] = set()
    """The answer of each failed attempt (``None``: no answer: refused, reset, timed out)."""
    max_retries = state.settings.limits.max_retries
    for attempt in range(max_retries + 1):
        try:
            lease = route(state, job, exclude)
        except (NoReplicasAvailable, Overloaded) as exc:
            if last_error is None:
                reason = "no_healthy" if isinstance(exc, NoReplicasAvailable) else "replica_full"
                state.metrics.shed_total.labels(reason).inc()
                raise
            break
        outcome.replica, outcome.policy = lease.replica, lease.plan.decision.policy
        try:
            replica = job.pool.replicas[lease.replica]
            try:
                opened = await open_first(state, replica, job, headers)
            except RetryableUpstream as exc:
                if exc.status != 429:  # a busy replica is not a broken one
                    state.health.on_failure(lease.replica, state.monotonic(), str(exc))
                log.warning(
                    "request %s: replica %s failed before answering: %s", job.request_id, replica.id, exc
                )
                exclude.add(lease.replica)
                last_error = exc
                statuses.add(exc.status)
                if attempt < max_retries:
                    state.metrics.retries_total.labels(exc.reason).inc()
                continue
            return await deliver(lease, opened)
        finally:
            lease.release(state.monotonic())
    failed = ", ".join(sorted(exclude))
    if last_error is not None and last_error.status == 429:
        raise Overloaded(f"replica(s) {failed} are busy (429)", BUSY_RETRY_AFTER_S)
    if statuses == {503}:  # every replica tried said "unavailable, try later", as a 503 (Retry-After)
        raise NoReplicasAvailable(f"replica(s) {failed} answered 503 (unavailable): try again later")
    raise UpstreamError(f"replica(s) {failed} failed before answering and no other could: {last_error}")


class ProbeWatch:
    """``async with ProbeWatch(state, replica):`` a wait on ``replica`` that may last as long as the
    engine works (a whole answer's headers, a stream's first token), given up as
    :class:`RetryableUpstream` once the replica fails its health probes: a hung engine still
    accepts connections and stays silent, but fails them. An engine working on a request (a long
    answer, a deep queue, a long prefill) sends nothing meanwhile and passes its probes, and a bound
    on that silence took long work for a failure (a whole answer longer than
    ``timeouts.first_byte_s`` was started over on every replica, then failed with 502). Checked
    every ``health_interval_s``, how often the probes can change their verdict, by one timer
    callback that cancels the waiting task as ``asyncio.timeout`` does (no task of its own: a
    stream's first token is waited for under it)."""

    __slots__ = ("_cancelling", "_check_s", "_handle", "_replica", "_state", "_task", "failed")

    def __init__(self, state: ServiceState, replica: ReplicaConfig) -> None:
        self._state = state
        self._replica = ReplicaId(replica.id)
        self._check_s = max(PROBE_CHECK_MIN_S, state.settings.health_interval_s)
        self._task: asyncio.Task[object] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._cancelling = 0
        self.failed = False

    async def __aenter__(self) -> ProbeWatch:
        self._task = asyncio.current_task()
        assert self._task is not None
        self._cancelling = self._task.cancelling()
        self._handle = asyncio.get_running_loop().call_later(self._check_s, self._check)
        return self

    def _check(self) -> None:
        state = self._state
        if state.health.unroutable_reason(self._replica, state.monotonic()) == PROBES_FAILING:
            self.failed = True
            assert self._task is not None
            self._task.cancel()
        else:
            self._handle = asyncio.get_running_loop().call_later(self._check_s, self._check)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        if self._handle is not None:
            self._handle.cancel()
        assert self._task is not None
        if self.failed and exc_type is asyncio.CancelledError and self._task.uncancel() <= self._cancelling:
            raise RetryableUpstream("timeout", f"{self._replica} sent nothing yet and fails its probes")


def on_first_chunk(state: ServiceState, job: Forward, lease: Lease, stream: UpstreamStream) -> None:
    """Bookkeeping once the replica's first body chunk is in: first token, health, TTFT."""
    now = state.monotonic()
    lease.first_token(now)
    if stream.status < 500:
        state.health.on_success(lease.replica)
    else:
        state.health.on_failure(lease.replica, now, f"replica answered {stream.status}")
    policy = lease.plan.decision.policy
    metrics = state.metrics
    replica = metrics.replica_label(lease.replica)
    metrics.children.of(metrics.ttft_seconds, job.pool.model, replica, policy).observe(now - job.arrived)
    if state.series is not None:
        state.series.on_ttft(now - job.arrived, state.wall_clock())


def relay_deadline(state: ServiceState, job: Forward) -> float:
    """The loop time at which ``timeouts.total_s`` since the request's arrival runs out."""
    remaining_s = state.settings.timeouts.total_s - (state.monotonic() - job.arrived)
    return asyncio.get_running_loop().time() + max(0.0, remaining_s)


def on_relayed(
    state: ServiceState, job: Forward, lease: Lease, stream: UpstreamStream, complete: bool
) -> None:
    """Bookkeeping once relaying ended: a complete answer returns its connection to the pool;
    anything else closes the connection. An answer that is all in reports the engine's cached
    tokens (:func:`on_answered`), even when the client left before the last bytes reached it."""
    on_answered(state, lease, stream)
    if complete:
        stream.release()
    else:
        stream.close()
    metrics = state.metrics
    policy = lease.plan.decision.policy
    replica = metrics.replica_label(lease.replica)
    elapsed_s = state.monotonic() - job.arrived
    metrics.children.of(metrics.e2e_seconds, job.pool.model, replica, policy).observe(elapsed_s)


def on_answered(state: ServiceState, lease: Lease, stream: UpstreamStream) -> None:
    """The engine's usage report, once its answer is all in (:attr:`UpstreamStream.answered`): the
    reported cached tokens and a receipt. Also called when the client leaves right after the last
    event, before the body's end was read (the handler is cancelled then, and nothing else runs)."""
    if not stream.answered:
        return
    usage = stream.usage()
    if usage.cached_tokens is None:
        return
    metrics = state.metrics
    replica = metrics.replica_label(lease.replica)
    metrics.children.of(metrics.reported_cached_tokens_total, replica).inc(usage.cached_tokens)
    record_receipt(state, lease, usage.cached_tokens)
    if state.series is not None:
        prompt = usage.prompt_tokens if usage.prompt_tokens is not None else lease.plan.prompt_tokens
        state.series.on_usage(prompt, usage.cached_tokens, state.wall_clock())


def record_receipt(state: ServiceState, lease: Lease, cached_tokens: int) -> Settled:
    """The engine's ``cached_tokens`` for a routed request: compare it with the prediction, let the
    router correct the index, and count both (``kvlb_route_prediction_error_blocks`` and friends)."""
    settled = lease.settle_receipt(cached_tokens, state.monotonic())
    receipt, metrics = settled.receipt, state.metrics
    replica = metrics.replica_label(lease.replica)  # its series, or the removed replicas' one
    child = metrics.children.of
    child(metrics.prediction_error_blocks, replica).observe(receipt.error_blocks)
    child(metrics.receipts_total, replica).inc()
    computed = computed_blocks(lease.plan, receipt.reported_blocks)
    if computed > 0:
        child(metrics.computed_prompt_blocks_total, replica).inc(computed)
        stalled_hint_s = state.settings.events_stalled_hint_s
        if stalled_hint_s > 0:  # when: its decision, before the engine computed and published them
            routed_wall_s = state.wall_clock() - (state.monotonic() - lease.routed_at)
            lease.mark_computed(computed, routed_wall_s, stalled_hint_s / 4)
    if receipt.exact:
        child(metrics.receipts_exact_total, replica).inc()
    if receipt.within_one_block:
        child(metrics.receipts_within_block_total, replica).inc()
    if receipt.stale:
        child(metrics.receipt_stale_blocks_total, replica).inc(len(receipt.stale))
    if settled.dropped_blocks:
        child(metrics.index_receipt_drops_blocks_total, replica).inc(settled.dropped_blocks)
    if settled.learned_blocks:
        child(metrics.index_receipt_learned_blocks_total, replica).inc(settled.learned_blocks)
    if settled.taught_blocks:
        child(metrics.index_receipt_taught_blocks_total, replica).inc(settled.taught_blocks)
    if settled.confirmed_blocks:
        child(metrics.index_receipt_confirmed_blocks_total, replica).inc(settled.confirmed_blocks)
    accuracy = lease.router_receipts.accuracy(lease.replica)  # None once it left: nothing recorded
    if accuracy is not None:  # memoised: the replica's removal forgets the child it removes
        child(metrics.prediction_accuracy_ratio, replica).set(accuracy)
    if not receipt.within_one_block and log.isEnabledFor(logging.DEBUG):
        log.debug(
            "receipt %s on %s: predicted %d blocks, engine reported %d (stale %d, dropped %d, learned %d)",
            lease.tracking_id,
            lease.replica,
            receipt.predicted_blocks,
            receipt.reported_blocks,
            len(receipt.stale),
            settled.dropped_blocks,
            settled.learned_blocks,
        )
    return settled


def failure_message(state: ServiceState, lease: Lease, exc: Exception) -> str:
    """Describe a failure after the first byte; only the replica's own failures count against it
    (not the request's overall ``timeouts.total_s`` deadline)."""
    if isinstance(exc, UpstreamError):
        state.health.on_failure(lease.replica, state.monotonic(), str(exc))
        return str(exc)
    return f"request exceeded timeouts.total_s = {state.settings.timeouts.total_s}s"
