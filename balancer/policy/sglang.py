"""SGLang Model Gateway's ``cache_aware`` switch rule, on router-owned blocks (pure).

With ``requests_r`` the request load (``in_flight_r + waiting_r``, see :mod:`balancer.policy.baselines`)
and ``match_r = overlap_r / request_blocks``::

    imbalanced = (max requests − min requests > balance_abs_threshold)
                 and (max requests > balance_rel_threshold · min requests)
    if imbalanced:                      → argmin requests_r
    elif max match_r > cache_threshold: → the best-matching replica (ties: fewer requests, then rng)
    else:                               → argmin requests_r

Defaults are SMG's CLI defaults: ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
``balance_rel_threshold`` 1.5 (its struct defaults 0.5 / 32 / 1.1 differ). Differences from SMG,
on purpose:

* SMG's KV-usage triggers (``overload_token_usage_threshold``, ``balance_token_usage_threshold``) are
  disabled by default there (1.0) and are left out here.
* SMG with a KV-event index picks the best overlap whenever there is any; ``cache_threshold = 0``
  reproduces that. Its approximate tree measures the match in characters or tokens; here it is in
  blocks of the router's own index.
* A cache miss goes to the least loaded replica, not to the smallest tree (the older rule, which
  caused the "death spiral" of sglang #14305). Ties are broken with ``rng``, not a processed count.

``cost`` in the terms is ``requests_r`` (what the rule compares); the overlap column shows the match.
"""

from __future__ import annotations

import random

from balancer.load.tracker import LoadSnapshot
from balancer.policy.base import PolicyWeights, RouteRequest
from balancer.policy.common import candidates_of, decide, overlap_blocks, pick_min, plain_terms
from balancer.types import Decision, Overlap


class SglangThreshold:
    """The rule in the module docstring. Stateless."""

    name = "sglang_threshold"

    def __call__(
        self,
        request: RouteRequest,
        overlap: Overlap,
        load: LoadSnapshot,
        weights: PolicyWeights,
        rng: random.Random,
    ) -> Decision:
        candidates = candidates_of(request)
        requests = {r: float(load.of(r).seq_load) for r in candidates}
        matched = {r: overlap_blocks(overlap, r, request.request_blocks) for r in candidates}
        low, high = min(requests.values()), max(requests.values())
        best = max(matched.values())
        ratio = best / request.request_blocks if request.request_blocks > 0 else 0.0
        if high - low > weights.balance_abs_threshold and high > weights.balance_rel_threshold * low:
            chosen = pick_min(list(requests.items()), rng)
            reason = f"imbalanced (requests {low:g}..{high:g}): fewest requests"
        elif ratio > weights.cache_threshold:
            chosen = pick_min([(r, requests[r]) for r in candidates if matched[r] == best], rng)
            reason = f"match {ratio:.2f} > {weights.cache_threshold:g}: best match"
        else:
            chosen = pick_min(list(requests.items()), rng)
            reason = f"match {ratio:.2f} <= {weights.cache_threshold:g}: fewest requests"
        terms = [
            plain_terms(load.of(r), matched[r], request.request_blocks, cost=requests[r]) for r in candidates
        ]
        return decide(self.name, chosen, request, overlap, load, terms, reason)
