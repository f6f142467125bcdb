"""The garbage collector's settings for a serving process (process-wide; called by ``kvlb serve``).

Measured on ``kvlb bench overhead`` (``docs/benchmark-history.md``, "The live HTTP path"): with CPython's
defaults a serving kvlb spent about a tenth of its CPU in young-generation collections. Each request
holds lists of thousands of token ids while it is in flight, and a young collection walks every live
young container, so the ~32 requests in flight were walked about once per five requests served
(about 1 ms per collection).

* :func:`settle_after_start` moves everything built at start-up (the tokenizers, the settings, the
  app) into the permanent generation (``gc.freeze``): full collections no longer walk it. It is
  still freed normally by reference counting.
* The young-generation threshold stays CPython's (700). Raising it to 20,000 saved another 5–8% of
  CPU per request, but cyclic garbage then waits that many allocations longer, and a request's
  cycles can hold its whole body: under `make faults`' bursts of 16 MiB bodies the high-water mark
  rose by about 110 MB per burst (263 → 842 MB, against the 400 MB bound it asserts).
* :func:`collections_paused` keeps the collector from running inside a burst of allocations that
  all die at its end: decoding one KV-event message builds thousands of containers at once (the
  decoded envelope), so collections ran in the middle of it, found them all alive, and promoted them
  to the older generations, until a full collection (70–270 ms with the console's decision ring,
  holding the GIL: every request waited) ran every few dozen messages of a flood.
* :func:`thread_cpu_s` is ``time.thread_time`` less the collections this thread ran: what the
  ingestion budget charges (:mod:`balancer.sources.budget`). A collection is the interpreter's
  work on every thread's garbage, triggered by whichever allocation crosses the threshold; charged
  to the replica whose apply happened to trigger it, one full collection could spend its budget
  and shed its events.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from typing import Any


def settle_after_start() -> None:
    """Collect once, then freeze the start-up heap (the thresholds stay CPython's)."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """No automatic collection while the block runs (process-wide, so keep the block short: one
    message's decode). Its allocations still count, and those that die within it uncount
    themselves, so what outlives it is collected as usual afterwards. A nested use leaves the
    collector as it found it; of two threads' overlapping uses, only the first turns it back on, so
    the second's block may end with collections running again (never with them left off)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class _Collections(threading.local):
    """This thread's collections: CPU seconds spent in them, and when the running one began."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.started: float | None = None


_COLLECTIONS = _Collections()
_HOOK_LOCK = threading.Lock()


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    """``gc.callbacks`` hook: runs on the thread that collects, around each collection."""
    if phase == "start":
        _COLLECTIONS.started = time.thread_time()
    elif _COLLECTIONS.started is not None:
        _COLLECTIONS.cpu_s += time.thread_time() - _COLLECTIONS.started
        _COLLECTIONS.started = None


def _hooked() -> None:
    if _on_collection not in gc.callbacks:
        with _HOOK_LOCK:
            if _on_collection not in gc.callbacks:
                gc.callbacks.append(_on_collection)


def thread_cpu_s() -> float:
    """This thread's CPU time (seconds, ``time.thread_time``) less what it spent in collections
    since the first call in the process: differences of it time a step's own work. The hook it
    installs (``gc.callbacks``, once per process) costs two clock reads a collection."""
    _hooked()
    return time.thread_time() - _COLLECTIONS.cpu_s
