"""A tenant's share of the tokenizer's threads (async shell, no I/O): ``limits.max_tokenizing_per_tenant``.

A request whose prompt is tokenized in a thread (a long text or chat:
:func:`~balancer.api.openai.tokenize_held`) first takes one of its tenant's turns here: at most
``per_tenant`` of one tenant's requests are in the tokenizer's threads at once on this worker (the
threads are the worker's own: the default executor's, as many as the cores plus 4). One more waits,
its admission slot held and its parsed form dropped, behind the tenant's earlier ones, until a turn
of its tenant is given back or ``deadline`` passes (then 503 with Retry-After, ``limit``
:data:`TENANT_TOKENIZING`). Other tenants' requests go on meanwhile. The wait is bounded: each
waiter holds an admission slot of its tenant (``limits.max_inflight_per_tenant``) and waits at most
``limits.queue_timeout_s`` from its arrival.

Why (docs/reliability.md, "Tenant isolation"): one tenant's huge prompts could fill every thread of
the executor with the tokenizer's work (Rust code, which runs without the GIL), and those threads
took the 2 cores from the event loop that serves every other tenant's small requests.

The tenants' entries are kept only while one of their requests is in the threads or waiting, so the
table holds at most ``limits.max_inflight`` tenants. Time comes from the running loop; nothing here is
global.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

from balancer.service.admission import AdmissionRefused, Tenant

TENANT_TOKENIZING = "tenant_tokenizing"
"""The ``limit`` of a refusal for want of a turn of the tenant's ``max_tokenizing_per_tenant``."""


class _Turns:
    __slots__ = ("taken", "waiters")

    def __init__(self) -> None:
        self.taken = 0
        """The tenant's requests in the tokenizer's threads now."""
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        """Its requests waiting for a turn, oldest first."""


class TokenizerGate:
    """At most ``per_tenant`` requests of one tenant tokenized in threads at once on this worker."""

    def __init__(self, per_tenant: int, queue_timeout_s: float) -> None:
        if per_tenant < 1:
            raise ValueError(f"per_tenant must be ≥ 1, got {per_tenant}")
        self.per_tenant = per_tenant
        """Turns of one tenant (≥ 1)."""
        self.queue_timeout_s = queue_timeout_s
        """Named in a refusal (seconds; the caller's ``deadline`` is the request's own)."""
        self._turns: dict[Tenant, _Turns] = {}

    @property
    def tenants(self) -> int:
        """Tenants with a request in the threads or waiting for a turn now."""
        return len(self._turns)

    def taken(self, tenant: Tenant) -> int:
        """``tenant``'s requests in the tokenizer's threads now."""
        turns = self._turns.get(tenant)
        return 0 if turns is None else turns.taken

    def try_enter(self, tenant: Tenant) -> bool:
        """Take a turn of ``tenant`` if one is free and none of its requests waits (``False``:
        :meth:`enter` waits)."""
        turns = self._turns.get(tenant)
        if turns is None:
            turns = self._turns[tenant] = _Turns()
        elif turns.waiters or turns.taken >= self.per_tenant:
            return False
        turns.taken += 1
        return True

    async def enter(self, tenant: Tenant, deadline: float) -> None:
        """Take a turn of ``tenant``, waiting behind its earlier waiters until one is given back or
        ``deadline`` (loop time): then :class:`AdmissionRefused` 503, ``limit``
        :data:`TENANT_TOKENIZING`, with Retry-After. Given back by :meth:`leave`."""
        if self.try_enter(tenant):
            return
        turns = self._turns[tenant]
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        turns.waiters.append(future)
        try:
            async with asyncio.timeout_at(deadline):
                await future
        except BaseException as exc:
            if future.done() and not future.cancelled():
                self.leave(tenant)  # given a turn as it gave up: it passes on
            else:
                future.cancel()
                with contextlib.suppress(ValueError):
                    turns.waiters.remove(future)
                self._forget_idle(tenant, turns)
            if not isinstance(exc, TimeoutError):
                raise
            raise AdmissionRefused(
                503,
                "queue_timeout",
                f"this tenant has {turns.taken} requests in the tokenizer's threads "
                f"(limits.max_tokenizing_per_tenant = {self.per_tenant}) and this request got no turn "
                f"within limits.queue_timeout_s = {self.queue_timeout_s}s",
                max(1.0, self.queue_timeout_s),
                TENANT_TOKENIZING,
            ) from None

    def leave(self, tenant: Tenant) -> None:
        """Give back a turn of ``tenant`` (its request's thread returned): its oldest waiter takes it."""
        turns = self._turns[tenant]
        waiters = turns.waiters
        while waiters:
            future = waiters.popleft()
            if not future.done():
                future.set_result(None)  # the turn passes on: ``taken`` stays
                return
        turns.taken -= 1
        self._forget_idle(tenant, turns)

    def _forget_idle(self, tenant: Tenant, turns: _Turns) -> None:
        if not turns.taken and not turns.waiters and self._turns.get(tenant) is turns:
            del self._turns[tenant]
