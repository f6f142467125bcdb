"""Speculative index entries shared between the workers of ``kvlb serve --workers N`` (I/O: ZMQ ipc).

When a worker routes a request it adds speculative entries for the chosen replica (the blocks the
request will leave there), so that the next request with the same prefix goes there too before the
engine's own events confirm them. Each worker has its own index, so without sharing, a second worker
does not see them and may send the same prefix elsewhere (measured with ``kvlb loadtest``:
``docs/benchmarks.md``). Each worker therefore PUBlishes every speculative entry it adds
(``[key space, replica, ttl_s, keys]``, msgpack) on ``ipc://<run dir>/spec-<index>.ipc`` and
SUBscribes to every other worker's; what it receives goes into its own table
(``LockedPrefixTable.add_shared_speculative``, which does not publish it again). The receiving side
runs on the ingest thread; the publishing side is one non-blocking send on the request loop (a full
queue drops the message: the entry is only a hint, and it expires anyway).

The clock is ``time.monotonic`` in both processes (system-wide on Linux), so the receiver's ``now``
serves. The load each worker committed (in-flight requests, pending prefill) is shared through
shared memory instead (:mod:`balancer.load.share`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence

import msgpack
import zmq
import zmq.asyncio

from balancer.index.locked import LockedPrefixTable
from balancer.types import BlockKey, ReplicaId

log = logging.getLogger(__name__)

SNDHWM = 10_000
"""Messages queued per sibling before the PUB drops (each is a hint that expires)."""


def spec_endpoint(run_dir: str, index: int) -> str:
    return "ipc://" + os.path.join(run_dir, f"spec-{index}.ipc")


class SpeculationShare:
    """Publishes this worker's speculative entries and applies the siblings' (see the module doc)."""

    def __init__(self, run_dir: str, index: int, count: int, tables: Mapping[str, LockedPrefixTable]) -> None:
        """``tables`` maps a key space's name (the same in every worker) to its table here."""
        self.run_dir = run_dir
        self.index = index
        self.count = count
        self.tables = dict(tables)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pub: zmq.Socket[bytes] | None = None
        self.sent = 0
        self.dropped = 0
        self.received = 0

    def start_publishing(self) -> None:
        """Bind this worker's PUB (on the request loop's thread, which publishes) and hook the tables."""
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, SNDHWM)
        pub.bind(spec_endpoint(self.run_dir, self.index))
        self._pub = pub
        for name, table in self.tables.items():
            table.on_speculative = self._publisher(name)

    def _publisher(self, name: str) -> Callable[[ReplicaId, Sequence[BlockKey], float], None]:
        def publish(replica: ReplicaId, keys: Sequence[BlockKey], ttl_s: float) -> None:
            pub = self._pub
            if pub is None:
                return
            try:
                pub.send(msgpack.packb([name, str(replica), ttl_s, list(keys)]), zmq.NOBLOCK)
                self.sent += 1
            except zmq.Again:
                self.dropped += 1

        return publish

    async def receive(self, ctx: zmq.asyncio.Context) -> None:
        """Apply the siblings' entries until cancelled (run on the ingest thread's loop)."""
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for other in range(self.count):
            if other != self.index:
                sub.connect(spec_endpoint(self.run_dir, other))
        try:
            while True:
                message = await sub.recv()
                try:
                    name, replica, ttl_s, keys = msgpack.unpackb(message)
                    table = self.tables.get(name)
                    if table is not None:
                        table.add_shared_speculative(ReplicaId(replica), keys, float(ttl_s), time.monotonic())
                        self.received += 1
                except (ValueError, TypeError, msgpack.UnpackException):
                    log.debug("worker %d: a bad speculation message ignored", self.index)
                await asyncio.sleep(0)
        finally:
            sub.close(linger=0)

    def close(self) -> None:
        for table in self.tables.values():
            table.on_speculative = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        self._ctx.term()
