"""Baseline policies that ignore the block cost, for comparison in ``loadtests/`` (pure).

"Load" here is :attr:`ReplicaLoad.seq_load <balancer.load.tracker.ReplicaLoad.seq_load>`:
``requests_r = in_flight_r + waiting_r``, the requests this balancer has in flight on ``r`` (prefill
and decode, router-tracked) plus the engine's scraped queue (0 when unknown or stale). Every
baseline fills :class:`~balancer.types.CostTerms` with the load fields; ``cost`` is the score it
compares (``None`` when it does not score) and the three cost terms are 0. Ties are broken
uniformly with the given ``rng``.

None has state: :class:`RoundRobin`'s rotation is the router's count of committed decisions
(``RouteRequest.rotation``).
"""

from __future__ import annotations

import random

import xxhash

from balancer.load.tracker import LoadSnapshot
from balancer.policy.base import PolicyWeights, RouteRequest
from balancer.policy.common import candidates_of, decide, overlap_blocks, pick_min, plain_terms, tie_note
from balancer.types import CostTerms, Decision, Overlap, ReplicaId


def _terms(
    request: RouteRequest,
    overlap: Overlap,
    load: LoadSnapshot,
    replicas: list[ReplicaId],
    cost: dict[ReplicaId, float] | None = None,
    probability: float | None = None,
    excluded: dict[ReplicaId, str] | None = None,
) -> list[CostTerms]:
    return [
        plain_terms(
            load.of(r),
            overlap_blocks(overlap, r, request.request_blocks),
            request.request_blocks,
            cost=None if cost is None else cost.get(r),
            probability=probability,
            excluded=None if excluded is None else excluded.get(r),
        )
        for r in replicas
    ]


class RoundRobin:
    """``chosen = candidates[k mod n]``, ``k`` the router's committed decisions so far
    (``RouteRequest.rotation``, advanced by the router at commitment, not here: a dry run moves
    nothing). It ignores load and cache entirely.
    """

    name = "round_robin"

    def __call__(
        self,
        request: RouteRequest,
        overlap: Overlap,
        load: LoadSnapshot,
        weights: PolicyWeights,
        rng: random.Random,
    ) -> Decision:
        candidates = candidates_of(request)
        index = request.rotation % len(candidates)
        terms = _terms(request, overlap, load, candidates)
        return decide(self.name, candidates[index], request, overlap, load, terms, "rotation")


class RandomChoice:
    """``chosen ~ uniform(candidates)`` with ``rng``; each term's probability is ``1/n``."""

    name = "random"

    def __call__(
        self,
        request: RouteRequest,
        overlap: Overlap,
        load: LoadSnapshot,
        weights: PolicyWeights,
        rng: random.Random,
    ) -> Decision:
        candidates = candidates_of(request)
        chosen = rng.choice(candidates)
        terms = _terms(request, overlap, load, candidates, probability=1.0 / len(candidates))
        return decide(self.name, chosen, request, overlap, load, terms, "uniform")


def least_load(
    policy: str,
    request: RouteRequest,
    overlap: Overlap,
    load: LoadSnapshot,
    rng: random.Random,
    reason: str = "fewest requests",
) -> Decision:
    """``argmin_r requests_r`` (random tie-break), reported under ``policy``'s name."""
    candidates = candidates_of(request)
    cost = {r: float(load.of(r).seq_load) for r in candidates}
    chosen = pick_min(list(cost.items()), rng)
    terms = _terms(request, overlap, load, candidates, cost=cost)
    return decide(policy, chosen, request, overlap, load, terms, reason + tie_note(list(cost.items())))


class LeastLoad:
    """``argmin_r (in_flight_r + waiting_r)``, ties broken with ``rng``; ``cost`` = that count."""

    name = "least_load"

    def __call__(
        self,
        request: RouteRequest,
        overlap: Overlap,
        load: LoadSnapshot,
        weights: PolicyWeights,
        rng: random.Random,
    ) -> Decision:
        return least_load(self.name, request, overlap, load, rng)


class PowerOfTwo:
    """Sample two distinct candidates with ``rng``; take the one with fewer requests (ties with
    ``rng``). With two or fewer candidates, all are compared. Unsampled replicas are marked
    ``excluded="not sampled"``."""

    name = "power_of_two"

    def __call__(
        self,
        request: RouteRequest,
        overlap: Overlap,
        load: LoadSnapshot,
        weights: PolicyWeights,
        rng: random.Random,
    ) -> Decision:
        candidates = candidates_of(request)
        sampled = candidates if len(candidates) <= 2 else rng.sample(candidates, 2)
        cost = {r: float(load.of(r).seq_load) for r in sampled}
        chosen = pick_min([(r, cost[r]) for r in sampled], rng)
        excluded = {r: "not sampled" for r in candidates if r not in cost}
        terms = _terms(request, overlap, load, candidates, cost=cost, excluded=excluded)
        return decide(self.name, chosen, request, overlap, load, terms, f"best of {len(sampled)}")


def session_owner(session_key: str, candidates: list[ReplicaId]) -> ReplicaId:
    """Rendezvous (highest-random-weight) hashing: the candidate with the highest
    ``XXH3-64(replica, seed=XXH3-64(session_key))``. Removing a replica moves only the sessions it
    owned; adding one takes about ``1/n`` of them. Ties (astronomically rare) go to the smaller id."""
    seed = xxhash.xxh3_64_intdigest(session_key.encode("utf-8"))
    return max(candidates, key=lambda r: (xxhash.xxh3_64_intdigest(r.encode("utf-8"), seed=seed), r))


class Session:
    """Sticky sessions: ``request.session_key`` → :func:`session_owner` over the candidates; without a
    (non-empty) key, least load. Load and cache are ignored for keyed requests (``cost`` is ``None``)."""

    name = "session"

    def __call__(
        self,
        request: RouteRequest,
        overlap: Overlap,
        load: LoadSnapshot,
        weights: PolicyWeights,
        rng: random.Random,
    ) -> Decision:
        if not request.session_key:  # None or empty
            return least_load(self.name, request, overlap, load, rng, "no session key: fewest requests")
        candidates = candidates_of(request)
        chosen = session_owner(request.session_key, candidates)
        terms = _terms(request, overlap, load, candidates)
        return decide(self.name, chosen, request, overlap, load, terms, "rendezvous hash of session key")
