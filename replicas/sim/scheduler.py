"""Continuous-batching scheduler of one emulated engine rank (pure: ``now`` is always passed in).

Each step is planned with :meth:`Scheduler.start_step` and applied with :meth:`Scheduler.complete_step`
at its end time (``plan.end_s``); the async shell sleeps in between. A step holds:

* one decode token for every running request whose prefill is done;
* prefill chunks: first the requests already part-way through their prompt, then newly admitted ones
  (FIFO from the waiting queue), until the per-step budget ``chunk_prefill_tokens`` is spent.

A request is admitted when the batch has room (``max_running_requests``) and the KV pool can reserve
pages for its whole prompt plus ``max_new_tokens`` (after evicting unreferenced cached pages); otherwise
it waits at the head of the queue (no preemption). On admission the cached prefix of ``prompt[:-1]``
is reused (engines always compute at least the last prompt token) and counts as cached tokens.

Caching follows the engine (:class:`CachePolicy`): SGLang inserts the prompt into its radix tree after
each prefill chunk and the whole sequence at the end; TRT-LLM stores ``prompt[:-1]`` (partial last
block included) when the context phase ends, and the sequence minus its last token at release.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from replicas.sim.cache import CacheRecord, Lease, PrefixCache
from replicas.sim.profiles import Profile
from replicas.sim.sampling import prompt_digest, sample_token
from replicas.sim.timing import step_time_s

FinishReason = Literal["length", "abort"]


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """When an engine puts a request's computed KV into its prefix cache."""

    insert_prefill_chunks: bool
    """Cache the prompt as each prefill chunk completes (SGLang's ``cache_unfinished_req``)."""

    drop_last_prompt_token: bool
    """Cache ``prompt[:-1]`` at the end of the context phase (TRT-LLM) rather than the whole prompt."""


SGLANG_CACHING = CachePolicy(insert_prefill_chunks=True, drop_last_prompt_token=False)
TRTLLM_CACHING = CachePolicy(insert_prefill_chunks=False, drop_last_prompt_token=True)
VLLM_CACHING = CachePolicy(insert_prefill_chunks=True, drop_last_prompt_token=False)
"""vLLM caches each full block as soon as a step computes it (the captured 0.32 engine published a
512-token prompt's four blocks over four chunked-prefill steps, tests/golden/real/vllm-0.32.0-cpu)."""


@dataclass(eq=False, slots=True)
class SimRequest:
    """One generation request and its progress. Times are model seconds."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    arrival_s: float
    salt: int = 0
    digest: int = 0
    lease: Lease | None = None
    cached_tokens: int = 0
    computed_tokens: int = 0
    output: list[int] = field(default_factory=list)
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    finish_reason: FinishReason | None = None
    cancel_requested: bool = False

    @property
    def context_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A planned step: what it computes and when it ends."""

    start_s: float
    end_s: float
    prefill: tuple[tuple[SimRequest, int], ...]
    decode: tuple[SimRequest, ...]
    context_tokens: int

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk for _, chunk in self.prefill)


@dataclass(frozen=True, slots=True)
class TokenOut:
    """Token ``index`` of ``request``, produced at the end of a step."""

    request: SimRequest
    token: int
    index: int


@dataclass(frozen=True, slots=True)
class StepResult:
    """What a completed step produced: tokens, finished requests and the cache changes it caused."""

    plan: StepPlan
    tokens: tuple[TokenOut, ...]
    finished: tuple[SimRequest, ...]
    records: tuple[CacheRecord, ...]


@dataclass(slots=True)
class SchedulerCounters:
    """Monotonic totals since start (or the last reset)."""

    requests_admitted: int = 0
    requests_finished: int = 0
    requests_rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0


class Scheduler:
    """Waiting queue, running batch and step planning over one :class:`PrefixCache`."""

    def __init__(
        self,
        profile: Profile,
        cache: PrefixCache,
        caching: CachePolicy,
        *,
        max_waiting: int,
        vocab_size: int,
    ) -> None:
        self.profile = profile
        self.cache = cache
        self.caching = caching
        self.max_waiting = max_waiting
        self.vocab_size = vocab_size
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.counters = SchedulerCounters()
        self._aborted: list[SimRequest] = []

    # ------------------------------------------------------------------------------------- intake

    def fits(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        """Whether a request of this size can ever be admitted (its pages fit in the whole pool)."""
        pages = -(-(prompt_tokens + max_new_tokens) // self.cache.page_size)
        return prompt_tokens >= 1 and pages <= self.cache.capacity_blocks

    def submit(self, request: SimRequest) -> bool:
        """Queue a request; ``False`` when the waiting queue is full (the caller answers 503)."""
        if len(self.waiting) >= self.max_waiting:
            self.counters.requests_rejected += 1
            return False
        if not self.fits(len(request.prompt), request.max_new_tokens):
            raise ValueError("request does not fit in the KV pool; check with fits() first")
        request.digest = prompt_digest(request.prompt)
        self.waiting.append(request)
        return True

    def abort(self, request: SimRequest, now: float) -> None:
        """Cancel a request (client gone). Running ones leave the batch at the next step boundary."""
        if request.finish_reason is not None:
            return
        if request in self.waiting:
            self.waiting.remove(request)
            self._finish(request, "abort", now)
            self._aborted.append(request)
        else:
            request.cancel_requested = True

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed: waiting prompts plus unfinished prefills."""
        queued = sum(len(r.prompt) for r in self.waiting)
        return queued + sum(len(r.prompt) - r.computed_tokens for r in self.running)

    # -------------------------------------------------------------------------------------- steps

    def start_step(self, now: float, *, slowdown: float = 1.0) -> StepPlan | None:
        """Plan the next step starting at ``now``; ``None`` when there is nothing to compute."""
        self._drop_cancelled(now)
        budget = self.profile.chunk_prefill_tokens
        prefill: list[tuple[SimRequest, int]] = []
        for request in self.running:
            left = len(request.prompt) - request.computed_tokens
            if left > 0 and budget > 0:
                prefill.append((request, min(left, budget)))
                budget -= prefill[-1][1]
        while self.waiting and budget > 0 and len(self.running) < self.profile.max_running_requests:
            request = self.waiting[0]
            if not self._admit(request, now):
                break
            self.waiting.popleft()
            chunk = min(len(request.prompt) - request.computed_tokens, budget)
            prefill.append((request, chunk))
            budget -= chunk
        decode = tuple(r for r in self.running if r.first_token_s is not None)
        if not prefill and not decode:
            return None
        context = sum(r.context_tokens for r in decode)
        duration = step_time_s(
            self.profile,
            prefill_tokens=sum(chunk for _, chunk in prefill),
            decode_seqs=len(decode),
            context_tokens=context,
            slowdown=slowdown,
        )
        return StepPlan(now, now + duration, tuple(prefill), decode, context)

    def complete_step(self, plan: StepPlan) -> StepResult:
        """Apply a planned step at its end time: tokens, cache insertions, finished requests."""
        now = plan.end_s
        tokens: list[TokenOut] = []
        for request, chunk in plan.prefill:
            if request.finish_reason is not None or request.cancel_requested:
                continue
            request.computed_tokens += chunk
            lease = request.lease
            assert lease is not None
            if request.computed_tokens < len(request.prompt):
                if self.caching.insert_prefill_chunks:
                    self.cache.insert(lease, request.prompt[: request.computed_tokens], now)
                continue
            cached = request.prompt[:-1] if self.caching.drop_last_prompt_token else request.prompt
            self.cache.insert(lease, cached, now)
            request.first_token_s = now
            tokens.append(self._generate(request))
        for request in plan.decode:
            if request.finish_reason is None and not request.cancel_requested:
                tokens.append(self._generate(request))
        finished = [out.request for out in tokens if len(out.request.output) >= out.request.max_new_tokens]
        for request in finished:
            self._retire(request, "length", now)
        finished.extend(self._aborted)
        self._aborted.clear()
        self.counters.steps += 1
        return StepResult(plan, tuple(tokens), tuple(finished), tuple(self.cache.take_records()))

    def take_records(self) -> list[CacheRecord]:
        """Cache records made outside a step (flush)."""
        return self.cache.take_records()

    def flush_cache(self) -> bool:
        return self.cache.flush()

    def reset(self, now: float) -> list[SimRequest]:
        """An engine restart: every request is aborted and the cache is emptied; returns them."""
        victims = [*self.waiting, *self.running]
        for request in victims:
            self._finish(request, "abort", now)
        self.waiting.clear()
        self.running.clear()
        self.cache.reset()
        self._aborted.clear()
        return victims

    # ---------------------------------------------------------------------------------- internals

    def _admit(self, request: SimRequest, now: float) -> bool:
        lease = self.cache.acquire(request.prompt[:-1], len(request.prompt) + request.max_new_tokens, now)
        if lease is None:
            return False
        request.lease = lease
        request.cached_tokens = lease.cached_tokens
        request.computed_tokens = lease.cached_tokens
        request.admitted_s = now
        self.running.append(request)
        self.counters.requests_admitted += 1
        self.counters.prompt_tokens += len(request.prompt)
        self.counters.cached_tokens += lease.cached_tokens
        return True

    def _generate(self, request: SimRequest) -> TokenOut:
        index = len(request.output)
        token = sample_token(request.digest, index, request.salt, self.vocab_size)
        request.output.append(token)
        self.counters.generated_tokens += 1
        return TokenOut(request, token, index)

    def _drop_cancelled(self, now: float) -> None:
        for request in [r for r in self.running if r.cancel_requested]:
            self._retire(request, "abort", now)
            self._aborted.append(request)

    def _retire(self, request: SimRequest, reason: FinishReason, now: float) -> None:
        """Leave the batch: cache what the request computed, release its pages, mark it finished."""
        lease = request.lease
        if lease is not None:
            sequence = request.prompt[: request.computed_tokens] + request.output
            if len(sequence) > 1:
                self.cache.insert(lease, sequence[:-1], now)
            self.cache.release(lease, now)
        self.running.remove(request)
        self._finish(request, reason, now)

    def _finish(self, request: SimRequest, reason: FinishReason, now: float) -> None:
        request.finish_reason = reason
        request.finished_s = now
        self.counters.requests_finished += 1
