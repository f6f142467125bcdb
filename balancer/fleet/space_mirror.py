"""``SpaceMirror``: one key space's :class:`~balancer.index.redis.mirror.Mirror`, run on the ingest
thread (I/O: a thread hop).

A mirror applies what the whole fleet's writers wrote (thousands of blocks a second during a flood):
reading the stream, decoding its entries and applying them to the table. In fleet mode that runs on
the loop of the balancer's :class:`~balancer.sources.ingest_thread.IngestThread`, with a Redis client
used on that loop only, so the request loop only reads the table. The table is a
:class:`~balancer.index.locked.LockedPrefixTable`: the request loop matches on it and adds its
speculative entries while the mirror applies (one slice of blocks per hold of the lock), and the
mirror yields the GIL after each entry (:func:`~balancer.sources.ingest_thread.yield_gil`).

A table the mirror builds (its warm start, a resync) is installed into the key space on the request
loop (``call_soon_threadsafe``), between two of its callbacks, exactly where the mirror installed it
when it ran there: a request never sees two tables. :attr:`SpaceMirror.ready` is set there, after
the first install, so ``/readyz`` turns ready only once routing reads the warm table.

This class is the request loop's handle. Its counters and positions are the mirror's plain values
read across the threads (point-in-time, as :class:`~balancer.sources.ingest_thread.ThreadedIngest`
reads its counters); :meth:`write_snapshot` is one hop, so the snapshot is copied between two
entries of the mirror. The tail task is owned here: started by :meth:`start` on the ingest loop and
cancelled by :meth:`aclose` there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from balancer.index.redis.mirror import Mirror, MirrorCounters
from balancer.index.table import PrefixTable
from balancer.sources.ingest_thread import IngestThread
from balancer.tasks import cancel_all, spawn


class SpaceMirror:
    """The request loop's handle on one key space's :class:`Mirror`, which runs on ``thread``."""

    def __init__(
        self, thread: IngestThread, mirror: Mirror, install: Callable[[PrefixTable], None], name: str
    ) -> None:
        """``install`` puts a newly built table where routing reads it; it runs on the request loop
        (the loop that calls :meth:`start`). ``mirror.on_table`` is taken over."""
        self.thread = thread
        self.mirror = mirror
        """Lives on the ingest loop once started: call it there (``thread.call``); reading a value is fine."""
        self.name = name
        self.ready = asyncio.Event()
        """Set on the request loop once the first table the mirror built is installed."""
        self._install = install
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        """The tail task, on the ingest loop."""
        self._stop: asyncio.Event | None = None
        """The tail task's stop event, made on the ingest loop."""
        mirror.on_table = self._hand_over

    # ------------------------------------------------------------------ running

    def _hand_over(self, table: PrefixTable) -> None:
        """On the ingest loop: the mirror built ``table``; install it on the request loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._installed, table)

    def _installed(self, table: PrefixTable) -> None:
        if table is self.mirror.table:  # a table built and then replaced meanwhile is not installed
            self._install(table)
            self.ready.set()

    async def start(self) -> None:
        """Start the mirror's tail task on the ingest loop (it warms up there in the background)."""
        self._loop = asyncio.get_running_loop()
        mirror, name = self.mirror, f"kvlb-mirror-{self.name}"

        async def start() -> tuple[asyncio.Event, asyncio.Task[None]]:
            stop = asyncio.Event()
            return stop, spawn(mirror.run(stop), name)

        self._stop, self._task = await self.thread.call(start)

    async def aclose(self) -> None:
        """Stop the tail task and wait for it, on the ingest loop (idempotent)."""
        task, stop, self._task = self._task, self._stop, None
        if task is None or stop is None or self.thread.loop is None:
            return

        async def close() -> None:
            stop.set()
            await cancel_all([task])

        with contextlib.suppress(RuntimeError):  # the ingest loop stopped already: so did the task
            await self.thread.call(close)

    async def write_snapshot(self) -> int:
        """Write the mirror's snapshot to Redis (:meth:`Mirror.write_snapshot`, on the ingest loop)."""
        return await self.thread.call(self.mirror.write_snapshot)

    # ------------------------------------------------------------------ reading (point in time)

    @property
    def last_number(self) -> int:
        return self.mirror.last_number

    @property
    def bytes_read(self) -> int:
        return self.mirror.bytes_read

    @property
    def partial(self) -> bool:
        return self.mirror.partial

    @property
    def lag_s(self) -> float | None:
        return self.mirror.lag_s

    @property
    def connected(self) -> bool:
        return self.mirror.connected

    @property
    def counters(self) -> MirrorCounters:
        return self.mirror.counters
