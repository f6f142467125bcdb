"""The garbage collector's settings for a serving process (process-wide; called by ``kvlb serve``).

Measured on ``kvlb bench overhead`` (``docs/benchmarks.md``, "The live HTTP path"): with CPython's
defaults a serving kvlb spent about a tenth of its CPU in young-generation collections. Each request
holds lists of thousands of token ids while it is in flight, and a young collection walks every live
young container, so the ~32 requests in flight were walked about once per five requests served
(about 1 ms per collection).

* :func:`settle_after_start` moves everything built at start-up (the tokenizers, the settings, the
  app) into the permanent generation (``gc.freeze``): full collections no longer walk it. It is
  still freed normally by reference counting.
* It raises the young-generation threshold from 700 to :data:`YOUNG_THRESHOLD` container allocations
  (net of frees): collections run about 30 times less often, and requests that finish in between
  are never walked. Cyclic garbage waits for at most that many allocations longer (a few MB).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000
"""``gc.set_threshold`` generation 0: net container allocations between young collections."""


def settle_after_start() -> None:
    """Freeze the start-up heap and set :data:`YOUNG_THRESHOLD` (the older thresholds stay)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
