"""Admission control with a bounded, first-come-first-served wait queue (async shell, no I/O).

A request is admitted while fewer than ``max_inflight`` are; otherwise it waits in a queue of at most
``max_queued`` requests, for at most ``queue_timeout_s``. A request leaving hands its slot straight
to the oldest waiter, so the queue is fair and the in-flight count never exceeds the cap.

The same queue bounds requests that were admitted but find every replica full
(``limits.max_inflight_per_replica``): they wait for a replica's request to end (woken at each
:meth:`Admission.leave`, and every ``RECHECK_S`` for slots freed elsewhere, e.g. a gRPC reservation
expiring), within the same deadline. Refusals say why:

* the queue is full → :class:`AdmissionRefused` with status 429 (``reason="queue_full"``);
* the wait timed out → status 503 (``reason="queue_timeout"``); both carry ``retry_after_s``, and
  ``limit`` says what was full (``"body_bytes"`` for the byte budget below).

**Body bytes.** Besides its slot, a request holds bytes of ``max_inflight_body_bytes``: its body's
size, reserved on entering (:meth:`Admission.enter` with ``body_bytes``: the declared length) or as
it is read (:meth:`Admission.hold`, for a body without a declared length), and its token ids
(:meth:`Admission.add`, which never waits). A request enters only while its slot and its bytes both
fit, and waiters are admitted strictly in order, so a large body at the head of the queue holds
back smaller ones behind it (first come first served, as for slots). More bytes for a request
already in flight (:meth:`Admission.hold`) go before the newcomers: they wait at the front of the
queue. :meth:`Admission.leave` gives back the slot and every byte the request held. The check on
the way in is two comparisons and an addition.

With ``kvlb serve --workers N`` the cap is the whole service's: :attr:`Admission.peers` gives the
requests the other workers have admitted (the shared load table, :mod:`balancer.load.share`) and
:attr:`Admission.on_change` publishes this worker's count. A request is admitted while this worker's
plus the others' count is below ``max_inflight``; a slot freed on another worker is seen by this
worker's waiters at their next check (every ``RECHECK_S``), in their order. Two workers admitting at
the same instant may both pass: the service is at most ``N - 1`` over the cap. The queue
(``max_queued``) and its order stay per worker.

Time comes from the running loop (``loop.time()``); nothing here is global.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

RECHECK_S = 0.05
"""Longest sleep of a request waiting for a replica slot between two checks (seconds)."""


MAX_BYTES = "body_bytes"
"""The ``limit`` of a refusal for want of bytes of ``max_inflight_body_bytes``."""
MAX_INFLIGHT = "max_inflight"
"""The ``limit`` of a refusal for want of a slot (or of a replica slot: :meth:`Admission.wait_until`)."""


class AdmissionRefused(Exception):
    """The request is not admitted: ``status`` 429 (queue full) or 503 (waited too long); ``limit``
    is what it waited for (:data:`MAX_INFLIGHT` or :data:`MAX_BYTES`)."""

    def __init__(
        self, status: int, reason: str, message: str, retry_after_s: float, limit: str = MAX_INFLIGHT
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s
        self.limit = limit


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


class _Waiter:
    """One request in the queue: what it waits for, and the future that admits it."""

    __slots__ = ("body_bytes", "future", "slot")

    def __init__(self, future: asyncio.Future[None], body_bytes: int, slot: bool) -> None:
        self.future = future
        self.body_bytes = body_bytes
        self.slot = slot
        """Whether it waits for a slot too (``False``: bytes for a request already in flight)."""


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
        self.body_bytes = 0
        """Bytes of bodies and token ids the requests of this process hold now (reserved, added)."""
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._replica_waiters = 0
        self._freed = asyncio.Event()
        self.refused_total = {"queue_full": 0, "queue_timeout": 0}

    @property
    def queued(self) -> int:
        """Requests waiting now (for admission or for a replica slot)."""
        return len(self._waiters) + self._replica_waiters

    def deadline(self) -> float:
        """The loop time at which a request arriving now stops waiting."""
        return asyncio.get_running_loop().time() + self.limits.queue_timeout_s

    def _has_room(self) -> bool:
        """Fewer than ``max_inflight`` admitted, this worker's and the others' together."""
        taken = self.inflight if self.peers is None else self.inflight + self.peers()
        return taken < self.limits.max_inflight

    def _set_inflight(self, inflight: int) -> None:
        self.inflight = inflight
        if self.on_change is not None:
            self.on_change(inflight)

    def try_enter(self, body_bytes: int = 0) -> bool:
        """Take a slot and ``body_bytes`` if both are free and nobody waits (``False``: :meth:`enter`
        waits). ``body_bytes``: at most ``max_inflight_body_bytes``."""
        fits = self.body_bytes + body_bytes <= self.limits.max_inflight_body_bytes
        if fits and not self._waiters and self._has_room():
            self.body_bytes += body_bytes
            self._set_inflight(self.inflight + 1)
            return True
        return False

    async def enter(self, deadline: float, body_bytes: int = 0) -> None:
        """Take a slot and ``body_bytes``, waiting in the queue until ``deadline`` (loop time) if
        either is short."""
        if self.try_enter(body_bytes):
            return
        await self._wait(_Waiter(asyncio.get_running_loop().create_future(), body_bytes, True), deadline)

    async def hold(self, body_bytes: int, deadline: float) -> None:
        """Hold ``body_bytes`` more for a request already admitted (a body read without a declared
        length): at once if they fit, else waiting at the front of the queue, before the newcomers,
        until ``deadline``. Refused like :meth:`enter`; what it held stays held until :meth:`leave`."""
        if self.body_bytes + body_bytes <= self.limits.max_inflight_body_bytes:
            self.body_bytes += body_bytes
            return
        await self._wait(_Waiter(asyncio.get_running_loop().create_future(), body_bytes, False), deadline)

    def add(self, body_bytes: int) -> None:
        """Count ``body_bytes`` more held by a request in flight (its token ids), without waiting:
        the bytes held may pass the budget by them, and newcomers wait until they are back under."""
        self.body_bytes += body_bytes

    def leave(self, body_bytes: int = 0) -> None:
        """Release a slot and the ``body_bytes`` the request held (all it reserved, held and added):
        the oldest waiters that now fit are admitted. With other workers, slots pass on only while
        the whole service is below the cap again."""
        self.body_bytes -= body_bytes
        if self.peers is None and self._waiters and self._waiters[0].slot:
            head = self._waiters[0]
            if (
                self.body_bytes + head.body_bytes <= self.limits.max_inflight_body_bytes
                and not head.future.done()
            ):
                self._waiters.popleft()
                self.body_bytes += head.body_bytes
                head.future.set_result(None)  # the slot passes on: ``inflight`` stays
                self._admit_waiters()
                self._wake_replica_waiters()
                return
        self._set_inflight(self.inflight - 1)
        if self._waiters:
            self._admit_waiters()
        self._wake_replica_waiters()

    async def _wait(self, waiter: _Waiter, deadline: float) -> None:
        """Queue ``waiter`` (at the back, or after the other byte waiters at the front if it wants
        no slot) until it is admitted, or refuse it (queue full at once, ``deadline`` passed)."""
        limit = MAX_INFLIGHT if waiter.slot and not self._has_room() else MAX_BYTES
        if limit == MAX_INFLIGHT:
            what = f"the balancer has {self.limits.max_inflight} requests in flight"
        else:
            what = (
                f"the balancer holds {self.body_bytes} bytes of request bodies "
                f"(limits.max_inflight_body_bytes = {self.limits.max_inflight_body_bytes})"
            )
        self._check_room(what, limit)
        if waiter.slot:
            self._waiters.append(waiter)
        else:
            front = 0
            while front < len(self._waiters) and not self._waiters[front].slot:
                front += 1
            self._waiters.insert(front, waiter)
        future = waiter.future
        try:
            async with asyncio.timeout_at(deadline):
                if self.peers is None:
                    await future
                else:  # slots freed by other workers wake nobody here: look again now and then
                    while not future.done():
                        self._admit_waiters()
                        if not future.done():
                            await asyncio.wait((future,), timeout=RECHECK_S)
                    future.result()
        except TimeoutError:
            self._give_back(waiter)
            raise self._timed_out(limit) from None
        except BaseException:
            self._give_back(waiter)
            raise

    def _admit_waiters(self) -> None:
        """Admit the oldest waiters while they fit: bytes, and a slot of the whole service (other
        workers' slots included) for those that want one."""
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.future.done():
                self._waiters.popleft()
                continue
            if self.body_bytes + waiter.body_bytes > self.limits.max_inflight_body_bytes:
                return
            if waiter.slot:
                if not self._has_room():
                    return
                self._set_inflight(self.inflight + 1)
            self._waiters.popleft()
            self.body_bytes += waiter.body_bytes
            waiter.future.set_result(None)

    async def wait_until(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        """Wait (counted in the queue) until ``ready()`` holds, e.g. some replica has a free slot;
        ``what`` says what is busy. Without a queue (``max_queued`` 0) it returns at once."""
        if ready() or self.limits.max_queued == 0:
            return
        self._check_room(what)
        self._replica_waiters += 1
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

    def _check_room(self, what: str, limit: str = MAX_INFLIGHT) -> None:
        if self.queued >= self.limits.max_queued:
            self.refused_total["queue_full"] += 1
            message = (
                f"{what} and {self.queued} requests queued (limits.max_queued = {self.limits.max_queued})"
            )
            raise AdmissionRefused(429, "queue_full", message, 1.0, limit)

    def _timed_out(self, limit: str = MAX_INFLIGHT) -> AdmissionRefused:
        self.refused_total["queue_timeout"] += 1
        timeout_s = self.limits.queue_timeout_s
        busy = (
            f"request bodies held at limits.max_inflight_body_bytes = {self.limits.max_inflight_body_bytes}"
            if limit == MAX_BYTES
            else "every slot or replica busy"
        )
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
        if future.done() and not future.cancelled():
            if waiter.slot:
                self.leave(waiter.body_bytes)
            else:
                self.body_bytes -= waiter.body_bytes
                self._admit_waiters()
            return
        future.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        self._admit_waiters()

    def _wake_replica_waiters(self) -> None:
        if self._replica_waiters:
            self._freed.set()
