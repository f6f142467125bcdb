"""A discrete-event loop on virtual time (pure: no clock reads, no I/O).

Events are ``(at_s, seq, action, arg)`` in a binary heap: they run in order of virtual time, and
events due at the same instant run in the order they were scheduled (``seq`` is a counter, so the
order never depends on the actions themselves). Running an event moves :attr:`EventLoop.now_s` to its
time; an action may schedule further events, at ``now_s`` or later, never earlier.

Cancelling is lazy: :meth:`EventLoop.cancel` marks the handle and the event is dropped when it comes
to the top of the heap. The loop never sleeps: a simulated hour costs only the events in it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

Action = Callable[[Any, float], None]
"""``action(arg, now_s)``: what an event does; ``now_s`` is the event's virtual time."""


class EventLoop:
    """A virtual-time event queue. Not thread-safe; one loop per simulation."""

    __slots__ = ("_cancelled", "_heap", "_seq", "now_s", "processed")

    def __init__(self, start_s: float = 0.0) -> None:
        if not math.isfinite(start_s):
            raise ValueError(f"start_s must be finite, got {start_s}")
        self.now_s = start_s
        """Virtual time of the event running now (or of the last one run)."""
        self.processed = 0
        """Events run so far (cancelled ones not counted)."""
        self._heap: list[tuple[float, int, Action, Any]] = []
        self._seq = 0
        self._cancelled: set[int] = set()

    def __len__(self) -> int:
        """Events still queued (cancelled ones included until they are dropped)."""
        return len(self._heap)

    def schedule(self, at_s: float, action: Action, arg: Any = None) -> int:
        """Run ``action(arg, at_s)`` at virtual time ``at_s``; returns a handle for :meth:`cancel`.

        ``ValueError`` when ``at_s`` is before :attr:`now_s` (time never runs backwards) or not finite.
        """
        if not at_s >= self.now_s or math.isinf(at_s):
            raise ValueError(f"cannot schedule at {at_s!r}: now is {self.now_s}")
        self._seq += 1
        heapq.heappush(self._heap, (at_s, self._seq, action, arg))
        return self._seq

    def cancel(self, handle: int) -> None:
        """Drop a scheduled event (no effect if it already ran)."""
        if 0 < handle <= self._seq:
            self._cancelled.add(handle)

    def next_at(self) -> float | None:
        """Virtual time of the next live event, or ``None`` when nothing is queued."""
        heap = self._heap
        while heap and heap[0][1] in self._cancelled:
            self._cancelled.discard(heapq.heappop(heap)[1])
        return heap[0][0] if heap else None

    def run(self, until_s: float = math.inf, max_events: int | None = None) -> int:
        """Run events due at or before ``until_s`` (at most ``max_events``); returns how many ran.

        Stops early when the queue is empty. Afterwards :attr:`now_s` is the time of the last event
        run (it is not advanced to ``until_s``).
        """
        heap = self._heap
        cancelled = self._cancelled
        pop = heapq.heappop
        budget = math.inf if max_events is None else max_events
        ran = 0
        while heap and ran < budget:
            if heap[0][0] > until_s:
                break
            at_s, seq, action, arg = pop(heap)
            if cancelled and seq in cancelled:
                cancelled.discard(seq)
                continue
            self.now_s = at_s
            action(arg, at_s)
            ran += 1
        self.processed += ran
        return ran
