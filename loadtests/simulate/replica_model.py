"""The fast, event-level model of one engine replica (pure: every call takes ``now``).

It reproduces the emulator's step scheduler (:mod:`replicas.sim.scheduler`) without running it step
by step. Between two *changes* (a prefill ends, a sequence finishes, a waiting request can be
admitted) every step has the same shape: ``chunk_prefill_tokens`` of prefill (less in the last one)
plus one token for each of ``n`` decoding sequences, whose contexts grow by ``n`` tokens a step. So
the time of ``k`` such steps is a closed sum of :func:`replicas.sim.timing.step_time_s` terms, and the
model jumps from change to change: a few events per request instead of one per token.

What is the same as the step model: continuous batching with the ``max_running_requests`` cap, FIFO
admission only when the step's prefill budget has room (so a request is matched against the cache
at the step it would be admitted at), chunked prefill in FIFO order, lockstep decode, the SGLang
caching rules (acquire ``prompt[:-1]``, insert the prompt when its prefill ends, insert
``prompt + output[:-1]`` and release at the end) on a :class:`~loadtests.simulate.block_cache.BlockCache`,
the emulator's :class:`~replicas.sim.cache.PrefixCache` at block level: pages are named by their
block keys (computed once per request, or taken from the router's plan), not cut into token tuples.

Approximations (measured against the step model in ``tests/unit/test_simulate_models.py``):

* a request part-way through its prefill is inserted into the cache only when another request is
  admitted (and at its end), not after every chunk: events reach the router a little later;
* the inter-token gaps of one stretch of steps are reported as their mean;
* a waiting request blocked by a full KV pool is retried at the next change, not at every step.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from balancer.events import KvEvent
from balancer.index.hashing import BlockHasher, chain_keys, pack_tokens
from balancer.load.tracker import EngineStats
from balancer.types import BlockKey, ReplicaId
from loadtests.simulate.block_cache import BlockCache, BlockLease
from replicas.sim.cache import PageTokens, PrefixCache
from replicas.sim.profiles import Profile
from replicas.sim.timing import step_time_s


@dataclass(eq=False, slots=True)
class Job:
    """One request on a simulated replica. Times are virtual seconds."""

    index: int
    """The request's index in the run (its record)."""
    prompt: Sequence[int]
    max_tokens: int
    keys: list[BlockKey] | None = None
    """Block keys of the prompt's full pages (fast model; computed at submit when ``None``)."""
    packed: bytes | None = None
    """The prompt as little-endian u32 (fast model; packed at submit when ``None``)."""
    lease: BlockLease | None = None
    cached_tokens: int = 0
    remaining: int = 0
    """Prompt tokens still to prefill (fast model)."""
    first_step: int = 0
    finish_step: int = 0


class ReplicaSink(Protocol):
    """Where a replica model reports what happened (the fleet: router, index, records)."""

    def first_token(self, replica: ReplicaId, job: Job, now: float) -> None: ...

    def finished(self, replica: ReplicaId, job: Job, now: float) -> None: ...

    def cache_changed(self, replica: ReplicaId, events: list[KvEvent], now: float) -> None:
        """The replica's cache changed: its KV events (dp rank 0), in order."""
        ...

    def decode_gaps(self, gap_s: float, count: int) -> None:
        """``count`` inter-token gaps of ``gap_s`` seconds each (pooled ITL)."""
        ...


class PoolStats(Protocol):
    evicted_blocks: int


class KvPool(Protocol):
    """What the fleet and the intake check read of a replica's cache (both cache classes)."""

    page_size: int
    capacity_blocks: int

    @property
    def active_blocks(self) -> int: ...

    @property
    def stats(self) -> PoolStats: ...


class ReplicaModel(Protocol):
    """What the fleet drives: submit requests, advance to the model's own wake-up times."""

    replica: ReplicaId

    @property
    def cache(self) -> KvPool: ...

    @property
    def wake_s(self) -> float | None:
        """When :meth:`advance` must run next; ``None`` while idle."""
        ...

    def submit(self, job: Job, now: float) -> int | None:
        """Queue a request; returns an HTTP status (400, 503) when the replica refuses it."""
        ...

    def advance(self, now: float) -> None: ...

    def engine_stats(self) -> EngineStats:
        """What a metrics scrape would read: running, waiting, KV usage."""
        ...


def refusal(profile: Profile, cache: KvPool, prompt_tokens: int, max_tokens: int) -> int | None:
    """The emulator's intake check: 400 when prompt + ``max_tokens`` exceeds the context or the pool."""
    pages = -(-(prompt_tokens + max_tokens) // cache.page_size)
    if prompt_tokens + max_tokens > profile.max_context_tokens or pages > cache.capacity_blocks:
        return 400
    return None if prompt_tokens >= 1 else 400


OUTPUT_TOKEN_IDS: tuple[int, ...] = tuple(range(100, 1000))
"""Generated tokens of the fast model, repeated as needed: below every prompt id the workloads use."""


def output_tokens(count: int) -> list[int]:
    """Stand-in generated tokens. The emulator's are a hash of the prompt (greedy); to a prefix cache
    only their equality matters, and they always sit under their own prompt, so any tokens that are a
    function of the prompt alone (here: the same for every prompt) cache exactly alike, for free."""
    ids = OUTPUT_TOKEN_IDS
    whole, part = divmod(max(0, count), len(ids))
    return [*ids * whole, *ids[:part]]


_OUTPUT_PACKED = pack_tokens(OUTPUT_TOKEN_IDS)


def output_bytes(count: int) -> bytes:
    """``output_tokens(count)`` packed as little-endian u32."""
    whole, part = divmod(max(0, count), len(OUTPUT_TOKEN_IDS))
    head = _OUTPUT_PACKED[: 4 * part]
    return _OUTPUT_PACKED * whole + head if whole else head


class PagedCache(PrefixCache):
    """The emulator's :class:`PrefixCache` with a faster page cutter (same pages, same order).

    Slicing a tuple gives tuples, so the pages come without a ``tuple()`` call or a ``min()`` per
    page; everything else is the emulator's code.
    """

    def pages_of(self, tokens: Sequence[int], *, partial: bool = False) -> list[PageTokens]:
        seq = tokens if type(tokens) is tuple else tuple(tokens)
        size = self.page_size
        end = len(seq) if partial else len(seq) - len(seq) % size
        return [seq[start : start + size] for start in range(0, end, size)]


class FastReplica:
    """One replica (one DP rank), modelled change to change (module docstring)."""

    def __init__(
        self, replica: ReplicaId, profile: Profile, cache: BlockCache, sink: ReplicaSink, max_waiting: int
    ) -> None:
        self.replica = replica
        self.profile = profile
        self.cache = cache
        self.sink = sink
        self.hasher = BlockHasher(profile.model, cache.page_size)
        """Names the cache's pages: the router's block keys when both use the same model and size."""
        self.max_waiting = max_waiting
        self.waiting: deque[Job] = deque()
        self.prefill: deque[Job] = deque()
        self.backlog = 0
        """Prompt tokens still to prefill over the admitted requests."""
        self.decoding: list[tuple[int, int, Job]] = []
        self.steps = 0
        """Steps completed since start."""
        self._ctx_offset = 0
        """Σ (prompt + 1 − first_step) over decoding jobs: their context at step s is that + n·s."""
        self._blocked = False
        # The planned stretch of steps: start time and backlog, length, end time.
        self._seg_start_s = 0.0
        self._seg_backlog = 0
        self._seg_steps = 0
        self._wake_s: float | None = None

    @property
    def wake_s(self) -> float | None:
        return self._wake_s

    @property
    def running(self) -> int:
        return len(self.prefill) + len(self.decoding)

    def engine_stats(self) -> EngineStats:
        return EngineStats(
            running_reqs=self.running,
            waiting_reqs=len(self.waiting),
            kv_usage=self.cache.active_blocks / self.cache.capacity_blocks,
            capacity_tokens=self.cache.capacity_blocks * self.cache.page_size,
        )

    # ------------------------------------------------------------------------------------ intake

    def submit(self, job: Job, now: float) -> int | None:
        status = refusal(self.profile, self.cache, len(job.prompt), job.max_tokens)
        if status is not None:
            return status
        if len(self.waiting) >= self.max_waiting:
            return 503
        if job.packed is None:
            job.packed = pack_tokens(job.prompt)
        if job.keys is None:
            count = len(job.prompt) // self.cache.page_size
            job.keys = chain_keys(self.hasher.root_seed(), job.packed, self.cache.page_size, count)
        self.waiting.append(job)
        if self._wake_s is None:  # idle: the engine loop wakes and starts a step now
            self._plan(now)
        elif (
            len(self.waiting) == 1 and not self._blocked and self.running < self.profile.max_running_requests
        ):
            self._admit_earlier(now)
        return None

    def _admit_earlier(self, now: float) -> None:
        """Cut the planned stretch at the first step boundary ≥ ``now`` where the budget has room."""
        chunk = self.profile.chunk_prefill_tokens
        at_budget = self._seg_backlog // chunk
        low, high = 1, self._seg_steps  # the first boundary at or after now
        while low < high:
            mid = (low + high) // 2
            if self._stretch_s(mid) >= now - self._seg_start_s:
                high = mid
            else:
                low = mid + 1
        cut = max(at_budget, low)
        if cut < self._seg_steps:
            self._seg_steps = cut
            self._wake_s = self._seg_start_s + self._stretch_s(cut)

    # ------------------------------------------------------------------------------------- steps

    def _stretch_s(self, steps: int) -> float:
        """Duration of the first ``steps`` steps of the planned stretch."""
        n = len(self.decoding)
        ctx0 = self._ctx_offset + n * self.steps
        prefill = min(self._seg_backlog, steps * self.profile.chunk_prefill_tokens)
        context = steps * ctx0 + n * steps * (steps - 1) // 2
        single = step_time_s(
            self.profile, prefill_tokens=prefill, decode_seqs=steps * n, context_tokens=context
        )
        return single + (steps - 1) * self.profile.step_overhead_s

    def advance(self, now: float) -> None:
        """Apply the planned stretch of steps (it ends at ``now``), then plan the next one."""
        steps = self._seg_steps
        if self._wake_s is None or steps <= 0:
            return
        if self.decoding:
            self.sink.decode_gaps((now - self._seg_start_s) / steps, steps * len(self.decoding))
        consumed = min(self.backlog, steps * self.profile.chunk_prefill_tokens)
        self.steps += steps
        self.backlog -= consumed
        done: list[Job] = []
        while consumed > 0:
            head = self.prefill[0]
            take = min(head.remaining, consumed)
            head.remaining -= take
            consumed -= take
            if head.remaining == 0:
                done.append(self.prefill.popleft())
        for job in done:
            self._first_token(job, now)
        while self.decoding and self.decoding[0][0] <= self.steps:
            self._finish(heapq.heappop(self.decoding)[2], now, decoding=True)
        self._flush_records(now)
        self._plan(now)

    def _first_token(self, job: Job, now: float) -> None:
        assert job.lease is not None and job.keys is not None and job.packed is not None
        self.cache.insert(job.lease, job.keys, len(job.prompt) // self.cache.page_size, job.packed, now)
        job.first_step = self.steps
        self.sink.first_token(self.replica, job, now)
        if job.max_tokens <= 1:
            self._finish(job, now, decoding=False)
            return
        job.finish_step = self.steps + job.max_tokens - 1
        heapq.heappush(self.decoding, (job.finish_step, job.index, job))
        self._ctx_offset += len(job.prompt) + 1 - job.first_step

    def _finish(self, job: Job, now: float, *, decoding: bool) -> None:
        lease, keys, packed = job.lease, job.keys, job.packed
        assert lease is not None and keys is not None and packed is not None
        size = self.cache.page_size
        generated = max(0, job.max_tokens - 1)
        count = (len(job.prompt) + generated) // size  # full pages of prompt + output[:-1]
        if count > len(keys):  # pages past the prompt's: chained on from its last full page
            packed += output_bytes(generated)
            seed = keys[-1] if keys else self.hasher.root_seed()
            keys = keys + chain_keys(seed, packed[4 * size * len(keys) :], size, count - len(keys))
        self.cache.insert(lease, keys, count, packed, now)
        self.cache.release(lease, now)
        if decoding:
            self._ctx_offset -= len(job.prompt) + 1 - job.first_step
        self.sink.finished(self.replica, job, now)

    def _plan(self, now: float) -> None:
        """At a step boundary: admit what the budget allows, then plan steps up to the next change."""
        chunk = self.profile.chunk_prefill_tokens
        self._admit(now)
        self._flush_records(now)
        if not self.prefill and not self.decoding:
            self._wake_s = None
            self._seg_steps = 0
            return
        candidates = [math.inf]
        if self.prefill:
            candidates.append(-(-self.prefill[0].remaining // chunk))
        if self.decoding:
            candidates.append(self.decoding[0][0] - self.steps)
        if self.waiting and not self._blocked and self.running < self.profile.max_running_requests:
            candidates.append(max(1, self.backlog // chunk))
        self._seg_start_s = now
        self._seg_backlog = self.backlog
        self._seg_steps = int(min(candidates))
        self._wake_s = now + self._stretch_s(self._seg_steps)

    def _admit(self, now: float) -> None:
        """FIFO admission while the step's prefill budget has room, as ``Scheduler.start_step``."""
        chunk = self.profile.chunk_prefill_tokens
        cap = self.profile.max_running_requests
        self._blocked = False
        if not self.waiting or self.backlog >= chunk or self.running >= cap:
            return
        size = self.cache.page_size
        if self.prefill:  # the step model has cached the head's finished chunks by now
            head = self.prefill[0]
            assert head.lease is not None and head.keys is not None and head.packed is not None
            done = (len(head.prompt) - head.remaining) // size
            self.cache.insert(head.lease, head.keys, done, head.packed, now)
        while self.waiting and self.backlog < chunk and self.running < cap:
            job = self.waiting[0]
            assert job.keys is not None
            pages = (len(job.prompt) - 1) // size  # the match covers prompt[:-1]
            lease = self.cache.acquire(job.keys, pages, len(job.prompt) + job.max_tokens, now)
            if lease is None:
                self._blocked = True
                return
            self.waiting.popleft()
            job.lease = lease
            job.cached_tokens = lease.cached_tokens
            job.remaining = len(job.prompt) - lease.cached_tokens
            self.backlog += job.remaining
            self.prefill.append(job)

    def _flush_records(self, now: float) -> None:
        events = self.cache.take_events()
        if events:
            self.sink.cache_changed(self.replica, events, now)
