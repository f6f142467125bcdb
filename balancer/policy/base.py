"""The routing-policy seam (pure): weights, the request view, the ``Policy`` protocol.

A policy is a pure function of ``(request, overlap, load, weights, rng)`` that returns a
:class:`~balancer.types.Decision`. It does no I/O, reads no clock, takes randomness only from the
``random.Random`` it is given, and never reserves load or touches the index: the router commits a
decision (``LoadTracker.reserve``, speculative index entries) after the policy returns.

State: every policy is stateless. What a decision depends on beyond the request, the index and
the load (the credit ramp's average, ``round_robin``'s rotation) the router keeps and passes in
:class:`RouteRequest`, advancing it when it commits a decision, so a dry run changes nothing. The
registry (:mod:`balancer.policy.registry`) maps a name to a *factory* all the same: each router
builds its own instance, and nothing is shared at module level. This module
imports no implementation; the implementations import it.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from balancer.errors import ConfigError
from balancer.frozen import quick_init
from balancer.load.tracker import LoadSnapshot
from balancer.types import Decision, Overlap, ReplicaId


@dataclass(frozen=True, slots=True)
class PolicyWeights:
    """The runtime-tunable knobs of every policy (``/admin/policy``, Redis pub/sub).

    Construction validates (so an instance is always valid); :meth:`replace` returns a validated
    copy. Cost fields are in **blocks**; defaults follow Dynamo's KV router (credit 1, temperature 0)
    where kvlb has no measured reason to differ, kvlb's own measurements elsewhere (decode weight,
    the charges, the load ramp of the credit), and SGLang Model Gateway's CLI defaults for the
    threshold policy. ``ramp_memory_s=None`` gives the defaults before 2026-11-30
    (docs/policy-studies.md "Part 33"), ``overlap_credit_loaded=None, root_weight=0`` those before
    2026-11-29 ("Part 24"; the ramp's memory is only read while the credit ramps).
    """

    prefill_weight: float = 1.0
    """``w_prefill``, cost per block of prefill (queued on the replica plus this request's uncached
    blocks); 0..1000 (the bound keeps every cost finite). 0 makes the cost ignore prefill work and
    with it cache affinity; large values make the policy chase cache hits and short prefill queues
    over decode load."""
    overlap_credit: float = 1.0
    """``credit``, the blocks subtracted per cached block from this request's prefill; 0..4.
    1 means a cached block costs nothing to prefill (Dynamo's default); 0 ignores the cache, so the
    cost policy becomes pure load balancing. Above 1 a replica lacking the prefix is charged
    ``credit − 1`` blocks more per block it would have to copy: a duplication penalty that keeps a
    shared context on one replica (and the fleet's caches from holding it twice) until the load gap
    exceeds ``credit ×`` its size. 4 at most, beyond which affinity ignores any realistic backlog."""
    overlap_credit_loaded: float | None = 4.0
    """The overlap credit when the fleet is busy; 0..4, or ``None``: off, the credit is
    ``overlap_credit`` at any load (as with a value equal to ``overlap_credit``, or with
    ``overlap_credit`` 0, which keeps the cache ignored at any load). The cost policy's credit per
    decision moves linearly from ``overlap_credit`` while at most three quarters of the eligible
    replicas have prefill in flight to this value when all of them do
    (:func:`~balancer.policy.cost.loaded_credit`). Default 4 (since 2026-11-29, before that
    ``None``): an idle fleet spreads new contexts as credit 1 does, a busy one keeps shared contexts
    on the replicas holding them instead of copying them. With ``root_weight`` 1 it is the best
    setting measured in the simulator (20 ms hop, the fixed index): ``tenants`` 44.1 / 46.4 / 50.0
    req/s on seeds 0–2 against the previous default's 31.7 / 32.5 / 44.1 (1.50 / 1.70 / 1.62 × the
    best peer), ``agent`` +11–19%, ``rag`` +3%, the rest equal (docs/policy-studies.md "Part 16", "Part
    20", "Part 22"); on the emulated fleet ``tenants`` reached at least 0.93 of its simulated
    capacity on each seed.
    Known costs: before the index fix the fleet showed ``tenants`` past capacity with a TTFT p90
    1.1–2.0× and ``agent`` at half load an e2e p90 +8–11% ("Part 6"); "Part 23" re-measures them.
    ``None`` (with ``root_weight`` 0) restores the previous default exactly ("Part 24")."""
    ramp_memory_s: float | None = 0.2
    """The memory of the credit's ramp, in seconds: the cost policy's credit reads an exponential
    average in time, with this time constant τ, of the share of eligible replicas with prefill in
    flight, instead of that decision's share alone; 0..60 s, or ``None``. At each committed decision
    ``average += α · (held − average)`` with ``α = 1 − exp(−Δt / τ)``, ``Δt`` the seconds since
    the previous committed decision and ``held`` the share that decision saw, held over ``Δt``
    (the first decision starts it at its own share; a negative ``Δt`` counts as 0;
    :func:`~balancer.policy.cost.time_averaged_share` says why the previous share and not this
    one's). ``None`` or 0 is off: the instant share, the default before 2026-11-30. Unlike a count
    of decisions, the span does not shrink as the request rate or the pool grows. The average is
    kept by the routing shell per pool and process (each worker of ``kvlb serve --workers N`` and
    each kvlb of a Redis fleet averages its own decisions, in the same seconds); only read while the
    credit ramps (``overlap_credit_loaded`` set). Default 0.2 s (since 2026-11-30,
    docs/policy-studies.md "Part 33"): in the simulator 0.2–0.3 s removed the ramp's e2e p50
    cost on ``agent`` at half load and cut its e2e p50 at 65% of capacity to 0.72–0.76 × the
    constant credit's on 8 replicas and 0.61–0.71 × on 16 and 32, keeping every capacity
    measured; 0.4 s and above lost ``tenants`` capacity (seed 0: 44.1 → 31.7 req/s at 0.5 s), so
    0.2 is half of that cliff ("Part 30"). On the emulated fleet it matched the instant share on
    ``tenants``, was at or below it on ``agent`` at half load (e2e p50 median 0.96 ×, within the
    noise) and gave 0.87–0.95 × its e2e p50 on ``agent`` at 65% of capacity. ``None`` restores
    the previous default decision for decision."""
    duplication_weight: float = 1.0
    """``w_dup``, blocks charged per block this request would insert into the replica's cache (its
    uncached prompt), scaled by the replica's cache pressure (0 while its cache has room, 1 once it
    is nearly full: then every inserted block evicts a block someone else may reuse); 0..4. 0 turns
    the charge off. At 1, between full replicas a copy of a prefix another one holds costs twice its
    prefill (a full replica must be ``2 ×`` the prefix behind the holder before it takes a copy),
    and a new context goes to a replica with room rather than evict a reused one. Needs the pool
    size from the metrics scrape; without it the pressure is 0."""
    interference_weight: float = 0.04
    """``w_int``, blocks charged per block this request would insert into the replica's cache (its
    uncached prompt there), per request decoding on that replica; 0..1 (at 1 a block inserted on a
    replica with 1,000 decoding requests costs 1,000 blocks: far past any useful value). Engines
    chunk prefill into the same forward steps as the running batch's decode, so every prefilled
    block delays each decoding request there by its prefill time: with ``B`` requests decoding, a
    copy of a session's history is paid ``B`` times over in inter-token latency, and near capacity
    that extra work is what fills the fleet. The charge makes the effective credit of a replica
    about ``1 + w_int · B`` (copies and new contexts cost more where the decode batch is large), so
    an idle fleet still spreads work as credit 1 does and a busy one keeps sessions where their
    history is. Default 0.04: the smallest value with which the simulated ``chat`` capacity matched
    SGLang's ``cache_aware`` rule (docs/policy-studies.md, "Part 7"); 0 turns it off."""
    admission_weight: float = 0.0
    """``w_adm``, blocks charged per KV block a replica would have to free before it could admit
    this request, on replicas that hold none of its prompt (a new or copied context there); 0..4.
    The shortfall is the blocks its running requests lock (scraped ``kv_usage`` × pool size) plus
    the uncached prefill queued there plus this request's blocks, less the pool size. A replica
    whose in-flight requests span more contexts than its pool holds at once stalls its own queue
    (``tenants`` in the simulator: 20 requests waiting behind a pool 95% locked while its
    router-tracked prefill backlog was 480 blocks above the others'); a copy sent there makes it
    worse. Followers on a replica that holds their context are not charged, so the charge does not
    push them into copies. 0 (default) turns it off; 1 raised the simulated ``tenants`` capacity
    on seed 1 only, put ``unique`` seed 2 one bracketing step below the default, and raised no
    ``tenants`` capacity on the emulated fleet (docs/policy-studies.md, "Part 9"). Needs the scraped KV
    usage and pool size; the charge is 0 without them."""
    root_weight: float = 1.0
    """``w_root``, the held-roots charge: prompts' worth of prefill charged per distinct prompt root
    (first block of a prompt chain) a replica's caches hold beyond the fewest any eligible candidate
    holds, on replicas holding none of this request's prompt; 0..4 (capped by
    ``root_cap_prompts``). A context that no replica holds (a first touch, or one every copy of which
    was evicted) otherwise goes to the replica cheapest by backlog whatever it already homes, and a
    replica homing one context more than its pool holds at once evicts its own tenants' contexts
    (``tenants`` in the simulator: the replica homing most contexts is the hottest in 6 of 9 runs,
    docs/policy-studies.md "Part 15"). Roots come from the index (speculative entries included), read
    only while this is above 0 (the table keeps per-replica counts as keys come and go: about
    0.7 µs per decision at any number of roots, docs/prefix-index.md). Default 1 (since
    2026-11-29, before that 0), meant with the ramp
    (``overlap_credit_loaded`` 4): together they passed 59 of 66 simulated ``tenants`` grid points
    (the ramp alone 47, the previous default 34) and gave ``tenants`` 1.50 / 1.70 / 1.62 × the best
    peer's capacity on seeds 0–2 with the fixed index and at least 40.8 / 47.6 / 50.0 req/s on the
    emulated fleet (0.93–1.0 of the simulated), with ``rag``, the Mooncake trace and ``unique``
    kept ("Part 16", "Part 22"). Without the ramp it lost ``tenants`` seed 0 (36.0 → 34.2
    req/s, "Part 16"); where every prompt starts with a block all replicas hold (a shared system or
    tool prompt) it never applies. 0 turns it off (with ``overlap_credit_loaded`` ``None`` the
    previous default, "Part 24")."""
    root_cap_prompts: float = 1.0
    """The held-roots charge's cap, in prompts' worth of prefill (``× request_blocks``); 0..8.
    ``root_weight · (held_roots − fewest)`` is clamped to it, so a replica holding many more roots
    pays at most this many prompts of backlog. Without the cap the charge overrides load where most
    prompts are new roots: on the simulated Mooncake trace capacity fell from 29.5 to 2.7 req/s
    (docs/policy-studies.md "Part 15"); at 1 it kept the whole ``tenants`` gain and lost nothing
    elsewhere. Only read while ``root_weight`` is above 0."""
    eviction_risk_weight: float = 0.0
    """``w_risk``, how much of a replica's overlap the cost policy doubts because the prompts queued
    ahead of this request there may evict it before the engine admits the request (engines match a
    prompt against their cache at admission, and evict LRU); 0..4. The credited overlap is
    ``survival_r × overlap_r`` with ``survival_r = 1 − min(1, w_risk · pressure_r · pending_r /
    pool_r)``: the share of the pool that the queued uncached prefill will write, on a cache full
    enough to evict. 0 (default) trusts the index's overlap as is; at 1 a full replica whose queued
    prefill equals its whole pool gets no credit. Needs the pool size from the metrics scrape (no
    doubt without it). Evaluated in docs/policy-studies.md ("Part 4"): it lowered capacity on ``tenants``,
    so it is not a default."""
    decode_weight: float = 0.1
    """``w_decode``, cost per KV block held by requests decoding on the replica; 0..1000. 0 ignores decode
    load (only prefill backlog and affinity count). Default 0.1, not Dynamo's 1.0: a decoding
    sequence of P prompt blocks then weighs as much as a full cache miss of P blocks, so affinity
    loses to any decode load; see docs/policies.md for the sweep that chose 0.1."""
    queue_weight: float = 0.0
    """``w_queue``, cost in blocks per request waiting in the engine's queue (scraped); 0..1e6
    blocks (a prompt of a million tokens in blocks of one). 0
    (default, as Dynamo) ignores the scraped queue; set it near the mean prompt length in blocks when
    several balancers share replicas, because the router-tracked counts only see this balancer."""
    temperature: float = 0.0
    """Softmax temperature over range-normalised costs; 0..1e6. 0 picks the lowest cost (ties broken at
    random). At 1 a replica at the far end of the cost range is e≈2.7 times less likely than the
    best; large values approach a uniform choice among eligible replicas."""
    kv_usage_ceiling: float | None = None
    """Replicas whose scraped KV usage (0..1) is ≥ this are excluded, unless every candidate is; in
    (0, 1]. 1 excludes only replicas reporting a full cache; ``None`` (default) disables the guard.
    Replicas with unknown or stale usage are never excluded. Off by default: under load a prefix's
    home replica is often full of running requests, and excluding it sends its followers to cold
    replicas, which copy the context and evict others' (see docs/policies.md)."""
    imbalance_threshold_blocks: float | None = None
    """Imbalance guard of the cost policy: a replica whose load (the cost without this request's
    terms) exceeds the least loaded eligible replica's by more than this many blocks gets no overlap
    credit, so cache affinity cannot pile more work onto it; in (0, 1e9] blocks. Small values make
    the policy behave like least-load under any imbalance; ``None`` (default, as Dynamo) disables
    the guard."""
    cache_threshold: float = 0.3
    """``sglang_threshold``: route to the best prefix match only if its match ratio
    (overlap/request blocks) is above this; 0..1. 0 sends every request with any overlap to its best
    match (SMG's KV-event mode); 1 never routes on the cache."""
    balance_abs_threshold: float = 64.0
    """``sglang_threshold``: the fleet is imbalanced when max − min request load exceeds this (and the
    relative test holds), and then the least loaded replica is chosen; 0..1e6 requests. 0 makes any
    difference count."""
    balance_rel_threshold: float = 1.5
    """``sglang_threshold``: the fleet is imbalanced only if max load > this × min load too; 1..1e6.
    1 reduces the rule to the absolute test (when min load > 0)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field that is mistyped or out of range
        (every field has a finite range, :data:`WEIGHT_RANGES`, so every cost stays finite)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            optional = f.name in _OPTIONAL_FIELDS
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"policy.{f.name} must be a finite number, got {value!r}")
            weight_range = WEIGHT_RANGES[f.name]
            if not weight_range.contains(value):
                null = " or null" if optional else ""
                raise ConfigError(f"policy.{f.name} must be in {weight_range}{null}, got {value}")

    def replace(self, **changes: Any) -> PolicyWeights:
        """A validated copy with ``changes`` applied; unknown names raise :class:`ConfigError`."""
        unknown = sorted(set(changes) - _FIELD_NAMES)
        if unknown:
            raise ConfigError(f"unknown policy weight(s): {', '.join(unknown)}")
        coerced = {name: _as_float(name, value) for name, value in changes.items()}
        return dataclasses.replace(self, **coerced)

    def to_dict(self) -> dict[str, float | None]:
        """Plain JSON-able mapping of every field (``None`` → ``null``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base: PolicyWeights | None = None) -> PolicyWeights:
        """Weights from a (possibly partial) mapping laid over ``base`` (defaults when ``None``)."""
        return (base if base is not None else cls()).replace(**dict(data))


@dataclass(frozen=True, slots=True)
class WeightRange:
    """The closed range ``[low, high]`` of one weight (``(low, high]`` when ``low_open``)."""

    low: float
    high: float
    low_open: bool = False

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def __str__(self) -> str:
        opening = "(" if self.low_open else "["
        return f"{opening}{_number(self.low)}, {_number(self.high)}]"


def _number(value: float) -> str:
    """``1000000`` rather than ``1e+06`` (as a client would type it in JSON)."""
    return str(int(value)) if value.is_integer() else repr(value)


WEIGHT_RANGES: Mapping[str, WeightRange] = MappingProxyType(
    {
        "prefill_weight": WeightRange(0.0, 1e3),
        "overlap_credit": WeightRange(0.0, 4.0),
        "overlap_credit_loaded": WeightRange(0.0, 4.0),
        "ramp_memory_s": WeightRange(0.0, 60.0),
        "duplication_weight": WeightRange(0.0, 4.0),
        "eviction_risk_weight": WeightRange(0.0, 4.0),
        "interference_weight": WeightRange(0.0, 1.0),
        "admission_weight": WeightRange(0.0, 4.0),
        "root_weight": WeightRange(0.0, 4.0),
        "root_cap_prompts": WeightRange(0.0, 8.0),
        "decode_weight": WeightRange(0.0, 1e3),
        "queue_weight": WeightRange(0.0, 1e6),
        "temperature": WeightRange(0.0, 1e6),
        "kv_usage_ceiling": WeightRange(0.0, 1.0, low_open=True),
        "imbalance_threshold_blocks": WeightRange(0.0, 1e9, low_open=True),
        "cache_threshold": WeightRange(0.0, 1.0),
        "balance_abs_threshold": WeightRange(0.0, 1e6),
        "balance_rel_threshold": WeightRange(1.0, 1e6),
    }
)
"""Every weight's range (docs/policies.md): a value outside it is refused wherever weights come
from (config file, ``/admin/policy``, gRPC admin, ``x-kvlb-weights``, the Redis-shared policy), all
through :meth:`PolicyWeights.validate`. The upper bounds are far above any useful value; they keep
every cost term finite (at most about 1e3 × the blocks of a prompt and a backlog)."""

OPTIONAL_WEIGHTS = frozenset(
    {
        "overlap_credit_loaded",
        "ramp_memory_s",
        "kv_usage_ceiling",
        "imbalance_threshold_blocks",
    }
)
"""The weights that may be ``None`` (their guard or ramp off)."""
_OPTIONAL_FIELDS = OPTIONAL_WEIGHTS
_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(PolicyWeights))


def _as_float(name: str, value: Any) -> Any:
    """Integers become floats so weights compare and serialise alike; anything else is left for
    :meth:`PolicyWeights.validate` to judge. An integer too large for a float (JSON's ``1`` and 400
    zeros) is out of every weight's range: :class:`ConfigError` naming the field and its range
    (``float()`` and ``math.isfinite`` raise ``OverflowError`` on it, and ``str()`` a ``ValueError``
    past 4,300 digits, so it is described by its size in bits)."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(
                f"policy.{name} must be in {WEIGHT_RANGES[name]}, got an integer of {value.bit_length()} bits"
            ) from None
    return value


@quick_init
@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy needs to know about one request.

    ``candidates`` are the replicas the router allows (healthy, same pool), in a stable order;
    duplicates are ignored. ``request_blocks`` is the number of full blocks of the prompt (what the
    index was asked to match); ``prompt_tokens`` the prompt length in tokens.
    """

    candidates: tuple[ReplicaId, ...]
    request_blocks: int
    prompt_tokens: int
    session_key: str | None = None
    """Sticky-routing key (a header or the OpenAI ``user`` field), used by ``session``."""
    request_id: str | None = None
    """For logs only; no policy routes on it."""
    ramp_share: float | None = None
    """The average share of replicas prefilling over the router's earlier committed decisions (the
    credit ramp's memory, ``PolicyWeights.ramp_memory_s``); ``None`` before the first one.
    An input like the others: the decision ring keeps it, so a what-if replays the average as
    the router had it."""
    ramp_at_s: float | None = None
    """When the router last advanced :attr:`ramp_share`: the time of the committed decision that
    stored it (its load snapshot's ``now``, monotonic seconds); ``None`` before the first one. The
    policy advances the average from it to this decision's ``LoadSnapshot.now``."""
    ramp_last_share: float | None = None
    """The busy share the decision that stored :attr:`ramp_share` saw (``Decision.busy_share``):
    the sample the policy holds over the time since then; ``None`` before the first one."""
    rotation: int = 0
    """The router's committed decisions so far: ``round_robin`` takes ``candidates[rotation mod
    n]``. The router counts it at commitment, so a dry run (``POST /admin/explain``, gRPC ``Route``
    without ``reserve``) shows the choice the next request gets and moves nothing."""
    prefix_marks: tuple[tuple[int, int], ...] = ()
    """For the what-if only (no policy routes on it): ``(reference blocks, block key)`` pairs of the
    prompt's chained block keys at a bounded set of prefix lengths
    (:func:`balancer.index.marks.prefix_marks`), so that a replay can follow the cache its
    own decisions would have built. Empty when unknown (no key space among the candidates)."""


@quick_init
@dataclass(frozen=True, slots=True)
class PolicyInputs:
    """Everything a policy call read besides the weights and the rng: kept with a committed
    decision (the console's decision ring) so that the policy can be re-run on it (what-if)."""

    request: RouteRequest
    overlap: Overlap
    load: LoadSnapshot


class Policy(Protocol):
    """A routing policy: pure and side-effect free (calling it twice on the same inputs decides the
    same, but for draws from ``rng``).

    Raises :class:`~balancer.errors.NoReplicasAvailable` when ``request.candidates`` is empty.
    """

    @property
    def name(self) -> str:
        """The registry name, reported in ``Decision.policy``."""
        ...

    def __call__(
        self,
        request: RouteRequest,
        overlap: Overlap,
        load: LoadSnapshot,
        weights: PolicyWeights,
        rng: random.Random,
    ) -> Decision: ...
