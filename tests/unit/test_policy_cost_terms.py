"""``cost_terms`` builds its :class:`CostTerms` positionally: checked against the keyword-built
version it replaced (a model), alone and through the cost policy (whose overlaps are clamped to the
request), for random loads, overlaps (negative and past the request too), weights and guards."""

from __future__ import annotations

import dataclasses
import random

from fuzz_examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.policy import CostPolicy, PolicyWeights, RouteRequest
from balancer.policy.common import overlap_blocks
from balancer.policy.cost import admission_shortfall_blocks, cache_pressure, cost_terms, overlap_survival
from balancer.types import CostTerms, Overlap, ReplicaId

REPLICAS = [ReplicaId(f"r{i}") for i in range(4)]


def reference_terms(
    load: ReplicaLoad,
    overlap: int,
    request_blocks: int,
    weights: PolicyWeights,
    *,
    credit: float,
    excluded: str | None,
    speculative: int = 0,
    pressure: float | None = None,
    held_roots: int | None = None,
    fewest_roots: int | None = None,
) -> CostTerms:
    """``cost_terms`` as it was: every field by name."""
    waiting = float(load.waiting_reqs or 0)
    pending = load.pending_prefill_blocks
    shared = min(pending, min(credit, 1.0) * speculative)
    survival = 1.0
    if weights.eviction_risk_weight > 0:
        survival = overlap_survival(
            pending - shared, load.capacity_blocks, pressure, weights.eviction_risk_weight
        )
    credited = survival * overlap
    prefill = weights.prefill_weight
    prefill_term = prefill * (pending - shared + request_blocks - credit * credited)
    inserted = request_blocks - (credited if credit > 0 else 0)
    duplication_term = prefill * weights.duplication_weight * (pressure or 0.0) * inserted
    interference_term = prefill * weights.interference_weight * load.active_decode_seqs * inserted
    admission_term = 0.0
    if weights.admission_weight:
        shortfall = admission_shortfall_blocks(load, inserted if overlap == 0 else None)
        admission_term = prefill * weights.admission_weight * shortfall
    root_term = 0.0
    if held_roots is not None and overlap == 0 and fewest_roots is not None and weights.root_weight > 0:
        extra = weights.root_weight * max(0, held_roots - fewest_roots)
        root_term = prefill * min(weights.root_cap_prompts, extra) * request_blocks
    decode_term = weights.decode_weight * load.active_decode_blocks
    queue_term = weights.queue_weight * waiting
    return CostTerms(
        replica=load.replica,
        overlap_blocks=overlap,
        request_blocks=request_blocks,
        pending_prefill_blocks=load.pending_prefill_blocks,
        active_decode_blocks=float(load.active_decode_blocks),
        waiting_requests=waiting,
        kv_usage=load.kv_usage,
        prefill_term=prefill_term,
        decode_term=decode_term,
        queue_term=queue_term,
        cost=prefill_term
        + duplication_term
        + interference_term
        + admission_term
        + root_term
        + decode_term
        + queue_term,
        excluded=excluded,
        shared_pending_blocks=shared,
        duplication_term=duplication_term,
        interference_term=interference_term,
        cache_pressure=pressure,
        overlap_survival=survival,
        overlap_credit=credit,
        admission_term=admission_term,
        root_term=root_term,
        held_roots=held_roots,
    )


loads = st.builds(
    ReplicaLoad,
    replica=st.sampled_from(REPLICAS),
    pending_prefill_seqs=st.integers(0, 5),
    pending_prefill_tokens=st.integers(0, 5000),
    pending_prefill_blocks=st.floats(0, 400),
    active_decode_seqs=st.integers(0, 60),
    active_decode_blocks=st.integers(0, 9000),
    waiting_reqs=st.none() | st.integers(0, 30),
    running_reqs=st.none() | st.integers(0, 30),
    kv_usage=st.none() | st.floats(0, 1),
    stats_age_s=st.none() | st.floats(0, 10),
    capacity_blocks=st.none() | st.floats(1, 5000),
)
weights = st.builds(
    PolicyWeights,
    prefill_weight=st.sampled_from([0.0, 1.0, 2.5]),
    overlap_credit=st.sampled_from([0.0, 1.0, 2.0]),
    duplication_weight=st.sampled_from([0.0, 1.0]),
    interference_weight=st.sampled_from([0.0, 0.04, 0.5]),
    admission_weight=st.sampled_from([0.0, 1.0]),
    root_weight=st.sampled_from([0.0, 0.5, 1.0]),
    root_cap_prompts=st.sampled_from([0.0, 1.0, 8.0]),
    eviction_risk_weight=st.sampled_from([0.0, 1.0]),
    decode_weight=st.sampled_from([0.0, 0.1]),
    queue_weight=st.sampled_from([0.0, 3.0]),
    temperature=st.sampled_from([0.0, 0.7]),
    kv_usage_ceiling=st.none() | st.sampled_from([0.5, 0.9]),
    imbalance_threshold_blocks=st.none() | st.sampled_from([5.0, 100.0]),
)


@settings(max_examples=examples(300), deadline=None)
@given(
    load=loads,
    overlap=st.integers(0, 600),
    request_blocks=st.integers(0, 600),
    w=weights,
    credit=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    excluded=st.none() | st.just("kv_usage>=0.9"),
    speculative=st.integers(0, 600),
    pressure=st.none() | st.floats(0, 1),
    held_roots=st.none() | st.integers(0, 40),
    fewest_roots=st.none() | st.integers(0, 40),
)
def test_cost_terms_match_the_keyword_model(
    load: ReplicaLoad,
    overlap: int,
    request_blocks: int,
    w: PolicyWeights,
    credit: float,
    excluded: str | None,
    speculative: int,
    pressure: float | None,
    held_roots: int | None,
    fewest_roots: int | None,
) -> None:
    args = (load, overlap, request_blocks, w)
    kwargs = {
        "credit": credit,
        "excluded": excluded,
        "speculative": speculative,
        "pressure": pressure,
        "held_roots": held_roots,
        "fewest_roots": fewest_roots,
    }
    got, want = cost_terms(*args, **kwargs), reference_terms(*args, **kwargs)  # type: ignore[arg-type]
    assert repr(got) == repr(want)  # every field, in its own type (1 and 1.0 told apart)


@settings(max_examples=examples(200), deadline=None)
@given(
    per_replica=st.lists(loads, min_size=4, max_size=4),
    overlaps=st.lists(st.integers(-5, 700), min_size=4, max_size=4),
    held=st.lists(st.none() | st.integers(0, 6000), min_size=4, max_size=4),
    roots=st.lists(st.none() | st.integers(0, 12), min_size=4, max_size=4),
    request_blocks=st.integers(0, 600),
    w=weights,
    seed=st.integers(0, 3),
)
def test_the_policy_terms_match_the_model(
    per_replica: list[ReplicaLoad],
    overlaps: list[int],
    held: list[int | None],
    roots: list[int | None],
    request_blocks: int,
    w: PolicyWeights,
    seed: int,
) -> None:
    """Each term of a decision is the model's, with the overlap clamped to 0..request blocks."""
    replicas = {r: dataclasses.replace(x, replica=r) for r, x in zip(REPLICAS, per_replica, strict=True)}
    snapshot = LoadSnapshot(now=0.0, block_size_tokens=16, replicas=replicas)
    overlap = Overlap(
        dict(zip(REPLICAS, overlaps, strict=True)),
        {},
        request_blocks,
        {REPLICAS[0]: 3},
        {r: h for r, h in zip(REPLICAS, held, strict=True) if h is not None},
        {r: n for r, n in zip(REPLICAS, roots, strict=True) if n is not None},
    )
    request = RouteRequest(
        candidates=tuple(REPLICAS), request_blocks=request_blocks, prompt_tokens=16 * request_blocks
    )
    decision = CostPolicy()(request, overlap, snapshot, w, random.Random(seed))
    on = w.root_weight > 0
    eligible = [t.replica for t in decision.terms if t.excluded is None]
    known = [overlap.held_roots[r] for r in eligible if r in overlap.held_roots]
    fewest = min(known) if on and known else None
    for terms in decision.terms:
        r = terms.replica
        clamped = overlap_blocks(overlap, r, request_blocks)
        assert terms.overlap_blocks == clamped
        want = reference_terms(
            replicas[r],
            clamped,
            request_blocks,
            w,
            credit=terms.overlap_credit,  # type: ignore[arg-type]
            excluded=terms.excluded,
            speculative=min(overlap.speculative_blocks.get(r, 0), request_blocks),
            pressure=cache_pressure(overlap.held_blocks.get(r), replicas[r].capacity_blocks),
            held_roots=overlap.held_roots.get(r) if on else None,
            fewest_roots=fewest,
        )
        if terms.probability is not None:  # sampling fills it in after the terms are made
            want = dataclasses.replace(want, probability=terms.probability)
        assert repr(terms) == repr(want)
