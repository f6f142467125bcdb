"""``Unstalled``: a latency measured in wall-clock seconds less the time a loaded machine kept the
test's own thread (and the processes it names) off the CPU (a test helper).

A test that bounds a latency (a waiter admitted at its next recheck, a change seen by another
balancer within a second) fails on a loaded machine when the kernel leaves its process waiting on
the run queue: the make test of a CI machine saw a 3 ms step take 1.02 s (2026-12-02). Linux counts
that wait per thread (``/proc/<pid>/task/<tid>/schedstat``: nanoseconds on the CPU, nanoseconds
waiting on a run queue, time slices), so a test can take it off: :meth:`Unstalled.seconds` is the
wall time since the start less the largest run-queue wait of the participants over the same span
(this thread, which runs the test's event loop, the other threads named, such as an ingest
thread, and the main thread of each named process). The
largest, not their sum: the participants are mostly stalled together, and the sum would take off
more than any of them lost. A latency that is the behaviour (a timer, a wait on another component)
is not run-queue wait, so a broken behaviour still fails the bound; only being descheduled is not
counted. Where the kernel does not say (no ``schedstat``), nothing is taken off.

A bound on a cost (CPU work: a decode, a quadratic walk) is ``time.thread_time()`` instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence


def _runqueue_wait_s(path: str) -> float:
    """Seconds the thread of ``schedstat`` file ``path`` waited on a run queue so far; 0.0 when it
    cannot be read (no such process any more, or a kernel without the file)."""
    try:
        with open(path, encoding="ascii") as stat:
            fields = stat.read().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Unstalled:
    """A stopwatch started at construction, in the thread that runs the timed work (its event
    loop); ``threads`` are other threads of this process taking part (an ingest thread's loop),
    ``pids`` other processes (a ``kvlb serve``, a ``redis-server``), whose main thread is counted."""

    def __init__(self, *pids: int, threads: Sequence[threading.Thread] = ()) -> None:
        tids = [threading.get_native_id(), *(thread.native_id for thread in threads if thread.native_id)]
        self._paths = [f"/proc/self/task/{tid}/schedstat" for tid in tids]
        self._paths += [f"/proc/{pid}/schedstat" for pid in pids]
        self._waited_s = [_runqueue_wait_s(path) for path in self._paths]
        self._started = time.perf_counter()

    def waited_s(self) -> float:
        """The largest run-queue wait of the participants since the start (seconds)."""
        pairs = zip(self._paths, self._waited_s, strict=True)
        return max(_runqueue_wait_s(path) - before for path, before in pairs)

    def seconds(self) -> float:
        """Wall-clock seconds since the start, less :meth:`waited_s` (never below zero)."""
        wall_s = time.perf_counter() - self._started
        return max(0.0, wall_s - max(0.0, self.waited_s()))
