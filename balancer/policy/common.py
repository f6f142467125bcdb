"""Helpers shared by the policies (pure): candidate lists, per-replica terms, tie-breaks, decisions."""

from __future__ import annotations

import random
from collections.abc import Sequence

from balancer.errors import NoReplicasAvailable
from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.policy.base import RouteRequest
from balancer.types import CostTerms, Decision, Overlap, ReplicaId

TIE_TOLERANCE = 1e-9
"""Scores within this relative distance of the best count as tied (float noise is not a preference)."""


def candidates_of(request: RouteRequest) -> list[ReplicaId]:
    """The request's distinct candidates in their given order; raises ``NoReplicasAvailable``."""
    candidates = list(dict.fromkeys(request.candidates))
    if not candidates:
        raise NoReplicasAvailable("no candidate replicas for this request")
    return candidates


def overlap_blocks(overlap: Overlap, replica: ReplicaId, request_blocks: int) -> int:
    """Overlap of ``replica`` clamped to 0..request_blocks (an index cannot match more than asked):
    ``max(0, min(overlap, request_blocks))``, written as the comparisons ``min`` and ``max`` make
    (the builtins parse their arguments as keywords may follow: about 800 instructions a call, four
    calls a candidate of every request)."""
    blocks = overlap.of(replica)
    if request_blocks < blocks:
        blocks = request_blocks
    return blocks if blocks > 0 else 0


def plain_terms(
    load: ReplicaLoad,
    overlap_blocks: int,
    request_blocks: int,
    *,
    cost: float | None = None,
    probability: float | None = None,
    excluded: str | None = None,
) -> CostTerms:
    """Terms for a policy that does not use the block cost: the load fields are filled in, the
    three cost terms are 0 and ``cost`` is the policy's own score (``None`` when it does not
    score)."""
    return CostTerms(
        replica=load.replica,
        overlap_blocks=overlap_blocks,
        request_blocks=request_blocks,
        pending_prefill_blocks=load.pending_prefill_blocks,
        active_decode_blocks=float(load.active_decode_blocks),
        waiting_requests=float(load.waiting_reqs or 0),
        kv_usage=load.kv_usage,
        prefill_term=0.0,
        decode_term=0.0,
        queue_term=0.0,
        cost=cost,
        probability=probability,
        excluded=excluded,
    )


def minimal(scored: Sequence[tuple[ReplicaId, float]]) -> list[ReplicaId]:
    """Every replica whose score is within :data:`TIE_TOLERANCE` of the lowest, in input order."""
    best = min(score for _, score in scored)
    slack = TIE_TOLERANCE * max(1.0, abs(best))
    return [replica for replica, score in scored if score <= best + slack]


def tie_note(scored: Sequence[tuple[ReplicaId, float]]) -> str:
    """For a decision's reason: `` (a tie of N: drawn at random)`` when :func:`pick_min` drew among
    several, else ``""``. A dry run (``/admin/explain``) draws too, so with a tie the request itself
    may go to another of the tied replicas."""
    tied = minimal(scored) if scored else []
    return f" (a tie of {len(tied)}: drawn at random)" if len(tied) > 1 else ""


def pick_min(scored: Sequence[tuple[ReplicaId, float]], rng: random.Random) -> ReplicaId:
    """The lowest-scoring replica; ties broken uniformly with ``rng`` (no draw without a tie)."""
    tied = minimal(scored)
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def decide(
    policy: str,
    chosen: ReplicaId,
    request: RouteRequest,
    overlap: Overlap,
    load: LoadSnapshot,
    terms: Sequence[CostTerms],
    reason: str,
    ramp_share: float | None = None,
    busy_share: float | None = None,
) -> Decision:
    """The :class:`Decision` for ``chosen``: predicted cached tokens = its overlap × block size.
    ``ramp_share``: the averaged busy share the cost policy's credit read (``Decision.ramp_share``),
    ``busy_share`` the share the decision saw (``Decision.busy_share``)."""
    chosen_overlap = overlap_blocks(overlap, chosen, request.request_blocks)
    return Decision(
        replica=chosen,
        policy=policy,
        overlap_blocks=chosen_overlap,
        request_blocks=request.request_blocks,
        cached_tokens=chosen_overlap * load.block_size_tokens,
        terms=tuple(terms),
        dp_rank=overlap.best_rank.get(chosen, 0),
        reason=reason,
        ramp_share=ramp_share,
        busy_share=busy_share,
    )
