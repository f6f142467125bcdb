"""Event ingestion on a thread of its own, off the request loop (I/O: a thread, its loop, sockets).

Without Redis, every key space's :class:`~balancer.sources.pipeline.EventIngest` (its sources, queues
and appliers) runs on the one asyncio loop of an :class:`IngestThread`, with the thread's own ZMQ
context and HTTP session (TRT-LLM drains). Decoding and applying a flood of events then costs that
thread's time, not the request loop's: requests and ``/healthz`` of every pool keep being served,
and the flooding engine's entries only go stale (its queue overflows and resyncs, as before). The
index tables the two threads share are :class:`~balancer.index.locked.LockedPrefixTable` s.

Both threads still share the GIL. A thread busy decoding holds it for up to the interpreter's switch
interval each time the request loop wants it back, so :meth:`IngestThread.start` lowers that interval
to :data:`SWITCH_INTERVAL_S` (process-wide; the default 5 ms would add several milliseconds to
each request during a flood). The ingest loop also yields the GIL between messages
(:func:`yield_gil`, called by the sources' emit through :class:`ThreadedIngest`).

:class:`ThreadedIngest` is the request loop's handle on one ``EventIngest``: each call runs on the
ingest loop (``run_coroutine_threadsafe``) and is awaited from the caller's loop. ``status`` reads
counters without the loop (a point-in-time copy; the values are plain ints).

Every task has an owner: the ingest loop's tasks belong to the ``EventIngest`` s, closed by
:meth:`ThreadedIngest.aclose`; :meth:`IngestThread.stop` closes the session and the ZMQ context and
joins the thread (bounded by ``join_timeout_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TypeVar

import aiohttp
import zmq.asyncio

from balancer.sources.base import EventSource, Gate, IngestBatch, SourceStatus
from balancer.sources.pipeline import (
    ConsumingSource,
    EngineWatchingSource,
    EventIngest,
    GatedSource,
    ReplicaIngestStatus,
    ReplicaPipeline,
)
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

T = TypeVar("T")

SWITCH_INTERVAL_S = 0.0005
"""GIL switch interval (seconds) set while an ingest thread runs: the longest the request loop waits
for the GIL after I/O while ingestion is busy (CPython's default is 0.005)."""


TRIM_INTERVAL_S = 10.0
"""How often (seconds) the ingest thread returns freed heap memory to the OS."""


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` where there is none (musl, macOS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


def yield_gil() -> None:
    """Let another thread that waits for the GIL take it now (``time.sleep(0)`` releases it)."""
    time.sleep(0)


class IngestThread:
    """One thread running one asyncio loop for event ingestion, with its ZMQ context and session."""

    def __init__(self, name: str = "kvlb-ingest", *, join_timeout_s: float = 10.0) -> None:
        self.name = name
        self.join_timeout_s = join_timeout_s
        """Most seconds ``stop`` waits for the thread to end (it is a daemon thread past that)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.zmq: zmq.asyncio.Context | None = None
        self.session: aiohttp.ClientSession | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._previous_interval_s: float | None = None
        self._trimmer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the thread and wait until its loop, context and session exist."""
        if self._thread is not None:
            return
        self._previous_interval_s = sys.getswitchinterval()
        sys.setswitchinterval(min(self._previous_interval_s, SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._ready.wait, self.join_timeout_s)
        if self.loop is None:
            raise RuntimeError(f"{self.name}: the ingest loop did not start")

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._open())
            self.loop = loop
            self._ready.set()
            loop.run_forever()
            loop.run_until_complete(self._cancel_leftovers())
            loop.run_until_complete(self._close())
        finally:
            self._ready.set()
            loop.close()

    async def _open(self) -> None:
        self.zmq = zmq.asyncio.Context()
        self.session = aiohttp.ClientSession()
        self._trimmer = asyncio.get_running_loop().create_task(self._trim_forever())

    async def _trim_forever(self) -> None:
        """Every :data:`TRIM_INTERVAL_S`, hand freed heap memory back to the OS (``malloc_trim``,
        glibc only): a flood's message buffers and decoded events are freed in this thread's malloc
        arena and in libzmq's, which glibc otherwise keeps (RSS stayed 5× the baseline after one)."""
        trim = _malloc_trim()
        if trim is None:
            return
        while True:
            await asyncio.sleep(TRIM_INTERVAL_S)
            trim(0)  # ctypes releases the GIL during the call

    async def _cancel_leftovers(self) -> None:
        """Cancel and await every task still on this loop, bounded by ``join_timeout_s``. Their owners
        cancel them first; but a call cancelled from the request loop (a lease hand-over that timed
        out) returns there at once, while its cleanup here (cancelling an applier) may still run."""
        current = asyncio.current_task()
        left = [t for t in asyncio.all_tasks() if t is not current and t is not self._trimmer]
        for task in left:
            task.cancel()
        if not left:
            return
        _, pending = await asyncio.wait(left, timeout=self.join_timeout_s / 2)
        log.info("%s: %d tasks still running at stop were cancelled", self.name, len(left))
        if pending:
            names = sorted(task.get_name() for task in pending)
            log.warning("%s: %d tasks did not end when cancelled: %s", self.name, len(pending), names)

    async def _close(self) -> None:
        if self._trimmer is not None:
            self._trimmer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._trimmer
        if self.session is not None:
            await self.session.close()
        if self.zmq is not None:
            self.zmq.destroy(linger=0)

    async def call(self, factory: Callable[[], Awaitable[T]]) -> T:
        """Run ``factory()`` on the ingest loop and await its result from the caller's loop."""
        loop = self.loop
        if loop is None:
            raise RuntimeError(f"{self.name} is not running")

        async def run() -> T:
            return await factory()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), loop))

    async def stop(self) -> None:
        """Stop the loop (close the session and ZMQ context on it) and join the thread (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        loop = self.loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join, self.join_timeout_s)
        if thread.is_alive():
            log.warning("%s did not stop within %.1fs", self.name, self.join_timeout_s)
        self.loop = None
        if self._previous_interval_s is not None:
            sys.setswitchinterval(self._previous_interval_s)


class ThreadedIngest:
    """The request loop's handle on an :class:`EventIngest` that lives on an :class:`IngestThread`."""

    def __init__(self, thread: IngestThread, ingest: EventIngest) -> None:
        self.thread = thread
        self.ingest = ingest

    @staticmethod
    def yielding(sources: Sequence[EventSource]) -> list[EventSource]:
        """``sources`` whose every emitted batch is followed by a GIL yield (:func:`yield_gil`)."""
        return [_Yielding(source) for source in sources]

    async def add_replica(self, replica: ReplicaId, engine: str, sources: Sequence[EventSource]) -> None:
        """Register ``replica`` and its sources on the ingest loop (started if ingest runs)."""
        yielding = self.yielding(sources)

        async def add() -> ReplicaPipeline:
            return self.ingest.add_replica(replica, engine, yielding)

        await self.thread.call(add)

    async def remove_replica(
        self, replica: ReplicaId, *, drop_index: bool = True, drain_s: float = 0.0
    ) -> bool:
        return await self.thread.call(
            lambda: self.ingest.remove_replica(replica, drop_index=drop_index, drain_s=drain_s)
        )

    def engine_gone(self, replica: ReplicaId, why: str) -> None:
        """Tell ``replica``'s sources, on the ingest loop, that its health probe found nothing
        listening at the engine. Returns at once (a signal, not a call: the request loop's probe
        does not wait on the ingest thread); the sources' sockets are touched only on their loop."""
        loop = self.thread.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the thread stopped meanwhile: nothing to tell
                loop.call_soon_threadsafe(self.ingest.engine_gone, replica, why)

    def engine_back(self, replica: ReplicaId) -> None:
        """Tell ``replica``'s sources that its health probe passes again (returns at once)."""
        loop = self.thread.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the thread stopped meanwhile: nothing to tell
                loop.call_soon_threadsafe(self.ingest.engine_back, replica)

    async def start(self) -> None:
        await self.thread.call(self.ingest.start)

    async def aclose(self) -> None:
        if self.thread.loop is not None:
            await self.thread.call(self.ingest.aclose)

    def status(self, only: Collection[ReplicaId] | None = None) -> dict[ReplicaId, ReplicaIngestStatus]:
        """A point-in-time copy of the ingest counters (read without the ingest loop; of the
        replicas ``only`` names when given)."""
        for _ in range(3):  # the ingest thread may add a replica meanwhile: retry the dict walk
            try:
                return self.ingest.status(only)
            except RuntimeError:
                continue
        return {}


class _Yielding:
    """A source whose every emitted batch is followed by a GIL yield (see :func:`yield_gil`)."""

    def __init__(self, source: EventSource) -> None:
        self.source = source
        self.replica = source.replica

    @property
    def gate(self) -> Gate | None:
        return self.source.gate if isinstance(self.source, GatedSource) else None

    @gate.setter
    def gate(self, value: Gate | None) -> None:
        if isinstance(self.source, GatedSource):
            self.source.gate = value

    def finish(self) -> None:
        if isinstance(self.source, ConsumingSource):
            self.source.finish()

    def engine_gone(self, why: str) -> None:
        if isinstance(self.source, EngineWatchingSource):
            self.source.engine_gone(why)

    def engine_back(self) -> None:
        if isinstance(self.source, EngineWatchingSource):
            self.source.engine_back()

    @property
    def exchanging(self) -> bool:
        return isinstance(self.source, ConsumingSource) and self.source.exchanging

    @property
    def settled(self) -> bool:
        return not isinstance(self.source, ConsumingSource) or self.source.settled

    async def run(self, emit: Callable[[IngestBatch], None]) -> None:
        def emit_and_yield(batch: IngestBatch) -> None:
            emit(batch)
            yield_gil()

        await self.source.run(emit_and_yield)

    def status(self) -> SourceStatus:
        return self.source.status()
