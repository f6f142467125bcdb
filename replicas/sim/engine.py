"""The emulated engine's async loop (I/O shell over the pure scheduler and cache).

One :class:`RankLoop` per data-parallel rank owns one task. It plans a step, sleeps until the step's
modelled end (scaled to wall time), applies it and hands the tokens to the waiting HTTP handlers and
the cache records to the personality (:class:`StepObserver`). When there is nothing to compute it
waits on an event set by :meth:`RankLoop.submit`: an idle replica costs no CPU (no polling).

Model time is wall time since start multiplied by the time scale. While busy, steps are chained on
model time (a step starts exactly when the previous one ended) so wake-up jitter never accumulates;
if the loop falls behind by more than :data:`MAX_LAG_WALL_S` it restarts the chain from "now".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from replicas.sim.cache import CacheRecord, PrefixCache
from replicas.sim.config import ReplicaConfig
from replicas.sim.faults import FaultState
from replicas.sim.scheduler import (
    SGLANG_CACHING,
    TRTLLM_CACHING,
    VLLM_CACHING,
    CachePolicy,
    Scheduler,
    SimRequest,
    StepResult,
    TokenOut,
)
from replicas.sim.timing import TimeScale

log = logging.getLogger(__name__)

MAX_LAG_WALL_S = 0.002
"""How far (wall seconds) the loop may fall behind the model before it stops catching up."""


_CACHING: dict[str, CachePolicy] = {"sglang": SGLANG_CACHING, "trtllm": TRTLLM_CACHING, "vllm": VLLM_CACHING}
"""When each engine puts computed KV into its prefix cache."""


class SimClock:
    """Model time from the monotonic clock: ``(monotonic() - origin) * scale``."""

    def __init__(self, scale: TimeScale, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.scale = scale
        self._monotonic = monotonic
        self._origin = monotonic()

    def now(self) -> float:
        return self.scale.to_model(self._monotonic() - self._origin)

    async def sleep_until(self, model_s: float) -> None:
        delay = self.scale.to_wall(model_s) - (self._monotonic() - self._origin)
        if delay > 0:
            await asyncio.sleep(delay)


class StepTiming:
    """How far one rank's loop fell behind its model (model seconds): what a loaded machine adds.

    ``late_model_s`` sums, over steps, how long after its modelled end a step was applied (its
    tokens reached the HTTP handlers that much late). ``slip_model_s`` sums the gaps the chain lost
    when the loop was more than :data:`MAX_LAG_WALL_S` behind and restarted from "now": model time
    in which the engine computed nothing, as if the GPU had stalled; it delays every queued request.
    """

    __slots__ = ("late_model_s", "max_late_model_s", "slip_model_s", "slips", "steps")

    def __init__(self) -> None:
        self.steps = 0
        self.late_model_s = 0.0
        self.max_late_model_s = 0.0
        self.slips = 0
        self.slip_model_s = 0.0

    def step(self, late_model_s: float) -> None:
        self.steps += 1
        late = max(0.0, late_model_s)
        self.late_model_s += late
        self.max_late_model_s = max(self.max_late_model_s, late)

    def slip(self, gap_model_s: float) -> None:
        self.slips += 1
        self.slip_model_s += max(0.0, gap_model_s)

    def to_dict(self) -> dict[str, float]:
        return {
            "steps_total": self.steps,
            "step_late_model_s_total": self.late_model_s,
            "step_late_max_model_s": self.max_late_model_s,
            "step_slips_total": self.slips,
            "step_slip_model_s_total": self.slip_model_s,
        }


class StepObserver(Protocol):
    """Receives what each step did (the personality: events, iteration stats)."""

    def on_step(self, rank: int, result: StepResult | None, records: Sequence[CacheRecord]) -> None: ...


@dataclass(frozen=True, slots=True)
class Finished:
    """End-of-stream marker put on a request's queue."""

    request: SimRequest


class RequestHandle:
    """What an HTTP handler holds while its request runs: the token stream of one request."""

    __slots__ = ("queue", "rank", "request")

    def __init__(self, request: SimRequest, rank: int) -> None:
        self.request = request
        self.rank = rank
        # Bounded by construction: at most max_new_tokens tokens plus the end marker.
        self.queue: asyncio.Queue[TokenOut | Finished] = asyncio.Queue(request.max_new_tokens + 1)

    async def next(self) -> TokenOut | None:
        """The next generated token, or ``None`` once the request has finished."""
        item = await self.queue.get()
        return None if isinstance(item, Finished) else item


class RankLoop:
    """One DP rank: its scheduler, its cache and the task that steps them."""

    def __init__(
        self,
        rank: int,
        scheduler: Scheduler,
        clock: SimClock,
        faults: FaultState,
        observer: StepObserver,
        on_finished: Callable[[int, SimRequest], None],
    ) -> None:
        self.rank = rank
        self.scheduler = scheduler
        self._clock = clock
        self._faults = faults
        self._observer = observer
        self._on_finished = on_finished
        self._handles: dict[SimRequest, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._stalled_until_wall = 0.0
        self._task: asyncio.Task[None] | None = None
        self.last_step_wall_s = 0.0
        self.throughput_samples: deque[tuple[float, int]] = deque(maxlen=64)
        """(model end time, generated tokens so far) of recent steps, for ``gen_throughput``."""
        self.timing = StepTiming()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"sim-rank-{self.rank}")
        self._task.add_done_callback(self._report_crash)

    def _report_crash(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("engine loop of rank %d crashed", self.rank, exc_info=task.exception())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def submit(self, request: SimRequest, received_s: float | None = None) -> RequestHandle | None:
        """Queue a request; ``None`` when this rank's waiting queue is full.

        ``received_s`` (model time) is when the replica received it, which starts its TTFT clock as
        the engines' own TTFT metrics do; default: now.
        """
        now = self._clock.now()
        request.arrival_s = now if received_s is None else min(received_s, now)
        if not self.scheduler.submit(request):
            return None
        handle = RequestHandle(request, self.rank)
        self._handles[request] = handle
        self._wake.set()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        if self._handles.pop(handle.request, None) is not None:
            self.scheduler.abort(handle.request, self._clock.now())
            self._wake.set()

    def stall(self, wall_s: float) -> None:
        self._stalled_until_wall = max(self._stalled_until_wall, time.monotonic() + wall_s)

    def publish_records(self) -> None:
        """Hand records made outside a step (a flush) to the observer now."""
        records = self.scheduler.take_records()
        if records:
            self._observer.on_step(self.rank, None, records)

    def reset(self) -> None:
        """Engine restart: every request ends (their streams close) and the cache empties."""
        for request in self.scheduler.reset(self._clock.now()):
            handle = self._handles.pop(request, None)
            if handle is not None:
                handle.queue.put_nowait(Finished(request))

    async def _run(self) -> None:
        next_free: float | None = None
        lag_model_s = self._clock.scale.to_model(MAX_LAG_WALL_S)
        while True:
            stall_s = self._stalled_until_wall - time.monotonic()
            if stall_s > 0:
                await asyncio.sleep(stall_s)
                next_free = None
                continue
            now = self._clock.now()
            behind = next_free is not None and now - next_free > lag_model_s
            start = next_free if next_free is not None and not behind else now
            plan = self.scheduler.start_step(start, slowdown=self._faults.settings.slowdown)
            if plan is None:
                next_free = None
                self._wake.clear()
                await self._wake.wait()
                continue
            if behind and next_free is not None:
                self.timing.slip(now - next_free)
            await self._clock.sleep_until(plan.end_s)
            self.timing.step(self._clock.now() - plan.end_s)
            result = self.scheduler.complete_step(plan)
            next_free = plan.end_s
            self.last_step_wall_s = time.monotonic()
            self.throughput_samples.append((plan.end_s, self.scheduler.counters.generated_tokens))
            self._deliver(result)
            try:
                self._observer.on_step(self.rank, result, result.records)
            except Exception:  # a publishing bug must not stop the engine
                log.exception("step observer failed on rank %d", self.rank)

    def _deliver(self, result: StepResult) -> None:
        for out in result.tokens:
            handle = self._handles.get(out.request)
            if handle is not None:
                handle.queue.put_nowait(out)
        for request in result.finished:
            handle = self._handles.pop(request, None)
            if handle is not None:
                handle.queue.put_nowait(Finished(request))
            self._on_finished(self.rank, request)


class Engine:
    """All DP ranks of one replica, the shared clock, and the log of finished-request timings."""

    def __init__(
        self, config: ReplicaConfig, faults: FaultState, observer: StepObserver, vocab_size: int
    ) -> None:
        self.config = config
        self.clock = SimClock(TimeScale(config.time_scale))
        caching = _CACHING[config.engine]
        self.ranks = [
            RankLoop(
                rank,
                Scheduler(
                    config.profile,
                    PrefixCache(
                        page_size=config.block_size,
                        capacity_blocks=config.capacity_blocks,
                        store_partial=config.engine == "trtllm",
                        evict_whole_nodes=config.eviction_mode == "node",
                    ),
                    caching,
                    max_waiting=config.max_waiting,
                    vocab_size=vocab_size,
                ),
                self.clock,
                faults,
                observer,
                self._record,
            )
            for rank in range(config.dp_size)
        ]
        self.finished_log: deque[dict[str, Any]] = deque(maxlen=config.request_log_size)
        self._next_rank = 0
        self.requests_total = 0

    def start(self) -> None:
        for rank in self.ranks:
            rank.start()

    async def stop(self) -> None:
        for rank in reversed(self.ranks):
            await rank.stop()

    def fits(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        return self.ranks[0].scheduler.fits(prompt_tokens, max_new_tokens)

    def submit(
        self, request: SimRequest, dp_rank: int | None = None, received_s: float | None = None
    ) -> RequestHandle | None:
        """Queue on ``dp_rank`` if given (SGLang's ``data_parallel_rank``), else round robin."""
        if dp_rank is None or not 0 <= dp_rank < len(self.ranks):
            dp_rank = self._next_rank
            self._next_rank = (self._next_rank + 1) % len(self.ranks)
        self.requests_total += 1
        return self.ranks[dp_rank].submit(request, received_s)

    def abort(self, handle: RequestHandle) -> None:
        self.ranks[handle.rank].abort(handle)

    def flush(self) -> bool:
        """``/flush_cache``: every rank drops its cache, unless a request is running somewhere."""
        if any(rank.scheduler.busy for rank in self.ranks):
            return False
        for rank in self.ranks:
            rank.scheduler.flush_cache()
            rank.publish_records()
        return True

    def restart(self) -> None:
        for rank in self.ranks:
            rank.reset()

    def stall(self, wall_s: float) -> None:
        for rank in self.ranks:
            rank.stall(wall_s)

    def _record(self, rank: int, request: SimRequest) -> None:
        scale = self.clock.scale
        ttft = None
        if request.first_token_s is not None:
            ttft = scale.to_wall(request.first_token_s - request.arrival_s)
        self.finished_log.append(
            {
                "id": request.request_id,
                "dp_rank": rank,
                "prompt_tokens": len(request.prompt),
                "cached_tokens": request.cached_tokens,
                "output_tokens": len(request.output),
                "finish_reason": request.finish_reason,
                "modelled_ttft_s": ttft,
                "modelled_queue_s": None
                if request.admitted_s is None
                else scale.to_wall(request.admitted_s - request.arrival_s),
            }
        )
