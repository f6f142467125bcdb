"""The garbage collector's settings for a serving process (process-wide; called by ``kvlb serve``).

Measured on ``kvlb bench overhead`` (``docs/benchmarks.md``, "The live HTTP path"): with CPython's
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
"""

from __future__ import annotations

import gc


def settle_after_start() -> None:
    """Collect once, then freeze the start-up heap (the thresholds stay CPython's)."""
    gc.collect()
    gc.freeze()
