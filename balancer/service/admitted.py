"""A request's hold on the admission (async, no I/O): the slot of ``limits.max_inflight`` (and of its
tenant's caps), the bytes of ``limits.max_inflight_body_bytes``, the prompt tokens of
``limits.max_inflight_prompt_tokens_per_tenant``, the wait for a replica slot, and the tenant's rate
check before any of them; each refusal counted in ``kvlb_admission_shed_total``.

Both faces (HTTP :mod:`balancer.api.openai`, gRPC :mod:`balancer.api.grpc.calls`) take it before they
route (:func:`admitted`, :func:`held`): the *admit* step of :mod:`balancer.service.dispatch`. The
queue, its caps and its order are :mod:`balancer.service.admission`'s; this module is the one
request's side of it. Split from :mod:`balancer.service.dispatch` on 2026-12-01.
"""

from __future__ import annotations

import asyncio

from balancer.routing.router import every_replica_full
from balancer.service.admission import (
    MAX_BYTES,
    TENANT_INFLIGHT,
    TENANT_PROMPT_TOKENS,
    TENANT_QUEUE,
    TENANT_RATE,
    AdmissionRefused,
    Tenant,
)
from balancer.service.state import Pool, ServiceState
from balancer.service.tokenizer_gate import TENANT_TOKENIZING


class Admitted:
    """One request's hold on an admission slot (of its tenant) and on bytes of
    ``limits.max_inflight_body_bytes``: :func:`admitted` (an ``async with``) takes them and gives them
    all back, whatever way the request ends; the body gets this object, with the request's queue
    deadline for its wait for a replica slot, and holds more bytes through it (:meth:`hold`,
    :meth:`add`) or gives back part of its reservation (:meth:`give_back`). :func:`held` is the same
    hold without a slot. A plain class rather than a generator-based context manager: it is entered
    once per request."""

    __slots__ = (
        "body_bytes",
        "deadline",
        "prompt_release",
        "prompt_tokens",
        "slot",
        "state",
        "tenant",
        "tenant_name",
        "tokenizer_turn",
        "tokenizing_bytes",
    )

    def __init__(
        self, state: ServiceState, body_bytes: int, tenant_name: str | None, slot: bool = True
    ) -> None:
        self.state = state
        self.body_bytes = body_bytes
        """Bytes this request holds (reserved on entering, then held and added), given back on exit."""
        self.deadline = 0.0
        """The loop time at which the request stops waiting (set on entering)."""
        self.tenant_name = tenant_name
        """The ``tenant_header`` value (``None``: the default tenant)."""
        self.tenant: Tenant | None = None
        """The tenant whose slot the request holds (set on entering; ``None`` without a slot)."""
        self.slot = slot
        """Whether it takes an admission slot (else bytes only, before the queued newcomers)."""
        self.prompt_tokens = 0
        """Prompt tokens it holds of its tenant's ``limits.max_inflight_prompt_tokens_per_tenant``
        (:meth:`take_prompt_tokens`), given back at the replica's first chunk or on exit."""
        self.prompt_release: asyncio.TimerHandle | None = None
        """The timer giving back :attr:`prompt_tokens` at the estimated end of a non-streaming
        request's prefill (:meth:`give_back_prompt_tokens_after`), cancelled when they are given back."""
        self.tokenizing_bytes = 0
        """The part of :attr:`body_bytes` held while it is tokenized in a thread, for its parsed form
        and the tokenizer's work (:meth:`try_hold_tokenizing`)."""
        self.tokenizer_turn = False
        """Whether it holds a turn of its tenant's ``limits.max_tokenizing_per_tenant``
        (:meth:`try_enter_tokenizer`)."""

    async def __aenter__(self) -> Admitted:
        admission = self.state.admission
        deadline = self.deadline = admission.deadline()
        if not self.slot:
            try:
                await admission.hold(self.body_bytes, deadline)
            except AdmissionRefused as exc:
                _count_refusal(self.state, exc, "max_inflight")
                raise
            return self
        name = self.tenant_name
        tenant = self.tenant = admission.default_tenant if name is None else admission.tenant(name)
        if tenant is admission.overflow_tenant:
            self.state.metrics.admission_tenant_overflow_total.inc()
        if admission.try_enter(self.body_bytes, tenant):
            return self
        try:
            await admission.enter(deadline, self.body_bytes, tenant)
        except AdmissionRefused as exc:
            _count_refusal(self.state, exc, "max_inflight")
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.tokenizer_turn:
            self.leave_tokenizer()
        if self.slot:
            self.give_back_prompt_tokens()
            self.state.admission.leave(self.body_bytes, self.tenant, self.tokenizing_bytes)
        else:
            self.state.admission.give_back(self.body_bytes, self.tokenizing_bytes)

    async def hold(self, body_bytes: int) -> None:
        """Hold ``body_bytes`` more (a body read without a declared length, chunk by chunk), waiting
        before the queued newcomers while the budget is full, within the request's deadline."""
        try:
            await self.state.admission.hold(body_bytes, self.deadline)
        except AdmissionRefused as exc:
            _count_refusal(self.state, exc, "max_inflight")
            raise
        self.body_bytes += body_bytes

    def try_hold(self, body_bytes: int) -> bool:
        """Hold ``body_bytes`` more if the budget has room for them now, without waiting (a
        non-streaming answer's chunk, buffered); ``False``: nothing held."""
        if not self.state.admission.try_hold(body_bytes):
            return False
        self.body_bytes += body_bytes
        return True

    def try_hold_tokenizing(self, tokenizing_bytes: int) -> bool:
        """Hold ``tokenizing_bytes`` (the estimate of its parsed form and of the tokenizer's work, for a
        request to be tokenized in a thread) if the budget lets it in at once; ``False``: drop the
        parsed form and :meth:`hold_tokenizing`."""
        if not self.state.admission.try_hold_tokenizing(tokenizing_bytes):
            return False
        self.body_bytes += tokenizing_bytes
        self.tokenizing_bytes += tokenizing_bytes
        return True

    async def hold_tokenizing(self, tokenizing_bytes: int) -> None:
        """Hold ``tokenizing_bytes`` as :meth:`try_hold_tokenizing`, waiting in the tokenizing
        requests' queue (before the front queue and the newcomers) within the request's deadline;
        refusals as :meth:`hold`'s. The caller keeps no parsed form meanwhile: it parses the body
        again once this returns."""
        try:
            await self.state.admission.hold_tokenizing(tokenizing_bytes, self.deadline)
        except AdmissionRefused as exc:
            _count_refusal(self.state, exc, "max_inflight")
            raise
        self.body_bytes += tokenizing_bytes
        self.tokenizing_bytes += tokenizing_bytes

    def try_enter_tokenizer(self) -> bool:
        """Take a turn of its tenant in the tokenizer's threads (``limits.max_tokenizing_per_tenant``)
        if one is free, or if there is no such bound (off, or no slot); ``False``: drop the parsed
        form and :meth:`enter_tokenizer`."""
        gate = self.state.tokenizer_gate
        if gate is None or self.tenant is None:
            return True
        if not gate.try_enter(self.tenant):
            return False
        self.tokenizer_turn = True
        return True

    async def enter_tokenizer(self) -> None:
        """Take a turn as :meth:`try_enter_tokenizer`, waiting behind the tenant's earlier waiters
        within the request's deadline (then 503 with Retry-After,
        ``kvlb_admission_shed_total{reason="tenant_tokenizing"}``)."""
        gate = self.state.tokenizer_gate
        if gate is None or self.tenant is None:
            return
        self.state.metrics.admission_tokenizing_waits_total.inc()
        try:
            await gate.enter(self.tenant, self.deadline)
        except AdmissionRefused as exc:
            _count_refusal(self.state, exc, "max_inflight")
            raise
        self.tokenizer_turn = True

    def leave_tokenizer(self) -> None:
        """Give back its turn in the tokenizer's threads (the thread returned)."""
        gate = self.state.tokenizer_gate
        if self.tokenizer_turn and gate is not None and self.tenant is not None:
            gate.leave(self.tenant)
        self.tokenizer_turn = False

    def give_back_tokenizing(self) -> None:
        """Give back what it holds for its parsed form and the tokenizer's work (tokenized: the form
        is dropped, the tokenizer's thread done)."""
        held = self.tokenizing_bytes
        if held:
            self.tokenizing_bytes = 0
            self.body_bytes -= held
            self.state.admission.give_back(held, held)

    def add(self, body_bytes: int) -> None:
        """Count ``body_bytes`` more held (the token ids), without waiting."""
        self.state.admission.add(body_bytes)
        self.body_bytes += body_bytes

    def give_back(self, body_bytes: int) -> None:
        """Give back ``body_bytes`` of those held (a reservation larger than the message received),
        admitting the waiters they make room for."""
        self.state.admission.give_back(body_bytes)
        self.body_bytes -= body_bytes

    async def take_prompt_tokens(self, prompt_tokens: int) -> None:
        """Hold ``prompt_tokens`` of the tenant's ``limits.max_inflight_prompt_tokens_per_tenant``
        until the replica's first chunk (:meth:`give_back_prompt_tokens`) or the request's end,
        waiting behind the tenant's earlier requests that do not fit yet, within the request's
        deadline (then 429 with Retry-After). Unset cap: nothing (the callers
        check the cap first, so that a request without it awaits nothing more)."""
        admission = self.state.admission
        if admission.limits.max_inflight_prompt_tokens_per_tenant is None or self.tenant is None:
            return
        waits = self.state.metrics.admission_prompt_token_waits_total
        try:
            if await admission.take_prompt_tokens(self.tenant, prompt_tokens, self.deadline):
                waits.inc()
        except AdmissionRefused as exc:
            waits.inc()
            _count_refusal(self.state, exc, "max_inflight")
            raise
        self.prompt_tokens = prompt_tokens

    def give_back_prompt_tokens_after(self, delay_s: float) -> None:
        """Give back its prompt tokens in ``delay_s`` seconds (the estimated end of the prefill of a
        request whose answer comes whole: kvlb sees no first token of it,
        ``limits.prefill_tokens_per_s``), or earlier at the first chunk or its end."""
        if self.prompt_tokens and self.prompt_release is None:
            self.prompt_release = asyncio.get_running_loop().call_later(delay_s, self.give_back_prompt_tokens)

    def give_back_prompt_tokens(self) -> None:
        """Give back the prompt tokens it holds of its tenant's allowance (the replica's first chunk is
        in, or the estimated end of its prefill passed: :meth:`give_back_prompt_tokens_after`), letting
        the tenant's waiters at the token gate in."""
        release = self.prompt_release
        if release is not None:
            self.prompt_release = None
            release.cancel()
        if self.prompt_tokens and self.tenant is not None:
            self.state.admission.give_back_prompt_tokens(self.tenant, self.prompt_tokens)
        self.prompt_tokens = 0

    async def wait_for_replica(self, pool: Pool) -> None:
        """Wait in the admission queue while every routable replica of ``pool`` is full (then the
        request goes on; with no routable replica it goes on at once, to get its 503)."""
        state = self.state
        router = pool.router
        if router.has_free_slot(state.monotonic()):
            return
        cap = state.settings.limits.max_inflight_per_replica
        what = every_replica_full(pool.model, cap)

        def ready() -> bool:
            return router.has_free_slot(state.monotonic())

        try:
            await state.admission.wait_until(ready, self.deadline, what, self.tenant)
        except AdmissionRefused as exc:
            _count_refusal(state, exc, "replica_full")
            raise


def admitted(state: ServiceState, body_bytes: int = 0, tenant: str | None = None) -> Admitted:
    """Hold one of ``limits.max_inflight`` slots (and of ``limits.max_inflight_per_tenant`` of
    ``tenant``, the ``tenant_header`` value) and ``body_bytes`` of ``limits.max_inflight_body_bytes``
    (the body's declared length, at most ``limits.max_body_bytes``), waiting in the bounded queue if
    need be (round-robin across tenants), for the body of the ``async with``; refusals are
    :class:`AdmissionRefused` (429 queue full, 503 timeout)."""
    return Admitted(state, body_bytes, tenant)


def tenant_rate_refusal(state: ServiceState, tenant: str | None, now: float) -> AdmissionRefused | None:
    """Take a token of ``tenant``'s bucket of ``limits.tenant_rate_per_s`` (the ``tenant_header``
    value; ``None`` or empty: the default tenant, exempt unless ``limits.tenant_rate_default_tenant``)
    at ``now``, before anything else is done for the request:
    ``None`` (go on), or the refusal to answer (429, ``retry_after_s`` the wait for a token), counted
    in ``kvlb_admission_shed_total{reason="tenant_rate"}`` and
    ``kvlb_admission_tenant_rate_limited_total{bucket}``. Returned, not raised: the HTTP face writes
    it at once (a flood of refusals costs the least CPU that way). Off (``state.tenant_rates`` is
    ``None``): ``None``."""
    rates = state.tenant_rates
    if rates is None or (not tenant and not state.settings.limits.tenant_rate_default_tenant):
        return None
    shared = state.tenant_rate_share
    wait_s = rates.check(tenant, now) if shared is None else shared.check(rates, tenant, now)
    if not wait_s:
        return None
    metrics = state.metrics
    own = rates.known(tenant) or (shared is not None and shared.peer_tat(shared.key(tenant)) > 0)
    metrics.children.of(metrics.shed_total, TENANT_RATE).inc()
    metrics.children.of(metrics.admission_tenant_rate_limited_total, "tenant" if own else "new").inc()
    limits = state.settings.limits
    if own:
        message = (
            f"this tenant is over limits.tenant_rate_per_s = {limits.tenant_rate_per_s:g} requests/s; "
            f"next request in {wait_s:.3f}s"
        )
    else:
        new_rate = limits.tenant_rate_new_per_s or limits.tenant_rate_per_s
        message = (
            f"tenants new to kvlb are over limits.tenant_rate_new_per_s = {new_rate:g} requests/s "
            f"together (this tenant has no bucket yet); next request in {wait_s:.3f}s"
        )
    return AdmissionRefused(429, "rate_limited", message, wait_s, TENANT_RATE)


def check_tenant_rate(state: ServiceState, tenant: str | None, now: float) -> None:
    """:func:`tenant_rate_refusal`, raised (the gRPC face)."""
    refused = tenant_rate_refusal(state, tenant, now)
    if refused is not None:
        raise refused


def held(state: ServiceState, body_bytes: int) -> Admitted:
    """Hold ``body_bytes`` of ``limits.max_inflight_body_bytes`` without a slot (a gRPC message
    reserved before it is read, for a method that takes no slot), waiting before the queued newcomers
    while the budget is full, within ``limits.queue_timeout_s``; refusals as :func:`admitted`'s."""
    return Admitted(state, body_bytes, None, slot=False)


def _count_refusal(state: ServiceState, exc: AdmissionRefused, full_reason: str) -> None:
    """``kvlb_admission_shed_total``: ``body_bytes`` for every refusal for want of bytes (429 or 503),
    ``tenant_queue`` / ``tenant_inflight`` / ``tenant_prompt_tokens`` / ``tenant_tokenizing`` for a
    tenant's own caps (429 / 503 / 429 / 503), else ``full_reason``
    for a full queue and ``queue_timeout`` for a wait too long."""
    if exc.limit in (MAX_BYTES, TENANT_QUEUE, TENANT_INFLIGHT, TENANT_PROMPT_TOKENS, TENANT_TOKENIZING):
        reason = exc.limit
    else:
        reason = full_reason if exc.reason == "queue_full" else exc.reason
    state.metrics.shed_total.labels(reason).inc()
