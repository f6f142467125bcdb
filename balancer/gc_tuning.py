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
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


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
