"""The default routing policy: a cost in KV blocks, trading cache affinity against load (pure).

For each candidate replica ``r`` (lower is better)::

    cost_r = w_prefill · (pending_prefill_blocks_r − shared_r + request_blocks − credit_r · overlap_r)
           + w_prefill · w_dup · pressure_r · inserted_r
           + w_prefill · w_int · decoding_r · inserted_r
           + w_prefill · w_adm · shortfall_r
           + w_prefill · min(cap, w_root · (roots_r − fewest_roots)) · request_blocks
           + w_decode  · active_decode_blocks_r
           + w_queue   · waiting_r

* ``pending_prefill_blocks_r``: uncached prompt tokens of requests this balancer routed to ``r``
  that have not produced a first token yet, divided by the block size (router-tracked).
* ``request_blocks``: full blocks of this request's prompt; ``overlap_r`` the leading ones ``r``
  already holds (clamped to ``request_blocks``), so with a credit of at most 1 the prefill term is
  never negative (above 1 a holder's can be: only differences between replicas count).
* ``active_decode_blocks_r``: KV blocks of requests decoding on ``r`` (router-tracked).
* ``waiting_r``: the engine's scraped queue length, 0 when unknown or stale.
* ``credit_r`` = the decision's credit, or 0 when the imbalance guard withdraws it (below). Above 1
  it adds a duplication penalty: a replica without the prefix pays ``credit − 1`` extra per missing
  block. The decision's credit is ``overlap_credit`` while at most three quarters of the eligible
  replicas have prefill in flight (:func:`busy_share`), rising linearly to ``overlap_credit_loaded``
  when all of them do (:func:`loaded_credit`; ``None`` keeps it constant). An idle fleet thus
  spreads new contexts (a constant credit 2 gathered tool-use loops on the replicas holding their
  shared prompt and made them slower at half load), and a busy one keeps shared contexts where
  they are instead of copying them (docs/policy-studies.md, "Part 6"). The share of replicas prefilling
  estimates the fleet's prefill utilisation with no scale to configure. With ``ramp_memory_s`` τ
  (0.2 s by default since 2026-11-30, off before) the ramp reads that share averaged in time
  instead (:class:`ShareAverage`, ``α = 1 − exp(−Δt/τ)`` per committed decision, Δt from the
  previous one, holding the previous decision's share over Δt): the router keeps the average, the
  time it was advanced and the share that decision saw and passes them in
  (``RouteRequest.ramp_share``, ``ramp_at_s``, ``ramp_last_share``; the decision's time is its
  load snapshot's ``now``), the decision returns
  the advanced average and its own share (``Decision.ramp_share``, ``busy_share``), which the
  router stores with that time.
* ``shared_r`` = ``min(pending_prefill_blocks_r, min(credit_r, 1) · speculative_r)``, where
  ``speculative_r`` is the part of the overlap backed only by speculative entries: blocks that a
  request routed to ``r`` moments ago is still prefilling. That pending work produces exactly the
  blocks this request will reuse, so it is shared, not competing. Without this term a burst of
  same-prefix requests arriving before the first KV event would scatter over the fleet (each
  follower sees the leader's prefill as load), which is the case speculative entries exist for.
* ``inserted_r`` = ``request_blocks − overlap_r``: the blocks ``r`` would compute and add to its
  cache (all of them when ``r`` gets no credit: a replica without credit is treated as holding
  nothing).
* ``decoding_r``: requests decoding on ``r`` (router-tracked ``active_decode_seqs``). The
  interference charge (``w_int`` = ``interference_weight``, default 0.04) prices what an insertion
  costs the requests already running there: engines chunk prefill into the forward steps of the
  running batch, so each inserted block delays every decoding request on ``r`` by its prefill time.
  The prefill term counts only this request's own wait (the queue ahead plus its uncached blocks),
  so with credit 1 a session leaves the replica holding its history whenever that replica's queued
  prefill exceeds the history, even when the queue drains in milliseconds and the copy is paid by a
  full decode batch (``chat`` in the simulator: a third of later turns moved at 92% of capacity,
  docs/policy-studies.md "Part 7"). With the charge a replica's effective credit is about ``1 + w_int ·
  decoding_r``: an idle replica is priced as before, a busy one keeps its sessions.
* ``shortfall_r`` (:func:`admission_shortfall_blocks`, only where ``overlap_r`` is 0, and only with
  ``w_adm`` = ``admission_weight`` > 0, off by default): the KV blocks ``r`` would have to free
  before admitting the request, ``kv_usage_r · pool_r + pending_prefill_blocks_r + inserted_r −
  pool_r`` (at least 0). A replica whose in-flight requests span more contexts than its pool holds
  at once stalls its own queue on KV admission, which its prefill backlog does not show; a new or
  copied context sent there deepens the stall. A replica holding part of the prompt is not charged,
  so followers are not pushed into copies (docs/policy-studies.md, "Part 9").
* ``roots_r`` (only where ``overlap_r`` is 0, and only with ``w_root`` = ``root_weight`` > 0, 1
  by default; ``cap`` = ``root_cap_prompts``): the distinct prompt roots (first blocks of prompt
  chains) ``r``'s caches hold, speculative entries included (``Overlap.held_roots``, from the
  index); ``fewest_roots`` the least of them among the eligible candidates whose count is known. A
  prompt that no replica holds (a first touch, or a context every copy of which was evicted) would
  otherwise go to the replica cheapest by backlog whatever it already homes; a replica homing more
  contexts than its pool holds at once then evicts its own tenants' contexts (docs/policy-studies.md,
  "Part 15"). The cap keeps the charge from overriding load where most prompts are new roots (the
  Mooncake trace). A replica whose count is unknown is not charged.
* With ``eviction_risk_weight`` ``w_risk`` > 0 (off by default), ``overlap_r`` in the two lines above
  is the credited overlap ``survival_r × overlap_r``, ``survival_r`` = ``1 − min(1, w_risk ·
  pressure_r · (pending_prefill_blocks_r − shared_r) / pool_blocks_r)`` (:func:`overlap_survival`):
  engines match a prompt against their cache when they admit it, and the uncached prefill queued
  ahead writes that share of a full pool first, evicting LRU. docs/policy-studies.md ("Part 4")
  has its evaluation; it did not become a default.
* ``pressure_r`` (:func:`cache_pressure`): 0 while ``r``'s cache is at most a quarter full, rising
  to 1 at three quarters (held blocks from the index over the pool size from the metrics scrape; 0
  when either is unknown). The charge prices what an insertion evicts: on a replica with room a
  block costs only its prefill, on a full one every inserted block pushes out a block another
  request may reuse. Between equally full replicas it adds the same ``w_dup`` per missing block to
  every candidate, so a replica lacking a prefix that another one holds pays ``w_dup`` more per
  block it would copy: a context copied to several full replicas would crowd the others' contexts
  out of the fleet, so tenants whose contexts overflow the fleet's caches stay on their replica
  (hit rate of the llm-d-shaped ``tenants`` run 0.51 → 0.72 in the simulator). Between replicas
  of different fill it sends new contexts to the one with room, rather than to a full one where
  they evict a context its own requests are about to reuse (the hot spots of docs/loadtest-history.md).
  Workloads that fill the caches slowly (``agent``, ``chat``) still spread while the fleet is
  empty (docs/policies.md). The ramp starts early because copies made while the caches fill are
  the ones that overflow them later (copied-blocks charge, 0.3 s of event lag: a 0.5 → 0.9 ramp
  gave TTFT p90 1.98 s, 0.25 → 0.75 gave 1.52 s).

Defaults (Dynamo's KV router): ``w_prefill`` = 1, ``overlap_credit`` = 1, ``w_queue`` = 0,
``temperature`` = 0; kvlb's own: ``w_decode`` = 0.1, ``w_dup`` = 1, ``w_int`` = 0.04, ``w_adm`` = 0 (off),
``overlap_credit_loaded`` = 4 and ``w_root`` = 1 (since 2026-11-29; ``None`` and 0 before, which
restore that policy: docs/policy-studies.md "Part 24"); the guards ``kv_usage_ceiling`` and
``imbalance_threshold_blocks`` off.

Guards, applied before choosing:

1. **KV-usage ceiling**: a replica whose fresh scraped KV usage is ≥ ``kv_usage_ceiling`` is excluded
   (``excluded="kv_usage>=…"``), unless that would exclude every candidate, in which case nobody is.
2. **Imbalance**: let ``load_r`` be the cost without this request's terms
   (``w_prefill·pending + w_decode·decode + w_queue·waiting``). A replica whose ``load_r`` exceeds the
   least loaded eligible replica's by more than ``imbalance_threshold_blocks`` loses its overlap
   credit. Withdrawing the credit only from the overloaded replicas (rather than ignoring affinity
   everywhere) keeps affinity between the others, while the cache can no longer pull work onto a
   replica that is already far behind.

Choice: ``temperature`` 0 takes the lowest cost, ties broken uniformly with ``rng``. ``temperature``
T > 0 samples with ``p_r ∝ exp(−z_r / T)``, ``z_r = (cost_r − min) / (max − min)`` over eligible
replicas (all equal when the range is 0), so T is independent of the cost's scale.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.policy.base import PolicyWeights, RouteRequest
from balancer.policy.common import candidates_of, decide, overlap_blocks, pick_min, tie_note
from balancer.types import CostTerms, Decision, Overlap, ReplicaId

PRESSURE_START_FILL = 0.25
"""Cache fill (held / capacity blocks) below which copying a prefix is free of the duplication charge."""
PRESSURE_FULL_FILL = 0.75
"""Cache fill from which the duplication charge applies in full."""
BUSY_START_SHARE = 0.75
"""Share of eligible replicas with prefill in flight up to which the credit is ``overlap_credit``."""
BUSY_FULL_SHARE = 1.0
"""Share from which the credit is ``overlap_credit_loaded`` (every eligible replica prefilling)."""


class CostPolicy:
    """The block-cost policy described in the module docstring. Stateless."""

    name = "cost"

    def __call__(
        self,
        request: RouteRequest,
        overlap: Overlap,
        load: LoadSnapshot,
        weights: PolicyWeights,
        rng: random.Random,
    ) -> Decision:
        candidates = candidates_of(request)
        of = load.of
        loads = {replica: of(replica) for replica in candidates}
        excluded, notes = kv_guard(loads, weights.kv_usage_ceiling)
        eligible = [r for r in candidates if r not in excluded] if excluded else candidates
        no_credit: Collection[ReplicaId] = ()
        if weights.imbalance_threshold_blocks is not None:
            no_credit = imbalance_guard(
                {r: base_load(loads[r], weights) for r in eligible}, weights.imbalance_threshold_blocks
            )
        if no_credit:
            notes.append(f"no overlap credit for {','.join(no_credit)} (imbalance)")
        credit = weights.overlap_credit
        averaged: float | None = None
        seen: float | None = None
        if credit_ramps(weights) and weights.overlap_credit_loaded is not None:
            busy, share = busy_share([loads[r] for r in eligible])
            why = f"{busy}/{len(eligible)} replicas prefilling"
            if weights.ramp_memory_s:
                seen = share
                prior = ShareAverage(request.ramp_share, request.ramp_at_s, request.ramp_last_share)
                share = averaged = averaged_in_time(prior, seen, load.now, weights.ramp_memory_s)
                why += f", averaged {averaged:.2f} over {weights.ramp_memory_s:g} s"
            credit = loaded_credit(weights.overlap_credit, weights.overlap_credit_loaded, share)
            notes.append(f"credit {credit:.3g} ({why})")
        blocks, held, speculative = request.request_blocks, overlap.held_blocks, overlap.speculative_blocks
        roots: dict[ReplicaId, int] = {}
        fewest_roots = None
        if weights.root_weight > 0 and overlap.held_roots:
            roots = overlap.held_roots
            fewest_roots = min((roots[r] for r in eligible if r in roots), default=None)
        terms = [
            cost_terms(
                loads[r],
                overlap_blocks(overlap, r, blocks),
                blocks,
                weights,
                credit=0.0 if no_credit and r in no_credit else credit,
                excluded=excluded.get(r) if excluded else None,
                speculative=min(speculative.get(r, 0), blocks),
                pressure=cache_pressure(held.get(r), loads[r].capacity_blocks),
                held_roots=roots.get(r) if roots else None,
                fewest_roots=fewest_roots,
            )
            for r in candidates
        ]
        chosen, terms = choose(terms, weights.temperature, rng)
        mode = "argmin" if weights.temperature == 0 else f"softmax T={weights.temperature:g}"
        if weights.temperature == 0:
            mode += tie_note([(t.replica, _cost(t)) for t in terms if t.excluded is None])
        reason = "; ".join([mode, *notes])
        return decide(self.name, chosen, request, overlap, load, terms, reason, averaged, seen)


def base_load(load: ReplicaLoad, weights: PolicyWeights) -> float:
    """The replica's cost before this request: ``w_prefill·pending + w_decode·decode + w_queue·waiting``."""
    return (
        weights.prefill_weight * load.pending_prefill_blocks
        + weights.decode_weight * load.active_decode_blocks
        + weights.queue_weight * (load.waiting_reqs or 0)
    )


def credit_ramps(weights: PolicyWeights) -> bool:
    """Whether the decision's credit depends on the fleet's load: ``overlap_credit_loaded`` set and
    different from ``overlap_credit``, and ``overlap_credit`` above 0 (credit 0 is the switch that
    turns cache affinity off, and the ramp does not turn it back on)."""
    loaded = weights.overlap_credit_loaded
    return loaded is not None and loaded != weights.overlap_credit and weights.overlap_credit > 0


def busy_share(loads: Sequence[ReplicaLoad]) -> tuple[int, float]:
    """How many of ``loads`` have prefill in flight (a request routed there and not yet at its
    first token), and their share of ``loads`` (0 when empty): the fleet's load as
    :func:`loaded_credit` sees it. Each replica prefills one batch at a time, so the share of
    replicas with prefill queued estimates the fleet's prefill utilisation."""
    busy = sum(1 for load in loads if load.pending_prefill_seqs > 0)
    return busy, busy / len(loads) if loads else 0.0


def loaded_credit(credit: float, loaded: float, share: float) -> float:
    """The overlap credit at a fleet load ``share`` (:func:`busy_share`): ``credit`` up to
    :data:`BUSY_START_SHARE`, ``loaded`` from :data:`BUSY_FULL_SHARE`, linear between."""
    ramp = (share - BUSY_START_SHARE) / (BUSY_FULL_SHARE - BUSY_START_SHARE)
    return credit + (loaded - credit) * min(1.0, max(0.0, ramp))


@dataclass(frozen=True, slots=True)
class ShareAverage:
    """The credit ramp's memory (``PolicyWeights.ramp_memory_s``): an exponential average of the
    busy share (:func:`busy_share`) in time, advanced at a router's committed decisions. A value:
    the routing shell holds one per pool, gives it to the policy with each request
    (``RouteRequest.ramp_share``, ``ramp_at_s``, ``ramp_last_share``) and keeps the decision's
    advanced value when it commits it, so planning changes nothing."""

    share: float | None = None
    """The average so far (0..1); ``None`` before the first decision."""
    at_s: float | None = None
    """When :attr:`share` was last advanced: the committed decision's time (its load snapshot's
    ``now``, the shell's monotonic seconds or the simulator's model seconds); ``None`` before."""
    last_share: float | None = None
    """The busy share that decision saw: the sample held over the time to the next decision."""

    def advanced_to(self, share: float, now_s: float, memory_s: float) -> ShareAverage:
        """The average advanced to ``now_s`` by a decision that sees ``share``
        (:func:`time_averaged_share`), stamped ``now_s`` and holding ``share`` for the next one;
        the first decision starts it at ``share``."""
        return ShareAverage(averaged_in_time(self, share, now_s, memory_s), now_s, share)


def averaged_in_time(prior: ShareAverage, share: float, now_s: float, memory_s: float) -> float:
    """``prior`` advanced to ``now_s`` (:func:`time_averaged_share` of its held share), or
    ``share``, the decision's own, when ``prior`` is empty (the first decision)."""
    if prior.share is None or prior.at_s is None or prior.last_share is None:
        return share
    return time_averaged_share(prior.share, prior.at_s, prior.last_share, now_s, memory_s)


def time_averaged_share(
    previous: float, previous_at_s: float, held_share: float, now_s: float, memory_s: float
) -> float:
    """The busy share averaged in time with time constant ``memory_s`` (τ): ``previous + α ·
    (held_share − previous)`` with ``α = 1 − exp(−Δt / τ)``, ``Δt = now_s − previous_at_s``
    clamped at 0 (a clock read out of order moves nothing); ``held_share`` when ``memory_s`` is not
    above 0 (α = 1).

    ``held_share`` is the share the *previous* decision saw, held over the gap since it: the
    router observes the share only at arrivals, and an arrival's share (seen before the gap)
    does not depend on how long the gap after it lasts, so weighting it by that gap averages the
    share in time without bias. The share *this* decision sees does depend on its gap (the longer
    the gap, the more prefills finished in it), so weighting it by the gap would lean the average
    towards an idle fleet: in the simulator that variant kept less of the memory's gain at 65% of
    ``agent``'s capacity (docs/policy-studies.md "Part 30"). The price: this decision's own share enters
    the average at the next decision, and a memory much shorter than the gaps gives the previous
    decision's share, not this one's. Arrivals at the same instant move the average by nothing
    (``Δt = 0``) however many they are; after a pause of a few τ the average is the held share."""
    if memory_s <= 0:
        return held_share
    elapsed_s = max(0.0, now_s - previous_at_s)
    alpha = -math.expm1(-elapsed_s / memory_s)
    return previous + alpha * (held_share - previous)


def kv_guard(
    loads: dict[ReplicaId, ReplicaLoad], ceiling: float | None
) -> tuple[dict[ReplicaId, str], list[str]]:
    """Replicas at or above the KV-usage ceiling → exclusion reason, plus notes for the decision.
    Nobody is excluded when the guard is off or when every candidate is at the ceiling."""
    if ceiling is None:
        return {}, []
    full = {
        replica: f"kv_usage>={ceiling:g}"
        for replica, load in loads.items()
        if load.kv_usage is not None and load.kv_usage >= ceiling
    }
    if full and len(full) == len(loads):
        return {}, [f"every candidate at kv_usage>={ceiling:g}: guard lifted"]
    return full, []


def imbalance_guard(loads: dict[ReplicaId, float], threshold_blocks: float | None) -> list[ReplicaId]:
    """Replicas whose load exceeds the minimum by more than ``threshold_blocks`` (none when off)."""
    if threshold_blocks is None or not loads:
        return []
    floor = min(loads.values())
    return [replica for replica, value in loads.items() if value - floor > threshold_blocks]


def cache_pressure(held_blocks: int | None, capacity_blocks: float | None) -> float | None:
    """How full a cache is, as the duplication charge sees it: ``fill = held / capacity`` mapped
    linearly from 0 at :data:`PRESSURE_START_FILL` to 1 at :data:`PRESSURE_FULL_FILL` (clamped);
    ``None`` when either count is unknown."""
    if held_blocks is None or capacity_blocks is None or capacity_blocks <= 0:
        return None
    fill = held_blocks / capacity_blocks
    ramp = (fill - PRESSURE_START_FILL) / (PRESSURE_FULL_FILL - PRESSURE_START_FILL)
    return min(1.0, max(0.0, ramp))


def overlap_survival(
    ahead_blocks: float, capacity_blocks: float | None, pressure: float | None, weight: float
) -> float:
    """The share of a replica's overlap the cost credits (0..1): ``1 − min(1, weight · pressure ·
    ahead / capacity)``. ``ahead_blocks``: uncached prefill queued there before this request (what
    the engine will write, and evict for, before it admits this request and matches its prompt);
    ``pressure``: its :func:`cache_pressure` (an engine with room evicts nothing). 1 when
    ``weight`` is 0 or the pool size or pressure is unknown."""
    if weight <= 0 or not pressure or capacity_blocks is None or capacity_blocks <= 0:
        return 1.0
    return 1.0 - min(1.0, weight * pressure * max(0.0, ahead_blocks) / capacity_blocks)


def admission_shortfall_blocks(load: ReplicaLoad, inserted_blocks: float | None) -> float:
    """KV blocks ``load``'s replica would have to free before it could admit a request inserting
    ``inserted_blocks``: ``kv_usage · capacity + pending_prefill + inserted − capacity``, at least 0.
    ``kv_usage · capacity`` is what its running requests lock (scraped), the pending prefill what
    the requests queued ahead will insert. 0 when ``inserted_blocks`` is ``None`` (the replica holds
    part of the prompt: the admission charge is not applied there) or the KV usage or pool size is
    unknown."""
    if inserted_blocks is None or load.kv_usage is None or not load.capacity_blocks:
        return 0.0
    locked = load.kv_usage * load.capacity_blocks
    return max(0.0, locked + load.pending_prefill_blocks + inserted_blocks - load.capacity_blocks)


def root_charge_prompts(weights: PolicyWeights, held_roots: int, fewest_roots: int | None) -> float:
    """The held-roots charge in prompts' worth of prefill: ``min(root_cap_prompts, root_weight ·
    (held_roots − fewest_roots))``, at least 0 (an excluded replica may hold fewer roots than every
    eligible one). 0 when ``fewest_roots`` is unknown."""
    if fewest_roots is None or weights.root_weight <= 0:
        return 0.0
    extra = held_roots - fewest_roots
    charge = weights.root_weight * (extra if extra > 0 else 0)  # min/max as comparisons: overlap_blocks
    cap = weights.root_cap_prompts
    return charge if charge < cap else cap


def cost_terms(
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
    """The weighted terms and their sum for one replica (computed for excluded ones too, so an
    explanation shows what they would have cost). ``pressure``: its :func:`cache_pressure`;
    ``held_roots``: the prompt roots its caches hold (``None``: unknown or the charge off),
    ``fewest_roots`` the least held by an eligible candidate (:func:`root_charge_prompts`)."""
    waiting = float(load.waiting_reqs or 0)
    pending = load.pending_prefill_blocks
    offered = (1.0 if credit > 1.0 else credit) * speculative  # min/max as comparisons: overlap_blocks
    shared = offered if offered < pending else pending
    survival = 1.0  # what overlap_survival gives with the discount off
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
    admission_term = 0.0  # with the charge off (a finite shortfall ≥ 0 times 0)
    if weights.admission_weight:
        shortfall = admission_shortfall_blocks(load, inserted if overlap == 0 else None)
        admission_term = prefill * weights.admission_weight * shortfall
    root_term = 0.0  # with the charge off, or on a replica holding part of the prompt
    if held_roots is not None and overlap == 0:
        root_term = prefill * root_charge_prompts(weights, held_roots, fewest_roots) * request_blocks
    decode_term = weights.decode_weight * load.active_decode_blocks
    queue_term = weights.queue_weight * waiting
    # left to right as before the held-roots charge (adding its 0.0 when off changes no bit)
    cost = prefill_term + duplication_term + interference_term + admission_term
    cost = cost + root_term + decode_term + queue_term
    # Positional, in CostTerms' field order (tests/unit/test_policy_cost_terms.py checks each field):
    # the same call with 20 keyword arguments takes about 0.3 µs (28%) longer, once per candidate.
    return CostTerms(
        load.replica,  # replica
        overlap,  # overlap_blocks
        request_blocks,  # request_blocks
        pending,  # pending_prefill_blocks
        float(load.active_decode_blocks),  # active_decode_blocks
        waiting,  # waiting_requests
        load.kv_usage,  # kv_usage
        prefill_term,  # prefill_term
        decode_term,  # decode_term
        queue_term,  # queue_term
        cost,  # cost
        None,  # probability
        excluded,  # excluded
        shared,  # shared_pending_blocks
        duplication_term,  # duplication_term
        interference_term,  # interference_term
        pressure,  # cache_pressure
        survival,  # overlap_survival
        credit,  # overlap_credit
        admission_term,  # admission_term
        root_term,  # root_term
        held_roots,  # held_roots
    )


def choose(
    terms: Sequence[CostTerms], temperature: float, rng: random.Random
) -> tuple[ReplicaId, list[CostTerms]]:
    """Pick among the non-excluded terms: argmin (T = 0) or softmax sampling (T > 0). Returns the
    choice and the terms, with probabilities filled in when sampling (0 for excluded replicas)."""
    scored = [(t.replica, _cost(t)) for t in terms if t.excluded is None]
    if temperature == 0:
        return pick_min(scored, rng), list(terms)
    probabilities = softmax_probabilities([cost for _, cost in scored], temperature)
    by_replica = dict(zip((r for r, _ in scored), probabilities, strict=True))
    chosen = sample([r for r, _ in scored], probabilities, rng)
    with_p = [replace(t, probability=by_replica.get(t.replica, 0.0)) for t in terms]
    return chosen, with_p


def softmax_probabilities(costs: Sequence[float], temperature: float) -> list[float]:
    """``p_i ∝ exp(−z_i/T)`` with costs min-max normalised to ``z`` in 0..1 (uniform when equal)."""
    low, high = min(costs), max(costs)
    spread = high - low
    weights = [math.exp(-((c - low) / spread if spread > 0 else 0.0) / temperature) for c in costs]
    total = sum(weights)  # ≥ 1: the cheapest replica has z = 0 and weight exp(0) = 1
    return [w / total for w in weights]


def sample(replicas: Sequence[ReplicaId], probabilities: Sequence[float], rng: random.Random) -> ReplicaId:
    """One replica drawn with the given probabilities (one ``rng.random()`` draw)."""
    point = rng.random()
    cumulative = 0.0
    for replica, p in zip(replicas, probabilities, strict=True):
        cumulative += p
        if point < cumulative:
            return replica
    return replicas[-1]  # float rounding left the sum a hair below 1


def _cost(terms: CostTerms) -> float:
    assert terms.cost is not None  # cost_terms always sets it
    return terms.cost
