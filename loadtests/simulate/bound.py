"""A routing-independent reference for TTFT at a rate: the pooled list schedule (pure: no clock, no I/O).

A router chooses a replica; the engines choose the order (first come, first served) and, with their
caches, what a prompt still has to prefill. :func:`pooled_ttfts` removes what a router's placement
can lose and keeps what it cannot change, to tell how much of a workload's TTFT at a rate is left to
routing:

* **One cache, pooled and unbounded.** A request reuses the longest prefix of full blocks (of
  ``prompt[:-1]``, as the engines match) that any earlier request had, whichever replica served it
  and however long ago: no placement and no eviction loses a hit. Its blocks count as cached from
  its arrival on, before they are computed.
* **A list schedule.** Each request's uncached prefill runs, whole, on the replica that frees first
  (a single first-come, first-served queue for the fleet, which no per-replica queue beats on
  waiting), at the profile's prefill rate plus one step's overhead per ``chunk_prefill_tokens``.
  Decode steps are left out: they only lengthen the engines' steps.

TTFT is then arrival → end of that prefill. Every simplification is optimistic for the reference
(more hits, no decode, a pooled queue), except that the schedule keeps the engines' first-come,
first-served order, which a router cannot change either. It is a reference, not a proof of
optimality: an order other than arrival order (shortest first) would lower a percentile, and no
engine here schedules that way. ``kvlb simulate --pooled-bound`` prints it for a stream and rate
(docs/policy-studies.md, "Part 8").
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from balancer.index.hashing import BlockHasher
from loadtests.simulate.sources import SimRequest
from replicas.sim.profiles import Profile


def pooled_ttfts(
    requests: Iterable[SimRequest], replicas: int, profile: Profile, page_size: int
) -> list[float]:
    """Each request's TTFT (model seconds, in arrival order) under the pooled list schedule.

    ``requests`` must come in arrival order; ``page_size`` is the block size of the match (tokens).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    hasher = BlockHasher(profile.model, page_size, mode="trtllm")  # full blocks of prompt[:-1]
    seen: set[int] = set()
    free_s = [0.0] * replicas  # a heap of the times each replica frees
    chunk = max(1, profile.chunk_prefill_tokens)
    ttfts: list[float] = []
    for request in requests:
        keys = [int(key) for key in hasher.request_keys(request.token_ids)]
        hits = 0
        for key in keys:
            if key not in seen:
                break
            hits += 1
        seen.update(keys)
        uncached = len(request.token_ids) - hits * page_size
        steps = max(1, -(-uncached // chunk))
        work_s = uncached * profile.prefill_s_per_token + steps * profile.step_overhead_s
        start_s = max(heapq.heappop(free_s), request.arrival_s)
        heapq.heappush(free_s, start_s + work_s)
        ttfts.append(start_s + work_s - request.arrival_s)
    return ttfts
