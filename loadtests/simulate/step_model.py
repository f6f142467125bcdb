"""The accurate, step-level model of one replica: the emulator's own scheduler on virtual time (pure).

:class:`StepReplica` drives :class:`replicas.sim.scheduler.Scheduler` exactly as the emulator's engine
loop (:class:`replicas.sim.engine.RankLoop`) does, minus the sleeping: plan a step, and at its end
complete it and plan the next one at once; an idle replica starts a step when a request arrives. It
costs one event per engine step, so it is meant for small runs and for validating
:class:`~loadtests.simulate.replica_model.FastReplica`.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

from balancer.events import Cleared, KvEvent, Removed, Stored
from balancer.index.hashing import pack_tokens
from balancer.load.tracker import EngineStats
from balancer.types import EngineHash, ReplicaId
from loadtests.simulate.replica_model import Job, ReplicaSink, refusal
from replicas.sim.cache import CacheCleared, CacheRecord, PagesRemoved, PagesStored, PrefixCache
from replicas.sim.profiles import Profile
from replicas.sim.scheduler import SGLANG_CACHING, Scheduler, SimRequest, StepPlan


def kv_events(records: Iterable[CacheRecord], page_size: int) -> list[KvEvent]:
    """A cache's change records as the engine-neutral events a decoder would produce."""
    events: list[KvEvent] = []
    for record in records:
        if isinstance(record, PagesStored):
            parent = None if record.parent is None else EngineHash(record.parent.page_id)
            tokens = pack_tokens(list(chain.from_iterable(page.tokens for page in record.pages)))
            ids = tuple(EngineHash(page.page_id) for page in record.pages)
            events.append(Stored(0, parent, ids, tokens, page_size))
        elif isinstance(record, PagesRemoved):
            events.append(Removed(0, tuple(EngineHash(page.page_id) for page in record.pages)))
        elif isinstance(record, CacheCleared):
            events.append(Cleared(0))
    return events


class StepReplica:
    """One replica (one DP rank) stepped by the emulator's scheduler."""

    def __init__(
        self, replica: ReplicaId, profile: Profile, cache: PrefixCache, sink: ReplicaSink, max_waiting: int
    ) -> None:
        self.replica = replica
        self.profile = profile
        self.cache = cache
        self.sink = sink
        self.scheduler = Scheduler(
            profile, cache, SGLANG_CACHING, max_waiting=max_waiting, vocab_size=profile.vocab_size
        )
        self._jobs: dict[SimRequest, Job] = {}
        self._plan: StepPlan | None = None

    @property
    def wake_s(self) -> float | None:
        return None if self._plan is None else self._plan.end_s

    def engine_stats(self) -> EngineStats:
        return EngineStats(
            running_reqs=len(self.scheduler.running),
            waiting_reqs=len(self.scheduler.waiting),
            kv_usage=self.cache.active_blocks / self.cache.capacity_blocks,
            capacity_tokens=self.cache.capacity_blocks * self.cache.page_size,
        )

    def submit(self, job: Job, now: float) -> int | None:
        status = refusal(self.profile, self.cache, len(job.prompt), job.max_tokens)
        if status is not None:
            return status
        request = SimRequest(f"sim-{job.index}", list(job.prompt), job.max_tokens, arrival_s=now)
        if not self.scheduler.submit(request):
            return 503
        self._jobs[request] = job
        if self._plan is None:
            self._start(now)
        return None

    def advance(self, now: float) -> None:
        plan = self._plan
        if plan is None:
            return
        result = self.scheduler.complete_step(plan)
        if plan.decode:
            self.sink.decode_gaps(plan.end_s - plan.start_s, len(plan.decode))
        for out in result.tokens:
            if out.index == 0:
                job = self._jobs[out.request]
                job.cached_tokens = out.request.cached_tokens
                self.sink.first_token(self.replica, job, now)
        if result.records:
            self.sink.cache_changed(self.replica, kv_events(result.records, self.cache.page_size), now)
        for request in result.finished:
            self.sink.finished(self.replica, self._jobs.pop(request), now)
        self._start(now)

    def _start(self, now: float) -> None:
        # Evictions made by admission are published with the step's other records, as the emulator does.
        self._plan = self.scheduler.start_step(now)
