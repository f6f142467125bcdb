"""What ends a ZMQ replay exchange before its timeout: the engine went away (I/O: reads a monitor).

A replay request (:mod:`balancer.sources.zmq_replay`) waits up to ``replay_timeout_s`` for the
engine's answer. An engine that goes away meanwhile never answers: the wait ran into its timeout,
blamed the replay endpoint for it, and the publisher's disconnect, queued on the SUB's monitor
behind the wait, was acted on (the replica's blocks dropped) only after it: 1.4–1.9 s after the
health probe had taken a stopped vLLM out of routing (h-realvllm). :class:`ReplayWatch` waits for
the answer together with two signs that none will come:

* the SUB's monitor reports ``EVENT_DISCONNECTED`` (the publisher's process is gone, or its
  connection), looked for every :data:`MONITOR_SLICE_S` while the replay waits: read here, and kept
  in :attr:`ReplayWatch.stash` for the source's monitor handling, which then drops the blocks as for
  any disconnect;
* :meth:`ReplayWatch.engine_gone`: the replica's health probe found nothing listening at the engine
  (its connection refused or dropped: not a timeout, which a hung or slow engine also gives). The
  probe runs on the request loop; the call reaches this watch on the ingest loop through
  ``loop.call_soon_threadsafe`` (:meth:`~balancer.sources.ingest_thread.ThreadedIngest.engine_gone`),
  so the ZMQ sockets are only ever touched by the ingest thread. While the engine is away no replay
  *poll* is started (it would only wait out its timeout too); a live message, a new connection or a
  good probe (:meth:`ReplayWatch.engine_back`) ends that.

Either sign raises :class:`EngineGone` in the waiting replay; the source logs that the engine went
away instead of blaming the endpoint. The watch reads no clock itself (its slices are the loop's
timers); every wait it adds is bounded by the replay's own ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
from asyncio import FIRST_COMPLETED
from collections import deque
from collections.abc import Awaitable
from typing import TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import _MonitorMessage, parse_monitor_message

T = TypeVar("T")

MAX_STASHED_EVENTS = 64
"""Most monitor events read off the SUB's monitor (and stashed) at one look; a connection gives a
handful."""
MONITOR_SLICE_S = 0.05
"""How often (seconds) a replay waiting for its answer looks whether the SUB's monitor holds an
event: the longest a publisher's disconnect waits to end the replay."""
MAX_SLICES = 100_000
"""Most such looks in one wait (83 minutes of them): the replay's own timeout ends it first."""


class EngineGone(Exception):
    """The engine went away while a replay waited for its answer (``why`` says how it was seen)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class ReplayWatch:
    """The signs that a source's replay will not be answered; lives on the ingest loop."""

    def __init__(self) -> None:
        self.monitor: zmq.asyncio.Socket | None = None
        """The current SUB's monitor (set while the SUB is open)."""
        self.stash: deque[_MonitorMessage] = deque()
        """Monitor events a replay read while it waited, in order, for the source's monitor handling."""
        self.away: str | None = None
        """Why the engine is away (its health probe), or ``None``: replay polls are held meanwhile."""
        self._gone: asyncio.Future[str] | None = None

    def engine_gone(self, why: str) -> None:
        """The health probe found nothing listening at the engine: a replay in flight ends now (call
        on the ingest loop)."""
        self.away = why
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(why)

    def engine_back(self) -> None:
        """The engine answers again (a good probe, a live message, a new connection)."""
        self.away = None
        if self._gone is not None and self._gone.done():
            self._gone = None

    def reset(self) -> None:
        """The SUB closed: its monitor and whatever it stashed go with it."""
        self.monitor = None
        self.stash.clear()

    async def until_gone(self, pending: Awaitable[T]) -> T:
        """``pending``'s result (a DEALER's send or receive future), unless the engine goes away
        first: then :class:`EngineGone`, and ``pending`` is cancelled (ZMQ takes a cancelled
        receive back off its queue; the caller closes the DEALER of a replay that did not end).
        The probe's signal ends the wait at once; the monitor is looked at every
        :data:`MONITOR_SLICE_S` (a ZMQ poll of the monitor socket per wait cost a replay poll a sixth
        more CPU of the ingest loop, ``loadtests/bench/replay_poll.py``; the slices cost nothing
        measurable)."""
        future = asyncio.ensure_future(pending)
        if future.done():
            return future.result()  # an answer already there (most frames of a long replay)
        if self.away is not None:
            future.cancel()
            raise EngineGone(self.away)
        gone = self._gone
        if gone is None:
            gone = self._gone = asyncio.get_running_loop().create_future()
        try:
            for _ in range(MAX_SLICES):
                await asyncio.wait((future, gone), timeout=MONITOR_SLICE_S, return_when=FIRST_COMPLETED)
                if future.done():
                    return future.result()
                if gone.done():
                    raise EngineGone(gone.result())
                if self._monitor_readable() and await self._read_monitor():
                    raise EngineGone("its publisher disconnected")
            return await future  # past MAX_SLICES (the caller's timeout ends the wait long before)
        finally:
            if not future.done():
                future.cancel()

    def _monitor_readable(self) -> bool:
        monitor = self.monitor
        if monitor is None or monitor.closed:
            return False
        events = monitor.getsockopt(zmq.EVENTS)
        return isinstance(events, int) and bool(events & zmq.POLLIN)

    async def _read_monitor(self) -> bool:
        """Stash the monitor events queued now; ``True`` when one is the publisher's disconnect."""
        monitor = self.monitor
        if monitor is None:
            return False
        disconnected = False
        for _ in range(MAX_STASHED_EVENTS):
            try:
                event = parse_monitor_message(await monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            self.stash.append(event)
            disconnected = disconnected or event["event"] == zmq.EVENT_DISCONNECTED
        return disconnected
