"""Admission control with a bounded wait queue, fair across tenants (async shell, no I/O).

A request is admitted while fewer than ``max_inflight`` are; otherwise it waits in a queue of at most
``max_queued`` requests, for at most ``queue_timeout_s``. A request leaving hands its slot to the
next waiter, so the in-flight count never exceeds the cap.

**Tenants.** Every request belongs to a :class:`Tenant` (:meth:`Admission.tenant`: the value of the
tenant header, cut to :data:`TENANT_CHARS` characters; no header: the default tenant). A tenant holds
at most ``max_inflight_per_tenant`` slots and ``max_queued_per_tenant`` queue places; a request
over its tenant's slots waits (then 503, ``limit`` :data:`TENANT_INFLIGHT`) while other tenants'
requests go on, and one over its tenant's queue places is refused at once (429, ``limit``
:data:`TENANT_QUEUE`). Waiters are admitted **round-robin across tenants**, each tenant's own in
order: the tenants with a waiter and a free slot of their own take turns (a ring), one admission
per turn, so a tenant with 100 waiters does not get ahead of another tenant's single one. A tenant
at its slot cap leaves the ring and joins it again at the back when one of its requests leaves.
The table of tenants is bounded (``max_tenants``, only tenants with a request in flight or waiting
are kept): a new tenant past it shares the one overflow tenant (:attr:`Admission.overflow_tenant`)
and its caps. With the per-tenant caps at the global ones (the defaults) only the order changes.

The same queue bounds requests that were admitted but find every replica full
(``limits.max_inflight_per_replica``): they wait for a replica's request to end (woken at each
:meth:`Admission.leave`, and every ``RECHECK_S`` for slots freed elsewhere, e.g. a gRPC reservation
expiring), within the same deadline; they count in their tenant's queue places. Refusals say why:

* the queue is full → :class:`AdmissionRefused` with status 429 (``reason="queue_full"``);
* the wait timed out → status 503 (``reason="queue_timeout"``); both carry ``retry_after_s``, and
  ``limit`` says what was full (``"body_bytes"`` for the byte budget below, the tenant's caps).

**Body bytes.** Besides its slot, a request holds bytes of ``max_inflight_body_bytes``: its body's
size, reserved on entering (:meth:`Admission.enter` with ``body_bytes``: the declared length) or as
it is read (:meth:`Admission.hold`, for a body without a declared length), and its token ids
(:meth:`Admission.add`, which never waits), and a non-streaming answer's chunks while they are
buffered (:meth:`Admission.try_hold`, which never waits either: an answer that does not fit is
relayed as it arrives instead, :mod:`balancer.api.openai`). A request enters only while its slot and
its bytes both fit. The bytes are one budget for all tenants and nobody passes the waiter whose turn
it is: when the next waiter in the round (the head of the ring's first tenant) does not fit,
admission stops until enough bytes are given back, as a large body at the head of a FIFO queue held
back smaller ones; it is never skipped (a body is at most ``max_body_bytes`` ≤ the budget, and every
request in flight gives its bytes back when it ends, so it fits in the end: no starvation, no
deadlock). More bytes for a request already in flight (:meth:`Admission.hold`; also a gRPC call that
takes no slot, for its message) go before every newcomer, whatever its tenant: they wait in a front
queue, first come first served. :meth:`Admission.give_back` gives back bytes while the request goes
on (a gRPC message's reservation of ``max_body_bytes`` once its size is known),
:meth:`Admission.leave` the slot and every byte the request held. The check on the way in is a few
comparisons and an addition.

**Tokenizing requests.** A request tokenized in one of the tokenizer's threads holds, from its parse
until the tokenizer returns, the estimate of its parsed form's bytes and of the tokenizer's working
memory (:meth:`Admission.try_hold_tokenizing`, :meth:`Admission.hold_tokenizing`;
:attr:`Admission.tokenizing_bytes` is their part of :attr:`Admission.body_bytes`). These holds have
a queue of their own, served before the front queue and the ring's waiters, first come first served;
its head goes in when its bytes fit **or no tokenizing bytes are held at all**. So a hold larger than
the budget left (a parse may weigh many times its body, the tokenizer's work hundreds of bytes a
character) still goes, alone, and never waits for a request that waits too: the requests holding
such bytes are being tokenized, which waits for nothing here. A newcomer whose slot and bytes fit
does not wait for them (:meth:`try_enter`, as the ring's waiters are admitted past them by
:meth:`_admit_waiters`): what a tokenizing hold waits for is the end of the tokenizations before it
(it goes alone once none is held), which no newcomer's bytes delay, and one tenant's huge prompts
queued for the tokenizer would otherwise hold back every other tenant's small requests until one of
them is tokenized (hundreds of ms each, up to ``queue_timeout_s``; docs/reliability.md, "Tenant
isolation"). The caller drops its parsed form while
it waits and parses the body again once let in, so what waits is the body alone.

With ``kvlb serve --workers N`` the slot caps are the whole service's: :attr:`Admission.peers` gives
the requests the other workers have admitted (the shared load table, :mod:`balancer.load.share`) and
:attr:`Admission.on_change` publishes this worker's count; :attr:`Admission.tenant_peers` gives the
other workers' requests of one tenant (by :func:`tenant_key`: the default and the overflow tenants
have keys of their own, so each is one tenant across workers) and :attr:`Admission.on_tenant_change`
publishes this worker's count of a tenant at each change. A request is admitted while this worker's
plus the others' count is below ``max_inflight`` and its tenant's count here plus elsewhere is below
``max_inflight_per_tenant``; a slot freed on another worker is seen by this worker's waiters at
their next check (every ``RECHECK_S``), in their order, while a slot freed here passes to a waiter
here at once. A tenant with waiters here that is at its cap only with the other workers' requests
counted is set aside: its turns pass (it holds nobody back) until its count falls, looked at once
per half ``RECHECK_S``. Two workers admitting at the same instant may both pass: the service is at
most ``N - 1`` over either cap. The queue caps (``max_queued``, ``max_queued_per_tenant``), the
queue's order and the tenant table (``max_tenants``) stay per worker. The tenant hooks cost a look-up
of the tenant's key and one read of the other workers' counts per check; the shell leaves them unset
when ``max_inflight_per_tenant`` is ``max_inflight`` (the tenant's cap cannot bind first).

**Prompt tokens.** With ``max_inflight_prompt_tokens_per_tenant`` set, an admitted request, once
tokenized, holds its prompt tokens of its tenant's allowance until the replica's first answer chunk
(its prefill done) or its end (:meth:`Admission.take_prompt_tokens`,
:meth:`Admission.give_back_prompt_tokens`): one that does
not fit (:func:`prompt_tokens_fit`; a prompt over the cap fits when the tenant holds none) waits,
keeping its slot, behind the tenant's earlier waiters, until ``deadline`` (then 429,
:data:`TENANT_PROMPT_TOKENS`), while other tenants' requests go on. So one tenant cannot put more
than its allowance of prefill in front of the others' at the engines, which run requests first come
first served. With ``kvlb serve --workers N`` the allowance is the whole service's:
:attr:`Admission.tenant_token_peers` gives the prompt tokens the other workers' requests of the
tenant hold (the shared load table's tenant slots) and :attr:`Admission.on_tenant_tokens` publishes
this worker's at each change; a waiter here looks again every :data:`RECHECK_S` for tokens given
back elsewhere. Two workers letting requests of one tenant past the gate at the same instant may both
pass: the tenant is then over its allowance by at most one prompt per other worker. Unset, the shell
skips it (one ``None`` check a request).

Time comes from the running loop (``loop.time()``); nothing here is global.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

RECHECK_S = 0.05
"""Longest sleep of a request waiting for a replica slot between two checks (seconds)."""

TENANT_CHARS = 128
"""Characters of a tenant header's value that name the tenant (the rest is cut, as the console does)."""

MAX_BYTES = "body_bytes"
"""The ``limit`` of a refusal for want of bytes of ``max_inflight_body_bytes``."""
MAX_INFLIGHT = "max_inflight"
"""The ``limit`` of a refusal for want of a slot (or of a replica slot: :meth:`Admission.wait_until`)."""
TENANT_INFLIGHT = "tenant_inflight"
"""The ``limit`` of a refusal for want of a slot of the request's tenant (``max_inflight_per_tenant``)."""
TENANT_QUEUE = "tenant_queue"
"""The ``limit`` of a refusal for want of a queue place of the tenant (``max_queued_per_tenant``)."""
TENANT_RATE = "tenant_rate"
"""The ``limit`` of a refusal by the tenant's request rate (``limits.tenant_rate_per_s``, checked
before admission: :func:`balancer.service.admitted.tenant_rate_refusal`)."""
TENANT_PROMPT_TOKENS = "tenant_prompt_tokens"
"""The ``limit`` of a refusal for want of prompt tokens of the tenant's
``max_inflight_prompt_tokens_per_tenant``."""


def prompt_tokens_fit(held: int, prompt_tokens: int, cap: int) -> bool:
    """Whether a request of ``prompt_tokens`` may go while its tenant's requests past the gate hold
    ``held`` prompt tokens under a cap of ``cap``: it fits, or the tenant holds none (so a prompt
    larger than the cap still runs, alone)."""
    return not held or held + prompt_tokens <= cap


def tenant_key(name: str) -> int:
    """A tenant's name shared between workers (``kvlb serve --workers N``): 63 bits of a BLAKE2b of
    its name, never 0. The default and the overflow tenants have keys of their own
    (:data:`DEFAULT_TENANT_KEY`, :data:`OVERFLOW_TENANT_KEY`: no header value hashes to them, a
    header value having no NUL character)."""
    digest = hashlib.blake2b(name.encode(), digest_size=8, person=b"kvlb-tenant").digest()
    return (int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF) or 1


DEFAULT_TENANT_KEY = tenant_key("\0default")
"""The default tenant's key (requests without a tenant header, on every worker alike)."""
OVERFLOW_TENANT_KEY = tenant_key("\0overflow")
"""The overflow tenant's key (new tenants past ``max_tenants``, on every worker alike)."""


class AdmissionRefused(Exception):
    """The request is not admitted: ``status`` 429 (queue full, or its tenant over its request rate,
    :data:`TENANT_RATE`, before admission) or 503 (waited too long); ``limit`` is what it waited for
    (:data:`MAX_INFLIGHT`, :data:`MAX_BYTES`, :data:`TENANT_INFLIGHT`, :data:`TENANT_QUEUE`,
    :data:`TENANT_PROMPT_TOKENS` or :data:`TENANT_RATE`)."""

    def __init__(
        self, status: int, reason: str, message: str, retry_after_s: float, limit: str = MAX_INFLIGHT
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s
        self.limit = limit


UNBOUNDED = 2**62
"""A per-tenant cap that never binds (the default of :class:`AdmissionLimits`)."""


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_inflight: int
    """Requests admitted at once (≥ 1)."""
    max_queued: int
    """Requests waiting at once, for admission or for a replica slot (≥ 0; 0 refuses at once)."""
    queue_timeout_s: float
    """Longest wait of one request, both waits together (seconds, > 0)."""
    max_inflight_body_bytes: int = 2**40
    """Bytes of bodies (and token ids) held at once, by this process (≥ the largest body)."""
    max_inflight_per_tenant: int = UNBOUNDED
    """Requests of one tenant admitted at once (≥ 1; at most ``max_inflight`` binds)."""
    max_queued_per_tenant: int = UNBOUNDED
    """Requests of one tenant waiting at once, for admission or a replica slot (≥ 0)."""
    max_tenants: int = 1024
    """Tenants tracked at once (≥ 1); a new one past it shares the overflow tenant."""
    max_inflight_prompt_tokens_per_tenant: int | None = None
    """Prompt tokens of one tenant's requests past the token gate at once (≥ 1; ``None``: no gate).
    A prompt larger than it goes alone (:func:`prompt_tokens_fit`)."""


class Tenant:
    """One tenant's share of admission: its requests in flight, its places in the queue, its waiters."""

    __slots__ = ("inflight", "key", "prompt_tokens", "queued", "shared_key", "token_waiters", "waiters")

    def __init__(self, key: str | None, shared_key: int = 0) -> None:
        self.key = key
        """Its key in the table; ``None`` for the default and the overflow tenants (never dropped)."""
        self.shared_key = shared_key
        """Its name between workers (:func:`tenant_key`); 0 until first needed."""
        self.inflight = 0
        """Its requests admitted and not yet left."""
        self.queued = 0
        """Its requests waiting, for admission (:attr:`waiters`) or for a replica slot."""
        self.waiters: collections.deque[_Waiter] = collections.deque()
        """Its requests waiting for admission, oldest first."""
        self.prompt_tokens = 0
        """Prompt tokens of its requests past the token gate and not yet left
        (:meth:`Admission.take_prompt_tokens`)."""
        self.token_waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        """Its requests waiting at the token gate (prompt tokens, future), oldest first."""


class _Waiter:
    """One request in the queue: what it waits for, and the future that admits it."""

    __slots__ = ("body_bytes", "future", "tenant", "tokenizing")

    def __init__(
        self, future: asyncio.Future[None], body_bytes: int, tenant: Tenant | None, tokenizing: bool = False
    ) -> None:
        self.future = future
        self.body_bytes = body_bytes
        self.tenant = tenant
        """The tenant whose slot it waits for (``None``: bytes for a request already in flight)."""
        self.tokenizing = tokenizing
        """It waits for a tokenizing request's bytes (:meth:`Admission.hold_tokenizing`; ``tenant`` is
        ``None``)."""


class Admission:
    """The in-flight count and the wait queue of one balancer (shared by HTTP and gRPC)."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.inflight = 0
        """Requests this balancer (this worker) admitted and not yet left."""
        self.peers: Callable[[], int] | None = None
        """The requests the other workers of ``kvlb serve --workers N`` have admitted (set by the
        shell; ``None``: this worker's count is all)."""
        self.on_change: Callable[[int], None] | None = None
        """Called with :attr:`inflight` after each change (the shell publishes it to the others)."""
        self.tenant_peers: Callable[[int], int] | None = None
        """The requests of a tenant (by its :func:`tenant_key`) the other workers have admitted (set
        by the shell; ``None``: this worker's count of the tenant is all)."""
        self.on_tenant_change: Callable[[int, int], None] | None = None
        """Called with a tenant's key and its :attr:`Tenant.inflight` after each change."""
        self.tenant_token_peers: Callable[[int], int] | None = None
        """The prompt tokens the other workers' requests of a tenant (by its :func:`tenant_key`) hold
        of its ``max_inflight_prompt_tokens_per_tenant`` (set by the shell; ``None``: this worker's
        count of the tenant is all)."""
        self.on_tenant_tokens: Callable[[int, int], None] | None = None
        """Called with a tenant's key and its :attr:`Tenant.prompt_tokens` after each change."""
        self.body_bytes = 0
        """Bytes of bodies and token ids the requests of this process hold now (reserved, added), and
        of their parsed forms and the tokenizer's work while they are tokenized in a thread
        (:attr:`tokenizing_bytes`)."""
        self.tokenizing_bytes = 0
        """The part of :attr:`body_bytes` held now for the requests tokenized in a thread (the estimate
        of each one's parsed form and of the tokenizer's working memory for its text)."""
        self.default_tenant = Tenant(None, DEFAULT_TENANT_KEY)
        """The tenant of requests without a tenant header."""
        self.overflow_tenant = Tenant(None, OVERFLOW_TENANT_KEY)
        """The tenant shared by new tenants while ``max_tenants`` are tracked."""
        self._tenant_cap = limits.max_inflight_per_tenant
        self._tenants: dict[str, Tenant] = {}
        self._front: collections.deque[_Waiter] = collections.deque()
        """Waiters for bytes only (requests in flight), first served, in order."""
        self._tokenizing: collections.deque[_Waiter] = collections.deque()
        """Waiters for a tokenizing request's bytes (:meth:`hold_tokenizing`), served before the front
        queue."""
        self._ring: collections.deque[Tenant] = collections.deque()
        """The tenants whose turn comes: those with a waiter and below their slot cap, in turn."""
        self._blocked: dict[Tenant, None] = {}
        """Tenants with a waiter, below their slot cap here but not with the other workers' slots of
        the tenant (:attr:`tenant_peers`), in the order found; back to the ring's end when a slot of
        theirs frees here, or when the other workers' count falls (seen at a recheck)."""
        self._rechecked_at = float("-inf")
        self._shared_keys: dict[str, int] = {}
        self._slot_waiters = 0
        self._replica_waiters = 0
        self._freed = asyncio.Event()
        self.refused_total = {"queue_full": 0, "queue_timeout": 0}

    @property
    def queued(self) -> int:
        """Requests waiting now (for admission or for a replica slot)."""
        return len(self._front) + len(self._tokenizing) + self._slot_waiters + self._replica_waiters

    @property
    def tenants(self) -> int:
        """Tenants tracked now (with a request in flight or waiting), the default and overflow ones aside."""
        return len(self._tenants)

    def tenant(self, name: str | None) -> Tenant:
        """The tenant named ``name`` (a tenant header's value; ``None`` or empty: the default tenant),
        added to the table if need be (past ``max_tenants``: the overflow tenant). Enter with it in
        the same step (no ``await`` in between): a tenant with nothing in flight or waiting is dropped
        from the table when one of its requests leaves."""
        if not name:
            return self.default_tenant
        key = name[:TENANT_CHARS]
        tenant = self._tenants.get(key)
        if tenant is None:
            if len(self._tenants) >= self.limits.max_tenants:
                return self.overflow_tenant
            tenant = self._tenants[key] = Tenant(key)
        return tenant

    def deadline(self) -> float:
        """The loop time at which a request arriving now stops waiting."""
        return asyncio.get_running_loop().time() + self.limits.queue_timeout_s

    def _has_room(self) -> bool:
        """Fewer than ``max_inflight`` admitted, this worker's and the others' together."""
        taken = self.inflight if self.peers is None else self.inflight + self.peers()
        return taken < self.limits.max_inflight

    def _tenant_taken(self, tenant: Tenant) -> int:
        """``tenant``'s requests admitted, here and (with :attr:`tenant_peers`) on the other workers."""
        peers = self.tenant_peers
        if peers is None:
            return tenant.inflight
        key = tenant.shared_key or self._share(tenant)
        return tenant.inflight + peers(key)

    def _share(self, tenant: Tenant) -> int:
        """``tenant``'s :func:`tenant_key`, remembered for its name (a tenant with nothing in flight
        is dropped from the table and made again for its next request: its name is not hashed
        again); the memo holds at most ``max_tenants`` names, then starts again."""
        name = tenant.key or ""
        key = self._shared_keys.get(name)
        if key is None:
            if len(self._shared_keys) >= self.limits.max_tenants:
                self._shared_keys.clear()
            key = self._shared_keys[name] = tenant_key(name)
        tenant.shared_key = key
        return key

    def _publish_tenant(self, tenant: Tenant) -> None:
        if self.on_tenant_change is not None:
            self.on_tenant_change(tenant.shared_key or self._share(tenant), tenant.inflight)

    def _set_inflight(self, inflight: int) -> None:
        self.inflight = inflight
        if self.on_change is not None:
            self.on_change(inflight)

    def try_enter(self, body_bytes: int = 0, tenant: Tenant | None = None) -> bool:
        """Take a slot and ``body_bytes`` if both are free, ``tenant`` (default: the default tenant)
        is below its slot cap and nobody's turn comes first: no tenant's waiter in the ring, no
        request in flight waiting for bytes (the front queue); a tokenizing hold waiting does not
        hold it back ("Tokenizing requests" above) (``False``: :meth:`enter` waits).
        ``body_bytes``: at most ``max_inflight_body_bytes``."""
        if tenant is None:
            tenant = self.default_tenant
        limits = self.limits
        inflight = self.inflight
        if (
            self.body_bytes + body_bytes <= limits.max_inflight_body_bytes
            and tenant.inflight < self._tenant_cap
            and not self._ring
            and not self._front
            and (inflight if self.peers is None else inflight + self.peers()) < limits.max_inflight
            and (
                self.tenant_peers is None
                or (not tenant.waiters and self._tenant_taken(tenant) < self._tenant_cap)
            )
        ):  # the fast path: calls inlined (it is every request's)
            self.body_bytes += body_bytes
            tenant.inflight += 1
            self.inflight = inflight = inflight + 1
            if self.on_change is not None:
                self.on_change(inflight)
            if self.on_tenant_change is not None:
                self._publish_tenant(tenant)
            return True
        return False

    async def enter(self, deadline: float, body_bytes: int = 0, tenant: Tenant | None = None) -> None:
        """Take a slot and ``body_bytes``, waiting in ``tenant``'s queue until ``deadline`` (loop time)
        if either is short, the tenant is at its slot cap or other tenants' turns come first."""
        if tenant is None:
            tenant = self.default_tenant
        if self.try_enter(body_bytes, tenant):
            return
        await self._wait(_Waiter(asyncio.get_running_loop().create_future(), body_bytes, tenant), deadline)

    async def hold(self, body_bytes: int, deadline: float) -> None:
        """Hold ``body_bytes`` more for a request already admitted (a body read without a declared
        length): at once if they fit, else waiting at the front of the queue, before the newcomers,
        until ``deadline``. A hold that fits goes at once even past a larger one waiting: a request
        reading its body holds bytes the waiters may be waiting for, and making it wait behind them
        could deadlock both until their deadline. Refused like :meth:`enter`; what it held stays
        held until :meth:`leave`."""
        if self.body_bytes + body_bytes <= self.limits.max_inflight_body_bytes:
            self.body_bytes += body_bytes
            return
        await self._wait(_Waiter(asyncio.get_running_loop().create_future(), body_bytes, None), deadline)

    def try_hold(self, body_bytes: int) -> bool:
        """Hold ``body_bytes`` more for a request in flight if they fit now and no request in flight
        waits for bytes before it (the front queue); never waits (``False``: nothing held). A
        non-streaming answer's bytes, buffered as they are read from the replica."""
        if self._front or self.body_bytes + body_bytes > self.limits.max_inflight_body_bytes:
            return False
        self.body_bytes += body_bytes
        return True

    def try_hold_tokenizing(self, tokenizing_bytes: int) -> bool:
        """Hold ``tokenizing_bytes`` more for a request in flight to be tokenized in a thread, if they
        fit or no tokenizing bytes are held, and no other tokenizing request waits (``False``:
        :meth:`hold_tokenizing` waits)."""
        if self._tokenizing or (
            self.body_bytes + tokenizing_bytes > self.limits.max_inflight_body_bytes and self.tokenizing_bytes
        ):
            return False
        self.body_bytes += tokenizing_bytes
        self.tokenizing_bytes += tokenizing_bytes
        return True

    async def hold_tokenizing(self, tokenizing_bytes: int, deadline: float) -> None:
        """:meth:`try_hold_tokenizing`, waiting in the tokenizing requests' queue until ``deadline`` (then
        503; a full queue: 429, as :meth:`enter`). The caller keeps no parsed form while it waits."""
        if self.try_hold_tokenizing(tokenizing_bytes):
            return
        future = asyncio.get_running_loop().create_future()
        await self._wait(_Waiter(future, tokenizing_bytes, None, tokenizing=True), deadline)

    def add(self, body_bytes: int) -> None:
        """Count ``body_bytes`` more held by a request in flight (its token ids), without waiting:
        the bytes held may pass the budget by them, and newcomers wait until they are back under."""
        self.body_bytes += body_bytes

    def give_back(self, body_bytes: int, tokenizing_bytes: int = 0) -> None:
        """Give back ``body_bytes`` a request holds while it goes on (the rest of a reservation larger
        than the message received, all of a hold without a slot, or a tokenizing request's hold once
        it is tokenized, of which ``tokenizing_bytes`` were held as such): the waiters whose turn comes and
        that now fit are admitted, as :meth:`leave` admits them."""
        self.body_bytes -= body_bytes
        self.tokenizing_bytes -= tokenizing_bytes
        if self._ring or self._front or self._tokenizing:
            self._admit_waiters()

    def leave(self, body_bytes: int = 0, tenant: Tenant | None = None, tokenizing_bytes: int = 0) -> None:
        """Release a slot of ``tenant`` (default: the default tenant) and the ``body_bytes`` the
        request held (all it reserved, held and added; ``tokenizing_bytes`` of them held while it
        was tokenized in a thread): the waiters whose turn comes and that now fit are admitted.
        With other workers, slots pass on only while the whole service is below the cap again."""
        if tenant is None:
            tenant = self.default_tenant
        self.body_bytes -= body_bytes
        self.tokenizing_bytes -= tokenizing_bytes
        held = tenant.inflight = tenant.inflight - 1
        self.inflight -= 1
        if tenant.waiters:
            if held == self._tenant_cap - 1:
                self._ring.append(tenant)  # below its cap again: its turn comes after the others'
            elif tenant in self._blocked:
                del self._blocked[tenant]  # one of its slots freed here: its turn may come
                self._ring.append(tenant)
        elif not held and tenant.key is not None and not tenant.queued:
            self._forget(tenant)
        if (
            not ((self._ring or self._front or self._tokenizing) and self._admit_waiters())
            and self.on_change is not None
        ):
            self.on_change(self.inflight)
        if self.on_tenant_change is not None:
            self._publish_tenant(tenant)  # after its own waiter, if any, took the slot again
        if self._replica_waiters:
            self._freed.set()

    def _forget(self, tenant: Tenant) -> None:
        """Drop ``tenant`` from the table (it has nothing in flight or waiting)."""
        key = tenant.key
        if key is not None and self._tenants.get(key) is tenant:
            del self._tenants[key]

    async def _wait(self, waiter: _Waiter, deadline: float) -> None:
        """Queue ``waiter`` (at the back of its tenant's waiters, or at the back of the front queue
        if it wants no slot) until it is admitted, or refuse it (queue full at once, ``deadline``
        passed)."""
        tenant = waiter.tenant
        limits = self.limits
        if tenant is not None and not self._has_room():
            limit = MAX_INFLIGHT
            what = f"the balancer has {limits.max_inflight} requests in flight"
        elif tenant is not None and (taken := self._tenant_taken(tenant)) >= self._tenant_cap:
            limit = TENANT_INFLIGHT
            what = f"this tenant has {taken} requests in flight (limits.max_inflight_per_tenant)"
        else:
            limit = MAX_BYTES
            what = (
                f"the balancer holds {self.body_bytes} bytes of request bodies "
                f"(limits.max_inflight_body_bytes = {limits.max_inflight_body_bytes})"
            )
        self._check_room(what, limit, tenant)
        if tenant is None:
            (self._tokenizing if waiter.tokenizing else self._front).append(waiter)
        else:
            tenant.waiters.append(waiter)
            tenant.queued += 1
            self._slot_waiters += 1
            if len(tenant.waiters) == 1 and tenant.inflight < self._tenant_cap:
                self._ring.append(tenant)
        future = waiter.future
        try:
            async with asyncio.timeout_at(deadline):
                if self.peers is None and self.tenant_peers is None:
                    await future
                else:  # slots freed by other workers wake nobody here: look again now and then
                    self._admit_waiters()
                    while not future.done():
                        await asyncio.wait((future,), timeout=RECHECK_S)
                        if not future.done():
                            self._recheck()
                    future.result()
        except TimeoutError:
            self._give_back(waiter)
            if tenant is not None and self._tenant_taken(tenant) >= self._tenant_cap and self._has_room():
                limit = TENANT_INFLIGHT  # what holds it back now is its tenant's cap
            raise self._timed_out(limit) from None
        except BaseException:
            self._give_back(waiter)
            raise

    def _recheck(self) -> None:
        """A waiter's periodic look at the other workers' slots (with :attr:`peers` or
        :attr:`tenant_peers`): the blocked tenants whose count fell go back to the ring, then the
        waiters whose turn comes are admitted. The blocked tenants are looked at once per half
        :data:`RECHECK_S` however many waiters look, so the cost per recheck does not grow with the
        waiters times the tenants."""
        if self._blocked:
            now = asyncio.get_running_loop().time()
            if now >= self._rechecked_at + RECHECK_S / 2:
                self._rechecked_at = now
                cap = self._tenant_cap
                for tenant in [t for t in self._blocked if self._tenant_taken(t) < cap]:
                    del self._blocked[tenant]
                    self._ring.append(tenant)
        self._admit_waiters()

    def _admit_waiters(self) -> bool:
        """Admit the waiters whose turn comes while they fit: first the tokenizing requests' (their
        head also when no tokenizing bytes are held: "Tokenizing requests" above), then the front queue's
        (bytes), then the ring's tenants in turn, one waiter each (bytes, and a slot of the whole
        service, other workers' slots included). A tenant whose slots are taken with the other
        workers' counted (:attr:`tenant_peers`) is set aside (:attr:`_blocked`) and its turn passes;
        otherwise it stops at the first that does not fit. Publishes :attr:`inflight` and says
        whether it admitted any for a slot."""
        limit_bytes = self.limits.max_inflight_body_bytes
        tokenizing = self._tokenizing
        while tokenizing:
            waiter = tokenizing[0]
            if waiter.future.done():
                tokenizing.popleft()
                continue
            if self.body_bytes + waiter.body_bytes > limit_bytes and self.tokenizing_bytes:
                break
            tokenizing.popleft()
            self.body_bytes += waiter.body_bytes
            self.tokenizing_bytes += waiter.body_bytes
            waiter.future.set_result(None)
        front = self._front
        while front:
            waiter = front[0]
            if waiter.future.done():
                front.popleft()
                continue
            if self.body_bytes + waiter.body_bytes > limit_bytes:
                return False
            front.popleft()
            self.body_bytes += waiter.body_bytes
            waiter.future.set_result(None)
        ring = self._ring
        admitted = False
        while ring:
            tenant = ring[0]
            waiter = tenant.waiters[0]
            if waiter.future.done():  # cancelled with its task: out, before its task gives it back
                tenant.waiters.popleft()
                tenant.queued -= 1
                self._slot_waiters -= 1
                if not tenant.waiters:
                    ring.popleft()
                continue
            if self.tenant_peers is not None and self._tenant_taken(tenant) >= self._tenant_cap:
                ring.popleft()  # at its cap with the other workers' slots: set aside, its turn passes
                self._blocked[tenant] = None
                continue
            if self.body_bytes + waiter.body_bytes > limit_bytes or not self._has_room():
                break
            ring.popleft()
            tenant.waiters.popleft()
            tenant.queued -= 1
            self._slot_waiters -= 1
            tenant.inflight += 1
            self.inflight += 1
            self.body_bytes += waiter.body_bytes
            waiter.future.set_result(None)
            admitted = True
            if self.on_tenant_change is not None:
                self._publish_tenant(tenant)
            if tenant.waiters and tenant.inflight < self._tenant_cap:
                ring.append(tenant)
        if admitted:
            self._set_inflight(self.inflight)
        return admitted

    async def wait_until(
        self, ready: Callable[[], bool], deadline: float, what: str, tenant: Tenant | None = None
    ) -> None:
        """Wait (counted in the queue, and in ``tenant``'s) until ``ready()`` holds, e.g. some replica
        has a free slot; ``what`` says what is busy. Without a queue (``max_queued`` 0) it returns at
        once."""
        if ready() or self.limits.max_queued == 0:
            return
        if tenant is None:
            tenant = self.default_tenant
        self._check_room(what, MAX_INFLIGHT, tenant)
        self._replica_waiters += 1
        tenant.queued += 1
        try:
            async with asyncio.timeout_at(deadline):
                while not ready():
                    self._freed.clear()
                    try:
                        async with asyncio.timeout(RECHECK_S):
                            await self._freed.wait()
                    except TimeoutError:
                        continue
        except TimeoutError:
            raise self._timed_out() from None
        finally:
            self._replica_waiters -= 1
            tenant.queued -= 1

    def _check_room(self, what: str, limit: str, tenant: Tenant | None) -> None:
        """Refuse (429) a request that would wait while its tenant's queue places, or the queue, are
        all taken; a tenant refused with nothing in flight or waiting is dropped from the table."""
        limits = self.limits
        if self.queued >= limits.max_queued:
            message = f"{what} and {self.queued} requests queued (limits.max_queued = {limits.max_queued})"
        elif tenant is not None and tenant.queued >= limits.max_queued_per_tenant:
            limit = TENANT_QUEUE
            message = (
                f"{what} and this tenant has {tenant.queued} requests queued "
                f"(limits.max_queued_per_tenant = {limits.max_queued_per_tenant})"
            )
        else:
            return
        self.refused_total["queue_full"] += 1
        if tenant is not None and not tenant.inflight and not tenant.queued:
            self._forget(tenant)
        raise AdmissionRefused(429, "queue_full", message, 1.0, limit)

    def _timed_out(self, limit: str = MAX_INFLIGHT) -> AdmissionRefused:
        self.refused_total["queue_timeout"] += 1
        limits = self.limits
        timeout_s = limits.queue_timeout_s
        if limit == MAX_BYTES:
            busy = f"request bodies held at limits.max_inflight_body_bytes = {limits.max_inflight_body_bytes}"
        elif limit == TENANT_INFLIGHT:
            busy = f"the tenant at limits.max_inflight_per_tenant = {limits.max_inflight_per_tenant}"
        else:
            busy = "every slot or replica busy"
        return AdmissionRefused(
            503,
            "queue_timeout",
            f"no capacity within limits.queue_timeout_s = {timeout_s}s ({busy})",
            max(1.0, timeout_s),
            limit,
        )

    def _give_back(self, waiter: _Waiter) -> None:
        """A waiter gives up: out of the queue (those behind it may fit now: it may have held them
        back by its bytes), or, if it was admitted meanwhile, it gives back what it was given."""
        future = waiter.future
        tenant = waiter.tenant
        if future.done() and not future.cancelled():
            if tenant is not None:
                self.leave(waiter.body_bytes, tenant)
            else:
                self.give_back(waiter.body_bytes, waiter.body_bytes if waiter.tokenizing else 0)
            return
        future.cancel()
        if tenant is None:
            with contextlib.suppress(ValueError):
                (self._tokenizing if waiter.tokenizing else self._front).remove(waiter)
        else:
            with contextlib.suppress(ValueError):
                tenant.waiters.remove(waiter)
                tenant.queued -= 1
                self._slot_waiters -= 1
                if not tenant.waiters and tenant.inflight < self._tenant_cap:
                    if tenant in self._blocked:
                        del self._blocked[tenant]
                    else:
                        self._ring.remove(tenant)
            if not tenant.inflight and not tenant.queued:
                self._forget(tenant)
        self._admit_waiters()

    async def take_prompt_tokens(self, tenant: Tenant, prompt_tokens: int, deadline: float) -> bool:
        """Count ``prompt_tokens`` against ``tenant``'s ``max_inflight_prompt_tokens_per_tenant``
        (set: the caller checks), waiting behind the tenant's earlier waiters until they fit
        (:func:`prompt_tokens_fit`) or ``deadline``: then 429 with Retry-After, ``limit``
        :data:`TENANT_PROMPT_TOKENS`. Given back by :meth:`give_back_prompt_tokens`. Says whether it
        waited."""
        cap = self.limits.max_inflight_prompt_tokens_per_tenant
        assert cap is not None
        waiters = tenant.token_waiters
        if not waiters and prompt_tokens_fit(self._tokens_held(tenant), prompt_tokens, cap):
            tenant.prompt_tokens += prompt_tokens
            if self.on_tenant_tokens is not None:
                self.on_tenant_tokens(tenant.shared_key or self._share(tenant), tenant.prompt_tokens)
            return False
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (prompt_tokens, future)
        waiters.append(entry)
        try:
            async with asyncio.timeout_at(deadline):
                if self.tenant_token_peers is None:
                    await future
                else:  # tokens given back by other workers wake nobody here: look again now and then
                    while not future.done():
                        await asyncio.wait((future,), timeout=RECHECK_S)
                        if not future.done():
                            self._admit_token_waiters(tenant, cap)
                    future.result()
            return True
        except BaseException as exc:
            if future.done() and not future.cancelled():
                self.give_back_prompt_tokens(tenant, prompt_tokens)  # let in as it gave up
            else:
                future.cancel()
                with contextlib.suppress(ValueError):
                    waiters.remove(entry)
                self._admit_token_waiters(tenant, cap)  # it may have held smaller ones back
            if not isinstance(exc, TimeoutError):
                raise
            self.refused_total["queue_timeout"] += 1
            timeout_s = self.limits.queue_timeout_s
            raise AdmissionRefused(
                429,
                "queue_timeout",
                f"this tenant has {self._tokens_held(tenant)} prompt tokens in flight "
                f"(limits.max_inflight_prompt_tokens_per_tenant = {cap}) and this request's "
                f"{prompt_tokens} did not fit within limits.queue_timeout_s = {timeout_s}s",
                max(1.0, timeout_s),
                TENANT_PROMPT_TOKENS,
            ) from None

    def give_back_prompt_tokens(self, tenant: Tenant, prompt_tokens: int) -> None:
        """Give back ``prompt_tokens`` of ``tenant``'s (the request's prefill is done, or it ended):
        its waiters at the token gate that now fit go, in order."""
        tenant.prompt_tokens -= prompt_tokens
        cap = self.limits.max_inflight_prompt_tokens_per_tenant
        if tenant.token_waiters and cap is not None:
            self._admit_token_waiters(tenant, cap)
        if self.on_tenant_tokens is not None:
            self.on_tenant_tokens(tenant.shared_key or self._share(tenant), tenant.prompt_tokens)

    def _tokens_held(self, tenant: Tenant) -> int:
        """``tenant``'s prompt tokens past the gate, here and (with :attr:`tenant_token_peers`) on the
        other workers."""
        peers = self.tenant_token_peers
        if peers is None:
            return tenant.prompt_tokens
        return tenant.prompt_tokens + peers(tenant.shared_key or self._share(tenant))

    def _admit_token_waiters(self, tenant: Tenant, cap: int) -> None:
        """Let ``tenant``'s waiters at the token gate in, in order, while they fit (the other workers'
        tokens of the tenant read once); publishes the tenant's tokens if any went in."""
        waiters = tenant.token_waiters
        elsewhere = self._tokens_held(tenant) - tenant.prompt_tokens
        admitted = False
        while waiters:
            prompt_tokens, future = waiters[0]
            if future.done():
                waiters.popleft()
                continue
            if not prompt_tokens_fit(tenant.prompt_tokens + elsewhere, prompt_tokens, cap):
                break
            waiters.popleft()
            tenant.prompt_tokens += prompt_tokens
            future.set_result(None)
            admitted = True
        if admitted and self.on_tenant_tokens is not None:
            self.on_tenant_tokens(tenant.shared_key or self._share(tenant), tenant.prompt_tokens)

    def _wake_replica_waiters(self) -> None:
        if self._replica_waiters:
            self._freed.set()
