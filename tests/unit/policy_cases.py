"""One request through the cost policy, for the unit tests of its charges (test helper, pure).

Each charge's tests build a few ``ReplicaLoad`` s and overlaps and read the decision's per-replica
terms; this is the shared way to do that, with the policy's default weights unless a test names some.
"""

from __future__ import annotations

import random

from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.policy import CostPolicy, PolicyWeights, RouteRequest
from balancer.types import CostTerms, Decision, Overlap, ReplicaId

BLOCK = 16
"""Tokens per block in these cases."""


def route(
    overlaps: dict[ReplicaId, int],
    loads: list[ReplicaLoad],
    *,
    held: dict[ReplicaId, int] | None = None,
    roots: dict[ReplicaId, int] | None = None,
    request_blocks: int = 10,
    **weights: float | None,
) -> Decision:
    """The cost policy's decision for a request of ``request_blocks`` blocks among the replicas of
    ``overlaps`` (their cached prefix), with ``loads``, each replica's ``held`` blocks in all and
    the prompt ``roots`` its caches hold."""
    request = RouteRequest(
        candidates=tuple(overlaps), request_blocks=request_blocks, prompt_tokens=request_blocks * BLOCK
    )
    overlap = Overlap(
        blocks=overlaps, request_blocks=request_blocks, held_blocks=held or {}, held_roots=roots or {}
    )
    snapshot = LoadSnapshot(now=0.0, block_size_tokens=BLOCK, replicas={x.replica: x for x in loads})
    return CostPolicy()(request, overlap, snapshot, PolicyWeights(**weights), random.Random(0))  # type: ignore[arg-type]


def terms_of(decision: Decision) -> dict[ReplicaId, CostTerms]:
    return {t.replica: t for t in decision.terms}
