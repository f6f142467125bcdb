"""The simulator's routing: the service's ``PoolRouter``, made affordable for big fleets (pure).

Every request goes through :meth:`balancer.routing.router.PoolRouter.plan` and ``commit`` — the same hashing,
prefix table, policy and load accounting as ``kvlb serve`` — with two changes that only affect speed:

* **Sharded load tracker.** :class:`ShardedTracker` is a ``LoadTracker`` that keeps one real
  ``LoadTracker`` per replica and builds a snapshot of the replicas in :attr:`ShardedTracker.focus`
  only (the candidates), so a snapshot costs O(candidates), not O(fleet). Caps such as
  ``max_tracked_requests`` then apply per replica.
* **Candidate pruning** (:class:`SimRouter`, ``prune=True``). With the ``cost`` policy at temperature 0
  the choice is the argmin of ``base_load_r + w_prefill·(request_blocks − credit·overlap_r) − shared``.
  For every replica without overlap that is ``base_load_r + w_prefill·request_blocks``, so among them
  only the least loaded can win. The policy is therefore given the replicas holding the request's
  first block (all with overlap > 0, speculative ones included) plus the ``prune_k`` least loaded
  eligible replicas, kept in a heap keyed by the policy's own ``base_load``. Guards keep this exact:
  replicas over the KV-usage ceiling are skipped when picking the least loaded (if every replica is
  over it, the full set is used, as the guard then lifts), and the imbalance guard's floor is the
  least loaded eligible replica, which is always in the set. ``least_load`` is pruned the same way
  on ``seq_load``, its set holding every replica of the least count as well and handed over
  in the full list's order, so its tie draw is the full list's (exact, decision for decision;
  since 2026-12-01, h-capfollow2). With the duplication charge a replica without the prefix also pays
  ``w_prefill·w_dup·request_blocks·pressure_r``, so replicas also sit in 8 pressure bands (each its
  own heap) and a band is scanned only while its least load plus the charge at the band's lowest
  pressure may still undercut the best candidate seen (``SimRouter._least``). Exactness holds up to
  tie-breaking: among replicas of exactly equal cost the
  service draws from all of them, the pruned set from fewer (the heap orders equal loads at random).
  With ``overlap_credit_loaded`` the credit depends on the share of eligible replicas with prefill
  in flight; :class:`SimRouter` counts that share over the whole fleet and gives the policy the
  decision's credit as a constant, which keeps the pruning exact (with the KV-usage ceiling set,
  where eligibility needs every replica's usage, it gives the full list instead).
  With ``interference_weight`` > 0 a replica without the prefix also pays
  ``w_prefill·w_int·decoding_r·request_blocks``, which depends on its decode batch, not on its load
  key: the replicas are then scanned in load-key order, each costed with both charges, until the
  next key alone reaches the lowest such cost seen (every charge is ≥ 0, so no replica further on
  can cost less; ``SimRouter._least_scan``). Of the scanned replicas the policy gets only the
  ``prune_k`` least loaded and those within a tie's slack of the lowest cost: the rest cost more
  than that one, so they cannot be chosen (on the Mooncake trace, 100 replicas: 5–7 candidates a
  request instead of every replica scanned, ~50).
  With ``admission_weight`` > 0 a replica without the prefix also pays for the KV blocks it would
  have to free, which reads its scraped KV usage, not its load key: the cost policy then gets the
  full candidate list.
  With ``root_weight`` > 0 a replica without the prefix also pays ``w_prefill·min(root_cap_prompts,
  root_weight·(roots_r − fewest))·request_blocks`` for the prompt roots its caches hold beyond the
  fewest any eligible candidate holds (the router reads them from the index, ``PoolRouter.plan``;
  every candidate's count is known there, speculative entries included). Per request
  :class:`SimRouter` reads every replica's count from the index (``PrefixTable.held_roots``, kept
  counts: O(fleet) small ints, after expiring the speculative entries due at ``now``, as ``plan``
  then sees them), takes the fewest over the eligible replicas (open and under the KV-usage
  ceiling, the policy's own eligibility) and adds one eligible replica holding that few to the set,
  so the policy's ``fewest`` over the pruned set is the fleet's. The replicas are then scanned in
  load-key order as with the interference charge, each costed with every charge (duplication,
  interference, held roots, all ≥ 0), starting from that replica's cost, until the next key alone
  reaches the lowest cost seen (``SimRouter._least_scan``). Holders pay no root charge and are in
  the set anyway. With this charge ties are exact too: the scan goes on through every key up to
  the lowest cost plus the tie slack, so every replica of equal cost is in the set, and the set is
  handed over in the full list's order (fleet order), so the policy's tie draw (``pick_min``: one
  ``rng.choice`` over the tied replicas in input order) picks the same replica with the same draw
  as over the full list. The default weights thus route exactly as the full list does, decision
  for decision (the same results as ``--no-prune``); without the charge ties stay as above. The
  simulator has one DP rank per replica; the index counts a root held by several ranks once, so
  ranks would change nothing here.
  Temperature > 0 samples over every eligible replica, and ``round_robin``, ``random``,
  ``power_of_two``, ``session`` and ``sglang_threshold`` look at the whole set, so they get the full
  candidate list (O(fleet) per request). The keys of ``least_load`` (``seq_load``) and of
  ``cost`` with ``queue_weight`` > 0 read the scraped waiting queue: they are renewed at each
  scrape and once that scrape is older than the tracker's ``stale_after_s``, when the policy reads
  the queue as unknown (0; before 2026-12-01 a stale queue stayed in the key until the replica's
  next touch). ``queue_weight`` changes nothing in the pruning of the other policies.
  ``tests/unit/test_simulate_routing.py`` checks the pruned
  choice against the full one, decision by decision (and, with the held-roots charge, ties drawn
  alike).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence

from balancer.errors import NoReplicasAvailable, Overloaded
from balancer.events import KvEvent
from balancer.index.slots import TableLimits
from balancer.load.tracker import (
    EngineStats,
    LoadConfig,
    LoadCounts,
    LoadSnapshot,
    LoadTracker,
    LoadTrackerStats,
    ReplicaLoad,
)
from balancer.policy.base import PolicyWeights
from balancer.policy.common import TIE_TOLERANCE
from balancer.policy.cost import (
    ShareAverage,
    base_load,
    cache_pressure,
    credit_ramps,
    loaded_credit,
    root_charge_prompts,
)
from balancer.policy.registry import make_policy
from balancer.routing.router import KeySpace, PoolRouter, RoutePlan
from balancer.types import ReplicaId
from loadtests.simulate.load_order import LoadOrder

PRESSURE_BANDS = 8
"""Pressure bands of the duplication-charge pruning (band ``b``: pressure in ``[b/8, (b+1)/8)``)."""
TIE_SLACK = 4 * TIE_TOLERANCE
"""Relative cost slack within which a scanned replica is kept for the policy (``_least_scan``): four
times the policy's own tie tolerance, so float noise between the two sums never drops a tie."""


def _key_itself(key: float, _: ReplicaId) -> float:
    """A replica's cost when it is its heap key (``least_load``)."""
    return key


class ShardedTracker(LoadTracker):
    """A ``LoadTracker`` made of one real tracker per replica; snapshots cover :attr:`focus` only."""

    def __init__(self, config: LoadConfig | None = None) -> None:
        super().__init__(config)
        self._shards: dict[ReplicaId, LoadTracker] = {}
        self._owner: dict[str, ReplicaId] = {}
        self.focus: Sequence[ReplicaId] | None = None
        """Replicas the next :meth:`snapshot` covers (``None``: every replica seen)."""

    def shard(self, replica: ReplicaId) -> LoadTracker:
        found = self._shards.get(replica)
        if found is None:
            found = self._shards[replica] = LoadTracker(self.config)
        return found

    def load_of(self, replica: ReplicaId, now: float) -> ReplicaLoad:
        """One replica's load at ``now`` (O(1))."""
        shard = self._shards.get(replica)
        return ReplicaLoad(replica=replica) if shard is None else shard.snapshot(now).of(replica)

    def decoding(self, replica: ReplicaId, now: float) -> int:
        """``load_of(replica, now).active_decode_seqs`` without building a snapshot: the shard's
        own count after the same expiry (no peers here)."""
        shard = self._shards.get(replica)
        if shard is None:
            return 0
        shard.expire(now)
        return shard.own(replica).decode_seqs

    def reserve(
        self,
        request_id: str,
        replica: ReplicaId,
        prefill_tokens: int,
        decode_blocks: int,
        now: float,
        sequences: int = 1,
    ) -> bool:
        if request_id in self._owner:
            return False
        shard = self.shard(replica)
        if not shard.reserve(request_id, replica, prefill_tokens, decode_blocks, now, sequences):
            return False
        self._owner[request_id] = replica
        return True

    def first_token(self, request_id: str, now: float) -> bool:
        replica = self._owner.get(request_id)
        return replica is not None and self.shard(replica).first_token(request_id, now)

    def release(self, request_id: str, now: float) -> bool:
        replica = self._owner.pop(request_id, None)
        return replica is not None and self.shard(replica).release(request_id, now)

    def expire(self, now: float) -> int:
        return sum(shard.expire(now) for shard in self._shards.values())

    def observe(self, replica: ReplicaId, stats: EngineStats, now: float) -> bool:
        return self.shard(replica).observe(replica, stats, now)

    def forget(self, replica: ReplicaId) -> int:
        shard = self._shards.pop(replica, None)
        return 0 if shard is None else shard.forget(replica)

    def snapshot(
        self,
        now: float,
        peers: Mapping[ReplicaId, LoadCounts] | None = None,
        only: Collection[ReplicaId] | None = None,
    ) -> LoadSnapshot:
        replicas = self._shards.keys() if self.focus is None else self.focus
        if only is not None:
            replicas = [replica for replica in replicas if replica in only]
        loads: dict[ReplicaId, ReplicaLoad] = {}
        for replica in replicas:  # like LoadTracker: replicas without any data are absent
            shard = self._shards.get(replica)
            peer = None if peers is None or replica not in peers else {replica: peers[replica]}
            if shard is None and peer is not None:
                shard = self.shard(replica)
            found = None if shard is None else shard.snapshot(now, peer).replicas.get(replica)
            if found is not None:
                loads[replica] = found
        return LoadSnapshot(now=now, block_size_tokens=self.config.block_size_tokens, replicas=loads)

    def stats(self) -> LoadTrackerStats:
        totals = dict.fromkeys((f.name for f in dataclasses.fields(LoadTrackerStats)), 0)
        for shard in self._shards.values():
            for name, value in dataclasses.asdict(shard.stats()).items():
                totals[name] += value
        return LoadTrackerStats(**totals)


@dataclasses.dataclass(slots=True)
class RoutingCounters:
    pruned: int = 0
    """Requests routed over a pruned candidate set."""
    full: int = 0
    """Requests routed over every replica below its in-flight cap."""
    candidates: int = 0
    """Candidates given to the policy, summed over requests."""
    refused: int = 0
    """Requests with no replica below its in-flight cap (the service answers 429)."""


class SimRouter:
    """One pool's routing over a simulated fleet; see the module docstring."""

    def __init__(
        self,
        replicas: Sequence[ReplicaId],
        *,
        model: str,
        block_size: int,
        policy: str,
        weights: PolicyWeights,
        rng: random.Random,
        limits: TableLimits,
        max_inflight_per_replica: int,
        speculative_ttl_s: float = 2.0,
        pending_ttl_s: float | None = None,
        prune: bool = True,
        prune_k: int = 4,
    ) -> None:
        self.replicas = tuple(replicas)
        self._position = {replica: n for n, replica in enumerate(self.replicas)}
        """Each replica's place in :attr:`replicas` (the full candidate list's order)."""
        self.router = PoolRouter(model, limits)
        for replica in self.replicas:
            self.router.add_replica(replica, block_size, "plain")
        self.tracker = ShardedTracker(LoadConfig(block_size_tokens=block_size))
        self.router.load = self.tracker
        self.space: KeySpace = self.router.space_of[self.replicas[0]]
        self.policy = make_policy(policy)
        self.weights = weights
        self.rng = rng
        self.cap = max_inflight_per_replica
        self.speculative_ttl_s = speculative_ttl_s
        self.pending_ttl_s = pending_ttl_s
        self.prune_k = max(1, prune_k)
        self.inflight = dict.fromkeys(self.replicas, 0)
        self._kv_usage: dict[ReplicaId, tuple[float, float]] = {}
        """The KV usage last given to :meth:`observe` and when: the policy's guard reads the same."""
        self.counters = RoutingCounters()
        self._key = self._prune_key(policy, weights) if prune else None
        self._scraped_key = self._key is not None and (
            policy == "least_load" or (policy == "cost" and weights.queue_weight > 0)
        )
        """Whether the pruning key reads a scraped gauge, the engine's waiting queue: ``least_load``'s
        ``seq_load`` always, ``cost``'s ``base_load`` with ``queue_weight`` > 0; no other policy
        has a key (it gets the full list). Such a key is renewed at each scrape and when the scrape
        goes stale (:meth:`_expire_scrapes`)."""
        self._counts_tie = self._key is not None and policy == "least_load"
        """Whether the key is ``least_load``'s request count, whose ties are common: the set then
        holds every replica of the least count, in the full list's order, so that the policy's tie
        draw picks what it picks over the full list (before 2026-12-01, h-capfollow2: the ``k``
        least of the heap's random order, the same distribution but other draws)."""
        self._scrapes_due: list[tuple[float, ReplicaId]] = []
        """When ``_scraped_key``: a heap of (scrape time, replica) of the scrapes not yet stale."""
        self._scraped_at: dict[ReplicaId, float] = {}
        """When ``_scraped_key``: each replica's last scrape time."""
        self._order = LoadOrder(random.Random(rng.getrandbits(64)))
        self._dup = self._key is not None and policy == "cost" and weights.duplication_weight > 0
        """Whether the cost has the duplication charge: replicas then also sit in pressure bands."""
        self._interference = self._key is not None and policy == "cost" and weights.interference_weight > 0
        """Whether the cost has the interference charge: a cold replica's cost then reads its decode batch."""
        self._roots = self._key is not None and policy == "cost" and weights.root_weight > 0
        """Whether the cost has the held-roots charge: a cold replica's cost then reads the index's
        count of the prompt roots it holds, against the fewest any eligible replica holds."""
        self._bands = [LoadOrder(None) for _ in range(PRESSURE_BANDS + 1)]
        """When ``_dup``: band ``b`` orders the replicas with pressure in ``[b/B, (b+1)/B)``, band
        ``B`` those at pressure 1 (``_order`` keeps every replica, for the least loaded overall)."""
        self._band: dict[ReplicaId, int] = {}
        self._pressure: dict[ReplicaId, float] = {}
        """Cache pressure of each replica as the policy computes it (absent: 0 or unknown)."""
        self._ramp = self._key is not None and policy == "cost" and credit_ramps(weights)
        """Whether the credit ramps with the share of open replicas prefilling: counted here over
        the whole fleet and given to the policy as a constant credit (:meth:`plan_weights`)."""
        self._open: dict[ReplicaId, tuple[bool, bool]] = {}
        """When ``_ramp``: per replica (open, open and prefilling), as last counted."""
        self._open_count = self._prefilling_count = 0
        self._ramped: dict[float, PolicyWeights] = {}
        self.ramp_average = ShareAverage()
        """When ``_ramp`` with ``ramp_memory_s``: the busy share averaged in model time over the
        committed decisions (the service's :attr:`PoolRouter.ramp_average`, counted over the whole
        fleet)."""
        for replica in self.replicas:
            self._touch(replica, 0.0)

    @staticmethod
    def _prune_key(policy: str, weights: PolicyWeights) -> Callable[[ReplicaLoad], float] | None:
        ramp_reads_ceiling = credit_ramps(weights) and weights.kv_usage_ceiling is not None
        exact = weights.temperature == 0 and not ramp_reads_ceiling and weights.admission_weight == 0
        if policy == "cost" and exact:
            return lambda load: base_load(load, weights)
        if policy == "least_load":
            return lambda load: float(load.seq_load)
        return None

    def planned_average(self, now: float) -> ShareAverage | None:
        """The ramp's average after a decision at ``now`` (model seconds; ``ramp_memory_s``,
        ``None`` when off): :attr:`ramp_average` advanced by
        the fleet's busy share, stored only when the decision is committed (:meth:`route`), as the
        service's router does."""
        if not self._ramp:
            return None
        weights = self.weights
        if weights.ramp_memory_s:
            return self.ramp_average.advanced_to(self._busy_share(), now, weights.ramp_memory_s)
        return None

    def _busy_share(self) -> float:
        """The share of open replicas with prefill in flight, over the whole fleet (when ``_ramp``)."""
        return self._prefilling_count / self._open_count if self._open_count else 0.0

    def plan_weights(self, averaged: ShareAverage | None = None) -> PolicyWeights:
        """The weights the policy is given. With the load-dependent credit and a pruned candidate
        list the policy would count the prefilling share over the pruned list only, so the share
        is counted here over every open replica (what the policy sees in full: the ramp prunes only
        without the KV-usage ceiling, so eligible = open) and the policy gets that decision's credit
        as a constant, with which the pruning is exact. ``averaged``: the ramp's memory after this
        decision (:meth:`planned_average`), whose share replaces the instant one."""
        weights = self.weights
        if not self._ramp:
            return weights
        share = averaged.share if averaged is not None and averaged.share is not None else self._busy_share()
        credit = loaded_credit(weights.overlap_credit, weights.overlap_credit_loaded or 0.0, share)
        ramped = self._ramped.get(credit)
        if ramped is None:
            ramped = self._ramped[credit] = weights.replace(overlap_credit=credit, overlap_credit_loaded=None)
        return ramped

    def _touch(self, replica: ReplicaId, now: float) -> None:
        if self._key is not None:
            load = self.tracker.load_of(replica, now)
            key = self._key(load)
            if self._ramp:
                is_open = self.inflight[replica] < self.cap
                flags = (is_open, is_open and load.pending_prefill_seqs > 0)
                was_open, was_prefilling = self._open.get(replica, (False, False))
                self._open_count += flags[0] - was_open
                self._prefilling_count += flags[1] - was_prefilling
                self._open[replica] = flags
            self._order.update(replica, key)
            if self._dup:
                self._bands[self._band.get(replica, 0)].update(replica, key)

    def _repressure(self, replica: ReplicaId, now: float) -> None:
        """Recompute ``replica``'s cache pressure (held blocks or pool size changed); move it to
        its new pressure band when that changed."""
        held = self.space.table.held_blocks(replica)
        pressure = cache_pressure(held, self.tracker.load_of(replica, now).capacity_blocks) or 0.0
        self._pressure[replica] = pressure
        band = min(PRESSURE_BANDS, int(pressure * PRESSURE_BANDS))
        was = self._band.get(replica, 0)
        if band != was:
            self._bands[was].discard(replica)
            self._band[replica] = band
            self._touch(replica, now)

    def _least(
        self,
        token_ids: Sequence[int],
        eligible: Callable[[ReplicaId], bool],
        now: float,
        roots: tuple[Mapping[ReplicaId, int], int, ReplicaId] | None = None,
    ) -> list[ReplicaId]:
        """The ``prune_k`` least loaded eligible replicas; with the duplication charge, every
        replica that could undercut them. A replica without the prefix costs
        ``base_load + w_prefill·request_blocks + charge·pressure`` with ``charge = w_prefill·w_dup·
        request_blocks`` the same for all of them, so each pressure band is scanned while its least
        key plus ``charge`` × the band's lowest pressure may undercut the best seen. With the
        interference or the held-roots charge the replicas are scanned in key order instead, each
        costed with every charge (:meth:`_least_scan`). ``roots``: the held-roots counts of every
        replica at ``now``, the fewest an eligible replica holds, and one eligible replica holding
        that few (:meth:`_fewest_roots`)."""
        if self._interference or roots is not None:
            return self._least_scan(token_ids, eligible, now, roots)
        if self._counts_tie:  # every replica of the least count too (counts are whole: 0.5 parts them)
            return self._order.least(self.prune_k, eligible, _key_itself, offset=-0.5)[0]
        if not self._dup:
            return self._order.least(self.prune_k, eligible)[0]
        keyed = self._order.least_keyed(self.prune_k, eligible)
        least = [r for _, r in keyed]
        if not least:
            return least
        weights = self.weights
        request_blocks = len(token_ids) // self.space.hasher.block_size
        charge = weights.prefill_weight * weights.duplication_weight * request_blocks
        if charge <= 0:
            return least
        pressure = self._pressure
        best = min(key + charge * pressure.get(r, 0.0) for key, r in keyed)
        chosen = dict.fromkeys(least)
        for band, order in enumerate(self._bands):
            low = charge * band / PRESSURE_BANDS
            if not order.has_below(best - low):
                continue
            found, best = order.least(
                0,
                eligible,
                lambda key, r: key + charge * pressure.get(r, 0.0),
                best,
                offset=low,
            )
            chosen.update(dict.fromkeys(found))
        return list(chosen)

    def _least_scan(
        self,
        token_ids: Sequence[int],
        eligible: Callable[[ReplicaId], bool],
        now: float,
        roots: tuple[Mapping[ReplicaId, int], int, ReplicaId] | None,
    ) -> list[ReplicaId]:
        """The replicas in load-key order, each costed with every charge a replica without the
        prefix pays (duplication, interference, held roots: each ≥ 0), until the next key alone
        reaches the lowest cost seen; no replica further on can cost less. With the held-roots
        charge the scan starts from the cost of the eligible replica holding the fewest roots
        (returned too, so the policy's own ``fewest`` over the pruned set is the fleet's).

        Of the scanned replicas only the ``prune_k`` least loaded (the imbalance guard's floor is
        the first) and those within a tie's slack of the lowest cost are returned: the policy
        prices a replica without the prefix at this cost plus ``w_prefill·request_blocks``, so the
        others cannot be its choice, and the ties keep their order (``pick_min`` draws the same)."""
        weights = self.weights
        request_blocks = len(token_ids) // self.space.hasher.block_size
        per_block = weights.prefill_weight * request_blocks
        dup = per_block * weights.duplication_weight if self._dup else 0.0
        interference = per_block * weights.interference_weight
        pressure = self._pressure
        load_of = self.tracker.load_of
        decoding = self.tracker.decoding
        costs: dict[ReplicaId, float] = {}
        counts: Mapping[ReplicaId, int] = {}
        fewest = 0
        root_charge = roots is not None

        def cost(key: float, replica: ReplicaId) -> float:  # less the w_prefill·request_blocks all share
            if (known := costs.get(replica)) is not None:
                return known
            charge = key + dup * pressure.get(replica, 0.0)
            if interference:
                charge += interference * decoding(replica, now)
            if root_charge:
                charge += per_block * root_charge_prompts(weights, counts.get(replica, 0), fewest)
            costs[replica] = charge
            return charge

        best = math.inf
        slack = 0.0
        extra: list[ReplicaId] = []
        if roots is not None:
            assert self._key is not None  # pruning is on
            counts, fewest, fewest_replica = roots
            best = cost(self._key(load_of(fewest_replica, now)), fewest_replica)
            extra.append(fewest_replica)
            # every tie too: the scan goes on while a key may still reach the lowest cost within the
            # slack (costs are ≥ 0, so the seed's slack bounds the final one's)
            slack = TIE_SLACK * max(1.0, best + per_block)
        found, best = self._order.least(self.prune_k, eligible, cost, best, offset=-slack)
        if not found:
            return found
        slack = max(slack, TIE_SLACK * max(1.0, abs(best) + per_block))
        kept = dict.fromkeys(found[: self.prune_k])
        kept.update((r, None) for r in found[self.prune_k :] if costs[r] <= best + slack)
        kept.update(dict.fromkeys(extra))
        return list(kept)

    def _fewest_roots(
        self, counts: Mapping[ReplicaId, int], eligible: Callable[[ReplicaId], bool]
    ) -> tuple[int, ReplicaId] | None:
        """The fewest held roots among the eligible replicas and one replica holding that few
        (``None``: nobody eligible). O(fleet) in small ints; usually one pass of ``min`` plus a
        short search, as the replica holding the fewest is usually eligible."""
        if not counts:
            return None
        fewest = min(counts.values())
        for replica, count in counts.items():
            if count == fewest and eligible(replica):
                return fewest, replica
        found = [(count, replica) for replica, count in counts.items() if eligible(replica)]
        return min(found) if found else None

    def _expire_scrapes(self, now: float) -> None:
        """Renew the key of every replica whose last scrape went stale by ``now``: the policy then
        reads its waiting queue as unknown (0), as the tracker's snapshot gives it (older than
        ``stale_after_s``), and a key that kept the stale queue would leave the replica out of the
        pruned set while the full list chooses it (before 2026-12-01, h-capfollow2)."""
        due, stale_after_s = self._scrapes_due, self.tracker.config.stale_after_s
        while due and now - due[0][0] > stale_after_s:
            at, replica = heapq.heappop(due)
            if self._scraped_at.get(replica) == at:  # not scraped again since
                self._touch(replica, now)

    def candidates(self, token_ids: Sequence[int], now: float) -> list[ReplicaId]:
        """What the policy is given: pruned when exact (module docstring), else every open replica."""
        cap = self.cap
        inflight = self.inflight
        if self._key is None:
            return self._full()
        if self._scraped_key:
            self._expire_scrapes(now)
        ceiling = self.weights.kv_usage_ceiling if self.policy.name == "cost" else None

        stale_before = now - self.tracker.config.stale_after_s
        usages = self._kv_usage

        def eligible(replica: ReplicaId) -> bool:
            if inflight[replica] >= cap:
                return False
            if ceiling is None or (seen := usages.get(replica)) is None:
                return True
            return seen[1] < stale_before or seen[0] < ceiling  # stale usage is unknown: eligible

        roots = None
        if self._roots:  # first: it expires the speculative entries due at ``now``, as ``plan`` will
            counts = self.space.table.held_roots(self.replicas, now)
            fewest = self._fewest_roots(counts, eligible)
            if fewest is None:
                return self._full()  # nobody open and under the KV ceiling: let the policy's guard decide
            roots = (counts, fewest[0], fewest[1])
        holders = self.space.table.prefix_holders(token_ids, now) if self.policy.name == "cost" else ()
        least = self._least(token_ids, eligible, now, roots)
        if not least:
            return self._full()  # nobody open and under the KV ceiling: let the policy's guard decide
        chosen = dict.fromkeys(holders)
        chosen.update(dict.fromkeys(least))
        self.counters.pruned += 1
        if roots is not None or self._counts_tie:  # in the full list's order: a tie is drawn as over it
            position = self._position
            return sorted((r for r in chosen if inflight[r] < cap), key=position.__getitem__)
        return [r for r in chosen if inflight[r] < cap]

    def _full(self) -> list[ReplicaId]:
        self.counters.full += 1
        return [r for r in self.replicas if self.inflight[r] < self.cap]

    def route(
        self,
        request_id: str,
        token_ids: Sequence[int],
        max_tokens: int,
        session_key: str | None,
        now: float,
    ) -> RoutePlan:
        """Plan and commit one request; raises ``Overloaded`` when every replica is at its cap."""
        candidates = self.candidates(token_ids, now)
        if not candidates:
            self.counters.refused += 1
            raise Overloaded(f"every replica has {self.cap} requests in flight", 1.0)
        self.counters.candidates += len(candidates)
        self.tracker.focus = candidates
        averaged = self.planned_average(now)
        try:
            plan = self.router.plan(
                token_ids,
                candidates,
                self.policy,
                self.plan_weights(averaged),
                self.rng,
                now,
                session_key=session_key,
                request_id=request_id,
                max_tokens=max_tokens,
            )
        except NoReplicasAvailable:
            self.counters.refused += 1
            raise
        finally:
            self.tracker.focus = None
        replica = plan.decision.replica
        committed = self.router.commit(
            plan, request_id, now, self.speculative_ttl_s, pending_ttl_s=self.pending_ttl_s
        )
        if committed and averaged is not None:
            self.ramp_average = averaged
        self.inflight[replica] += 1
        self._touch(replica, now)
        return plan

    def first_token(self, request_id: str, replica: ReplicaId, now: float) -> None:
        self.router.first_token(request_id, now)
        self._touch(replica, now)

    def release(self, request_id: str, replica: ReplicaId, now: float) -> None:
        self.router.release(request_id, now)
        self.inflight[replica] -= 1
        self._touch(replica, now)

    def apply(self, replica: ReplicaId, events: Sequence[KvEvent], now: float) -> None:
        self.space.table.apply(replica, events, now)
        if self._dup:
            self._repressure(replica, now)

    def observe(self, replica: ReplicaId, stats: EngineStats, now: float) -> None:
        self.tracker.observe(replica, stats, now)
        usage = stats.kv_usage
        if usage is None or not math.isfinite(usage):
            self._kv_usage.pop(replica, None)
        else:  # clamped as the tracker does
            self._kv_usage[replica] = (min(1.0, max(0.0, usage)), now)
        if self._dup:
            self._repressure(replica, now)
        if self._scraped_key:
            self._scraped_at[replica] = now
            heapq.heappush(self._scrapes_due, (now, replica))
            self._touch(replica, now)
