"""The simulator's oracle router: future-aware placement and eviction (pure: no clock, no I/O).

``loadtests/oracle.py`` bounds the hit rate with one pooled cache of ``replicas × K`` blocks; it says
nothing about load or latency. This module plays an **oracle router** that knows every future
request: it plans where each request goes before the run, then :class:`OracleSimulation` replays the
plan on the simulated fleet, which gives the oracle's TTFT and, with ``kvlb capacity``, its capacity.

The plan (:func:`plan_oracle`) walks the stream in arrival order with one model cache per replica:

* **Eviction: Belady's MIN within each replica.** Each replica's cache holds at most K blocks (its KV
  pool); when full it drops the block whose next use (by any later request of the stream) is
  farthest away, never one of the request being served. A block's next use is re-read lazily when
  the recorded one has passed (the request that used it went elsewhere), so the rule stays exact
  with respect to the whole future. Within a prefix a block is never used later than its parent, and
  ties go deeper first, so the cache stays prefix-closed.
* **Assignment: greedy with a load bound.** Each replica's prefill backlog is a fluid queue (seconds
  of prefill at the profile's rate, drained in real time between arrivals). A replica is eligible
  when its backlog is within ``load_bound_s`` of the least loaded one; among them the request goes
  where its cached prefix (in the planned caches, which see the future) is longest; ties go to the
  replica that needs to evict the fewest blocks (room first), then to the least backlog. This is
  a greedy with lookahead (the caches and the eviction tie-break see the future; the assignment does
  not search over later requests), not an exact optimum: the problem with a load bound is NP-hard in
  general. ``tests/unit/test_simulate_oracle.py`` checks that it is at least kvlb's hit rate on the
  test workloads, and ``kvlb capacity`` reports both on every run.

The **hit-rate bound** of a run is the plan's hits (Belady caches, one request at a time). The replay
then runs the same assignment through the simulated engines (LRU caches, chunked prefill, real
queues), so the oracle's TTFT and hit rate in the capacity tables are what that placement achieves on
engines, and its planned hit rate is what it would achieve with MIN eviction inside the engines.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from balancer.events import KvEvent
from balancer.index.hashing import BlockHasher, chain_keys, pack_tokens
from balancer.types import ReplicaId
from loadtests.oracle import NEVER, request_blocks
from loadtests.simulate.block_cache import BlockCache, _Node
from loadtests.simulate.replica_model import FastReplica, Job, ReplicaModel
from loadtests.simulate.simulation import SimConfig, SimResult, Simulation
from loadtests.simulate.sources import SimRequest

DEFAULT_LOAD_BOUND_S = 2.0
"""Default ``load_bound_s``: the default TTFT p90 SLO of ``kvlb capacity`` (a replica further behind
the least loaded one than the SLO would miss it for the request). On the full Mooncake trace at 24
req/s a bound of 0.5 s plans a 0.571 hit rate, 2 s 0.618, and no bound 0.619."""


class _Future:
    """Every position at which each block key is used, for next-use queries after any position."""

    def __init__(self, stream: Sequence[Sequence[int]]) -> None:
        self.uses: dict[int, list[int]] = {}
        for position, keys in enumerate(stream):
            for key in keys:
                self.uses.setdefault(key, []).append(position)

    def after(self, key: int, position: int) -> int:
        uses = self.uses.get(key)
        if not uses:
            return NEVER
        at = bisect.bisect_right(uses, position)
        return uses[at] if at < len(uses) else NEVER


class BeladyCache:
    """One replica's model cache: at most ``capacity`` blocks, MIN eviction (module docstring)."""

    def __init__(self, capacity: int, future: _Future) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.future = future
        self.resident: dict[int, int] = {}
        """Key → its recorded next use (the live heap entry)."""
        self._heap: list[tuple[int, int, int]] = []  # (-next_use, -depth, key); stale entries skipped

    def prefix_hits(self, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` held (an engine reuses a prefix only)."""
        resident = self.resident
        hits = 0
        for key in keys:
            if key not in resident:
                break
            hits += 1
        return hits

    def shortfall(self, keys: Sequence[int]) -> int:
        """Blocks that serving ``keys`` here would have to evict (lookahead tie-break: prefer room)."""
        resident = self.resident
        fresh = sum(1 for key in keys if key not in resident)
        return max(0, len(resident) + fresh - self.capacity)

    def serve(self, keys: Sequence[int], position: int) -> int:
        """Serve one request at ``position``: its prefix hits; then its blocks are resident."""
        hits = self.prefix_hits(keys)
        resident, heap, future = self.resident, self._heap, self.future
        for depth, key in enumerate(keys):
            next_use = future.after(key, position)
            resident[key] = next_use
            heapq.heappush(heap, (-next_use, -depth, key))
        pinned = set(keys)
        deferred: list[tuple[int, int, int]] = []
        while len(resident) > self.capacity and heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            recorded = -entry[0]
            if resident.get(key) != recorded:
                continue  # stale entry
            if key in pinned:
                deferred.append(entry)
                continue
            if recorded != NEVER and recorded <= position:
                fresh = future.after(key, position)  # its recorded use went elsewhere: re-read
                resident[key] = fresh
                heapq.heappush(heap, (-fresh, entry[1], key))
                continue
            del resident[key]
        for entry in deferred:
            heapq.heappush(heap, entry)
        overflow = len(resident) - self.capacity
        for key in reversed(keys):  # a request larger than the pool keeps its first blocks only
            if overflow <= 0:
                break
            if key in resident:
                del resident[key]
                overflow -= 1
        if len(heap) > 4 * len(resident) + 1024:
            self._heap = [(-n, 0, k) for k, n in resident.items()]
            heapq.heapify(self._heap)
        return hits


@dataclass(frozen=True, slots=True)
class OraclePlan:
    """Where the oracle sends each request, and what its Belady caches hit."""

    assignment: tuple[int, ...]
    """Replica index of each request, in stream order."""
    hit_blocks: int
    prompt_tokens: int
    block_size: int
    load_bound_s: float

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else None

    def to_dict(self) -> dict[str, object]:
        return {
            "method": "greedy placement under a prefill-backlog bound, Belady MIN eviction per replica "
            "(loadtests/simulate/oracle.py)",
            "load_bound_s": self.load_bound_s,
            "hit_blocks": self.hit_blocks,
            "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "hit_rate": self.hit_rate,
        }


def plan_oracle(
    requests: Sequence[SimRequest],
    *,
    replicas: int,
    blocks_per_replica: int,
    block_size: int,
    prefill_s_per_token: float,
    load_bound_s: float = DEFAULT_LOAD_BOUND_S,
) -> OraclePlan:
    """The oracle's plan for ``requests`` (arrival order); see the module docstring."""
    if replicas <= 0 or blocks_per_replica <= 0 or block_size <= 0:
        raise ValueError("replicas, blocks_per_replica and block_size must be > 0")
    if load_bound_s < 0:
        raise ValueError(f"load_bound_s must be >= 0, got {load_bound_s}")
    stream, prompt_tokens = request_blocks((r.token_ids for r in requests), block_size)
    future = _Future(stream)
    caches = [BeladyCache(blocks_per_replica, future) for _ in range(replicas)]
    backlog = [0.0] * replicas
    last_s = 0.0
    assignment: list[int] = []
    hits = 0
    for position, (request, keys) in enumerate(zip(requests, stream, strict=True)):
        elapsed = max(0.0, request.arrival_s - last_s)
        last_s = max(last_s, request.arrival_s)
        if elapsed:
            backlog = [max(0.0, b - elapsed) for b in backlog]
        floor = min(backlog) + load_bound_s
        best: tuple[int, int, float] | None = None
        chosen = 0
        for r in range(replicas):
            if backlog[r] > floor:
                continue
            cached = caches[r].prefix_hits(keys)
            score = (-cached, caches[r].shortfall(keys), backlog[r])
            if best is None or score < best:
                best, chosen = score, r
        served = caches[chosen].serve(keys, position)
        hits += served
        backlog[chosen] += max(0, len(request.token_ids) - served * block_size) * prefill_s_per_token
        assignment.append(chosen)
    return OraclePlan(tuple(assignment), hits, prompt_tokens, block_size, load_bound_s)


class BeladyBlockCache(BlockCache):
    """The simulator's engine cache with MIN eviction instead of LRU: an unlocked leaf's priority is
    the next use of its first block after ``position()`` (the replica's oldest request not yet
    admitted, else the latest arrival), farthest evicted first. A priority whose use has passed (that
    request went elsewhere) is re-read when it comes up for eviction. Generated pages (never in a
    prompt) have no next use and go first."""

    def __init__(
        self, *, page_size: int, capacity_blocks: int, future: _Future, position: Callable[[], int]
    ) -> None:
        super().__init__(page_size=page_size, capacity_blocks=capacity_blocks)
        self.future = future
        self.position = position

    def _priority(self, node: _Node) -> float:
        return -float(self.future.after(node.keys[0], self.position())) if node.keys else 0.0

    def _stamp(self, node: _Node, now: float) -> float:
        return self._priority(node)

    def _evict(self, need_blocks: int) -> int:
        position = self.position()
        heap = self._leaves
        freed = 0
        while freed < need_blocks and heap:
            entry = heapq.heappop(heap)
            if not self._evictable(entry):
                continue
            victim = entry[2]
            next_use = -entry[0]
            if next_use <= position and victim.keys:
                victim.last_access_s = self._priority(victim)
                if -victim.last_access_s != next_use:
                    heapq.heappush(heap, (victim.last_access_s, victim.uid, victim))
                    continue
            pages, parent = self._drop_leaf(victim)
            freed += pages
            if parent is not None:
                parent.last_access_s = self._priority(parent)
                heapq.heappush(heap, (parent.last_access_s, parent.uid, parent))
        return freed


class BeladySimulation(Simulation):
    """A :class:`Simulation` whose engines evict with MIN (:class:`BeladyBlockCache`) instead of LRU,
    routed by the configured policy as usual: it separates what eviction costs a router from what
    placement costs it (``docs/policy-studies.md``, "Against the oracle" and "Part 4")."""

    def __init__(self, config: SimConfig, requests: Sequence[SimRequest]) -> None:
        if config.replica_model != "fast":
            raise ValueError("the oracle and MIN engines run on the fast replica model only")
        profile = config.resolved_profile()
        page = config.page_size or profile.page_size
        root = BlockHasher(profile.model, page).root_seed()
        self._future = _Future(
            [chain_keys(root, pack_tokens(r.token_ids), page, len(r.token_ids) // page) for r in requests]
        )
        self._latest = -1
        super().__init__(config, requests)

    def _model(self, name: ReplicaId, capacity_blocks: int) -> ReplicaModel:
        model: FastReplica | None = None

        def position() -> int:
            waiting = model.waiting if model is not None else ()
            return min(self._latest, *(job.index - 1 for job in waiting)) if waiting else self._latest

        cache = BeladyBlockCache(
            page_size=self.page_size, capacity_blocks=capacity_blocks, future=self._future, position=position
        )
        model = FastReplica(name, self.profile, cache, self, self.config.max_waiting)
        return model

    def _arrive(self, request: SimRequest, now: float) -> None:
        self._latest = len(self.records)
        super()._arrive(request, now)


class OracleSimulation(BeladySimulation):
    """A :class:`BeladySimulation` whose requests go where ``assignment`` says (the oracle's plan);
    the replicas, queues and records are the simulator's own. The router's index and load tracker
    are not used."""

    def __init__(self, config: SimConfig, requests: Sequence[SimRequest], assignment: Sequence[int]) -> None:
        self.assignment = assignment
        super().__init__(config, requests)

    def _arrive(self, request: SimRequest, now: float) -> None:
        index = self.records.add(now, len(request.token_ids))
        self._latest = index
        self._next_arrival()
        replica = self.names[self.assignment[index]]
        self.records.route(index, self.assignment[index])
        model = self.models[replica]
        status = model.submit(Job(index, request.token_ids, request.max_tokens), now)
        if status is not None:
            self.records.refuse(index, now, status)
            return
        self._inflight += 1
        self._reschedule(model)

    def first_token(self, replica: ReplicaId, job: Job, now: float) -> None:
        self.records.first_token(job.index, now)

    def finished(self, replica: ReplicaId, job: Job, now: float) -> None:
        self.records.finish(job.index, now, job.cached_tokens, job.max_tokens)
        self._inflight -= 1

    def cache_changed(self, replica: ReplicaId, events: list[KvEvent], now: float) -> None:
        """Nobody reads the index: the events are dropped."""


class OracleLruSimulation(OracleSimulation):
    """The oracle's plan replayed on engines that evict LRU, as the simulated fleet's do: the
    placement a router could at best choose, on engines whose victims it cannot choose. Its saved
    prefill against the plan's is the share of the oracle bound that LRU engines leave reachable."""

    def _model(self, name: ReplicaId, capacity_blocks: int) -> ReplicaModel:
        return Simulation._model(self, name, capacity_blocks)


def simulate_oracle(
    config: SimConfig,
    requests: Sequence[SimRequest],
    load_bound_s: float = DEFAULT_LOAD_BOUND_S,
    *,
    lru_engines: bool = False,
) -> tuple[OraclePlan, SimResult]:
    """Plan the oracle over ``requests`` for ``config``'s fleet, then replay the plan on MIN engines
    (:class:`OracleSimulation`), or with ``lru_engines`` on the engines' LRU caches
    (:class:`OracleLruSimulation`: the placement alone)."""
    profile = config.resolved_profile()
    page = config.page_size or profile.page_size
    plan = plan_oracle(
        requests,
        replicas=config.replicas,
        blocks_per_replica=max(1, profile.kv_capacity_tokens // page),
        block_size=page,
        prefill_s_per_token=profile.prefill_s_per_token,
        load_bound_s=load_bound_s,
    )
    replay = OracleLruSimulation if lru_engines else OracleSimulation
    return plan, replay(config, requests, plan.assignment).run()


__all__ = [
    "DEFAULT_LOAD_BOUND_S",
    "BeladyBlockCache",
    "BeladyCache",
    "BeladySimulation",
    "OracleLruSimulation",
    "OraclePlan",
    "OracleSimulation",
    "plan_oracle",
    "simulate_oracle",
]
