"""Admission control with a bounded, first-come-first-served wait queue (async shell, no I/O).

A request is admitted while fewer than ``max_inflight`` are; otherwise it waits in a queue of at most
``max_queued`` requests, for at most ``queue_timeout_s``. A request leaving hands its slot straight
to the oldest waiter, so the queue is fair and the in-flight count never exceeds the cap.

The same queue bounds requests that were admitted but find every replica full
(``limits.max_inflight_per_replica``): they wait for a replica's request to end (woken at each
:meth:`Admission.leave`, and every ``RECHECK_S`` for slots freed elsewhere, e.g. a gRPC reservation
expiring), within the same deadline. Refusals say why:

* the queue is full → :class:`AdmissionRefused` with status 429 (``reason="queue_full"``);
* the wait timed out → status 503 (``reason="queue_timeout"``); both carry ``retry_after_s``.

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


class AdmissionRefused(Exception):
    """The request is not admitted: ``status`` 429 (queue full) or 503 (waited too long)."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_inflight: int
    """Requests admitted at once (≥ 1)."""
    max_queued: int
    """Requests waiting at once, for admission or for a replica slot (≥ 0; 0 refuses at once)."""
    queue_timeout_s: float
    """Longest wait of one request, both waits together (seconds, > 0)."""


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
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
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

    def try_enter(self) -> bool:
        """Take a slot if one is free and nobody waits for one (``False``: :meth:`enter` waits)."""
        if not self._waiters and self._has_room():
            self._set_inflight(self.inflight + 1)
            return True
        return False

    async def enter(self, deadline: float) -> None:
        """Take a slot, waiting in the queue until ``deadline`` (loop time) if all are taken."""
        if self.try_enter():
            return
        self._check_room(f"the balancer has {self.limits.max_inflight} requests in flight")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                if self.peers is None:
                    await waiter
                else:  # slots freed by other workers wake nobody here: look again now and then
                    while not waiter.done():
                        self._admit_waiters()
                        if not waiter.done():
                            await asyncio.wait((waiter,), timeout=RECHECK_S)
                    waiter.result()
        except TimeoutError:
            self._give_back(waiter)
            raise self._timed_out() from None
        except BaseException:
            self._give_back(waiter)
            raise

    def leave(self) -> None:
        """Release a slot: the oldest waiter takes it over, else the count drops. With other
        workers, the slot passes on only while the whole service is below the cap again."""
        if self.peers is None:
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the slot passes on: ``inflight`` stays
                    self._wake_replica_waiters()
                    return
            self._set_inflight(self.inflight - 1)
        else:
            self._set_inflight(self.inflight - 1)
            self._admit_waiters()
        self._wake_replica_waiters()

    def _admit_waiters(self) -> None:
        """Admit the oldest waiters while the whole service has room (other workers' slots)."""
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            if not self._has_room():
                return
            self._waiters.popleft()
            self._set_inflight(self.inflight + 1)
            waiter.set_result(None)

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

    def _check_room(self, what: str) -> None:
        if self.queued >= self.limits.max_queued:
            self.refused_total["queue_full"] += 1
            message = (
                f"{what} and {self.queued} requests queued (limits.max_queued = {self.limits.max_queued})"
            )
            raise AdmissionRefused(429, "queue_full", message, 1.0)

    def _timed_out(self) -> AdmissionRefused:
        self.refused_total["queue_timeout"] += 1
        timeout_s = self.limits.queue_timeout_s
        return AdmissionRefused(
            503,
            "queue_timeout",
            f"no capacity within limits.queue_timeout_s = {timeout_s}s (every slot or replica busy)",
            max(1.0, timeout_s),
        )

    def _give_back(self, waiter: asyncio.Future[None]) -> None:
        """A waiter gives up: out of the queue, or, if the slot was handed to it meanwhile, pass it on."""
        if waiter.done() and not waiter.cancelled():
            self.leave()
            return
        waiter.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)

    def _wake_replica_waiters(self) -> None:
        if self._replica_waiters:
            self._freed.set()
