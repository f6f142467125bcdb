"""Open- and closed-loop load drivers for any OpenAI-compatible endpoint (I/O).

Both drivers stream every request (``stream: true`` with ``stream_options.include_usage``) over one
``aiohttp.ClientSession`` and record a :class:`~loadtests.stats.RequestRecord` per request: TTFT at
the first content chunk, the gaps between content chunks, usage (with
``prompt_tokens_details.cached_tokens``) and the replica header. A stream must end with
``data: [DONE]``; one that stops short is an ``error``.

- :func:`run_open_loop` sends each spec at its ``arrival_s`` (give specs without one a schedule with
  :func:`~loadtests.workloads.base.with_arrivals` and :func:`poisson_arrivals`). When
  ``concurrency_cap`` requests are in flight the next one waits; its record keeps the planned
  ``scheduled_s`` beside the real ``start_s`` so the lag shows, and :attr:`RunResult.slot_waits`
  counts the launches that waited. A cap below the schedule's own in-flight peak (its rate × the
  requests' e2e) turns the open loop partly closed: the sent rate then follows how fast requests end.
  :meth:`RunResult.client_check` says whether the client kept its schedule
  (:mod:`loadtests.client_lag`).
- :func:`run_closed_loop` runs ``users`` workers that each send a request, wait for its end, and take
  the next. Requests of one ``session_id`` run in order, one at a time.

Both stop launching at ``max_requests`` or when the specs run out, and stop everything at
``max_duration_s`` or when the ``stop`` event is set (a signal: stop reason ``interrupted``):
requests still in flight are cancelled and recorded as ``cancelled``, and the run returns what it
has. No task outlives the call.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from balancer.errors import UpstreamError
from loadtests.client_lag import ClientCheck, check_client
from loadtests.sse import StreamState
from loadtests.stats import RequestRecord, Summary, summarize
from loadtests.workloads.base import RequestSpec, poisson_arrivals

__all__ = ["RequestRecord", "RunResult", "poisson_arrivals", "run_closed_loop", "run_open_loop"]

REPLICA_HEADER = "x-kvlb-replica"
PREDICTED_HEADER = "x-kvlb-cached-tokens"
"""kvlb's predicted cached tokens for the request, kept in each record next to the reported ones."""

ERROR_BODY_BYTES = 4096
"""Of a non-200 answer's body, at most this many bytes are read (the record keeps the first 300
characters): a huge error page costs the client nothing."""

ProgressFn = Callable[[RequestRecord], None]
"""Called with each record as its request ends (on the event loop: keep it quick; must not raise)."""

StopReason = Literal["specs", "max_requests", "max_duration", "interrupted"]

RouteFn = Callable[[RequestSpec], str]
"""The base URL (``http://host:port``) a spec is sent to instead of the endpoint: pins each request
to one server, e.g. to replay a simulated router's assignment straight to the replicas."""


@dataclass(frozen=True, slots=True)
class RunResult:
    """A finished run: records sorted by ``start_s``, wall duration, and what stopped it."""

    mode: Literal["open", "closed"]
    records: tuple[RequestRecord, ...]
    duration_s: float
    stop_reason: StopReason
    """``max_duration`` when the time limit ended launching or cut the drain, ``interrupted`` when the
    ``stop`` event did, else why launching ended."""
    slot_waits: int = 0
    """Open loop: launches that found ``concurrency_cap`` requests in flight and waited for one to
    end (their lag includes the wait; the cap's overflow count). Always 0 in the closed loop."""
    concurrency_cap: int | None = None
    """Open loop: the cap on requests in flight the run had; ``None`` in the closed loop."""

    def summary(self, replicas: Iterable[str] = ()) -> Summary:
        return summarize(self.records, self.duration_s, replicas=replicas)

    def client_check(self, lag_bound_s: float | None = None, time_scale: float = 1.0) -> ClientCheck | None:
        """The client against its schedule (:mod:`loadtests.client_lag`; with ``time_scale``, in model
        time, ``lag_bound_s`` too); ``None`` in the closed loop."""
        if self.mode != "open" or self.concurrency_cap is None:
            return None
        return check_client(
            self.records,
            slot_waits=self.slot_waits,
            concurrency_cap=self.concurrency_cap,
            lag_bound_s=lag_bound_s,
            time_scale=time_scale,
        )


@dataclass(frozen=True, slots=True)
class _Options:
    base_url: str
    model: str
    timeout_s: float
    headers: Mapping[str, str]
    replica_header: str
    session_header: str | None
    extra_body: Mapping[str, Any] | None
    on_progress: ProgressFn | None
    route: RouteFn | None = None


class _Runner:
    """One run's session, clock origin and record sink."""

    def __init__(self, session: aiohttp.ClientSession, options: _Options) -> None:
        self.session = session
        self.options = options
        self.t0 = time.monotonic()
        self.records: list[RequestRecord] = []
        self.launched = 0
        self.slot_waits = 0
        self.stop_reason: StopReason = "specs"

    def now_s(self) -> float:
        """Seconds since the run's start."""
        return time.monotonic() - self.t0

    async def send(self, spec: RequestSpec, scheduled_s: float | None = None) -> None:
        """Send ``spec``, stream the answer and append its record (also when cancelled)."""
        state = StreamState(start=time.monotonic())
        try:
            await self._stream(spec, state)
        except asyncio.CancelledError:
            state.fail("cancelled", "run ended while in flight")
            self._finish(spec, scheduled_s, state)
            raise
        except TimeoutError:
            state.fail("timeout", f"no complete answer within {self.options.timeout_s} s")
        except (aiohttp.ClientError, ValueError, UpstreamError) as exc:  # transport; bad JSON; endless event
            state.fail("error", f"{type(exc).__name__}: {exc}")
        self._finish(spec, scheduled_s, state)

    async def _stream(self, spec: RequestSpec, state: StreamState) -> None:
        options = self.options
        headers = {**options.headers, "x-request-id": spec.request_id}
        if options.session_header and spec.session_id is not None:
            headers[options.session_header] = spec.session_id
        base_url = options.base_url if options.route is None else _base_url(options.route(spec))
        async with self.session.post(
            base_url + spec.path,
            json=spec.body(options.model, options.extra_body),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=options.timeout_s),
        ) as response:
            state.status = response.status
            state.replica = response.headers.get(options.replica_header)
            predicted = response.headers.get(PREDICTED_HEADER, "")
            state.predicted_cached_tokens = int(predicted) if predicted.isdigit() else None
            if response.status != 200:
                body = await response.content.read(ERROR_BODY_BYTES)  # what the record keeps, at most
                state.fail("http_error", f"HTTP {response.status}: {body.decode(errors='replace')}")
                return
            if "text/event-stream" in response.headers.get("content-type", ""):
                async for chunk in response.content.iter_any():
                    if state.feed(chunk, time.monotonic()):
                        break
                else:
                    state.end(time.monotonic())
            else:  # the server ignored "stream": one whole answer
                state.absorb(json.loads(await response.read()), time.monotonic())
                state.done = True
        state.settle()

    def _finish(self, spec: RequestSpec, scheduled_s: float | None, state: StreamState) -> None:
        record = state.record(spec, run_start=self.t0, end=time.monotonic(), scheduled_s=scheduled_s)
        self.records.append(record)
        if self.options.on_progress is not None:
            self.options.on_progress(record)


class _SessionOrder:
    """Sends requests of one session one at a time, in the order they were taken."""

    def __init__(self) -> None:
        # Per session, the event set when its latest taken request ends; bounded by the sessions in
        # flight, as an entry is dropped when its request ends with no later one queued behind it.
        self._ends: dict[str, asyncio.Event] = {}

    async def send(self, runner: _Runner, spec: RequestSpec) -> None:
        if spec.session_id is None:
            await runner.send(spec)
            return
        earlier = self._ends.get(spec.session_id)
        mine = self._ends[spec.session_id] = asyncio.Event()
        try:
            if earlier is not None:
                await earlier.wait()
            await runner.send(spec)
        finally:
            mine.set()
            if self._ends.get(spec.session_id) is mine:
                del self._ends[spec.session_id]


def _base_url(endpoint: str) -> str:
    """``http://host:port`` from the endpoint, with or without a trailing ``/v1``."""
    base = endpoint.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def _check(max_requests: int, max_duration_s: float, timeout_s: float, workers: int) -> None:
    for name, value in (
        ("max_requests", max_requests),
        ("max_duration_s", max_duration_s),
        ("timeout_s", timeout_s),
        ("concurrency", workers),
    ):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


async def _drive(
    mode: Literal["open", "closed"],
    options: _Options,
    *,
    connections: int,
    max_duration_s: float,
    launch: Callable[[_Runner, asyncio.TaskGroup], Awaitable[None]],
    concurrency_cap: int | None = None,
    stop: asyncio.Event | None = None,
) -> RunResult:
    """Run ``launch`` and every task it starts inside one session, a task group and the time limit
    (brought forward to now when ``stop`` is set)."""
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        runner = _Runner(session, options)
        watcher: asyncio.Task[None] | None = None
        try:
            async with asyncio.timeout(max_duration_s) as limit:
                if stop is not None:
                    watcher = asyncio.create_task(_stop_when_set(stop, limit, runner))
                async with asyncio.TaskGroup() as group:
                    await launch(runner, group)
        except TimeoutError:
            if runner.stop_reason != "interrupted":
                runner.stop_reason = "max_duration"
        except BaseExceptionGroup as group_error:
            # A bad spec or a raising on_progress: surface the lone error, not the group.
            if len(group_error.exceptions) == 1:
                raise group_error.exceptions[0] from None
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
        duration_s = runner.now_s()
    records = tuple(sorted(runner.records, key=lambda r: (r.start_s, r.request_id)))
    return RunResult(mode, records, duration_s, runner.stop_reason, runner.slot_waits, concurrency_cap)


async def _stop_when_set(stop: asyncio.Event, limit: asyncio.Timeout, runner: _Runner) -> None:
    """Bring the run's time limit forward to now once ``stop`` is set (in-flight requests are then
    cancelled and recorded, as at ``max_duration_s``)."""
    await stop.wait()
    runner.stop_reason = "interrupted"
    limit.reschedule(asyncio.get_running_loop().time())


def _options(
    endpoint: str,
    model: str,
    timeout_s: float,
    headers: Mapping[str, str] | None,
    replica_header: str,
    session_header: str | None,
    extra_body: Mapping[str, Any] | None,
    on_progress: ProgressFn | None,
    route: RouteFn | None = None,
) -> _Options:
    return _Options(
        base_url=_base_url(endpoint),
        model=model,
        timeout_s=timeout_s,
        headers=dict(headers or {}),
        replica_header=replica_header,
        session_header=session_header,
        extra_body=extra_body,
        on_progress=on_progress,
        route=route,
    )


async def run_open_loop(
    specs: Iterable[RequestSpec],
    endpoint: str,
    *,
    model: str,
    max_requests: int,
    max_duration_s: float,
    concurrency_cap: int,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
    on_progress: ProgressFn | None = None,
    replica_header: str = REPLICA_HEADER,
    session_header: str | None = None,
    extra_body: Mapping[str, Any] | None = None,
    route: RouteFn | None = None,
    stop: asyncio.Event | None = None,
) -> RunResult:
    """Send each spec at ``arrival_s`` seconds after the start (``ValueError`` for a spec without one).

    ``endpoint`` is the server's base URL (``http://host:port``, ``/v1`` optional). At most
    ``concurrency_cap`` requests are in flight. ``timeout_s`` bounds each request from send to its
    last byte (past it: outcome ``timeout``). ``session_header``, when set, carries each spec's
    session id; ``extra_body`` is merged into every JSON body (e.g. ``{"ignore_eos": True}`` for
    vLLM/SGLang to generate exactly ``max_tokens``). ``route``, when set, names each spec's own base
    URL (:data:`RouteFn`); ``endpoint`` is then only the default. Setting ``stop`` ends the run as
    ``max_duration_s`` would, with stop reason ``interrupted``.
    """
    _check(max_requests, max_duration_s, timeout_s, concurrency_cap)
    options = _options(
        endpoint, model, timeout_s, headers, replica_header, session_header, extra_body, on_progress, route
    )
    slots = asyncio.Semaphore(concurrency_cap)

    async def send_and_release(runner: _Runner, spec: RequestSpec, scheduled_s: float) -> None:
        try:
            await runner.send(spec, scheduled_s)
        finally:
            slots.release()

    async def launch(runner: _Runner, group: asyncio.TaskGroup) -> None:
        for spec in specs:
            if spec.arrival_s is None:
                raise ValueError(f"{spec.request_id} has no arrival_s: open loop needs a schedule")
            delay_s = spec.arrival_s - runner.now_s()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            if slots.locked():
                runner.slot_waits += 1
            await slots.acquire()
            group.create_task(send_and_release(runner, spec, spec.arrival_s))
            runner.launched += 1
            if runner.launched >= max_requests:
                runner.stop_reason = "max_requests"
                return

    return await _drive(
        "open",
        options,
        connections=concurrency_cap,
        max_duration_s=max_duration_s,
        launch=launch,
        concurrency_cap=concurrency_cap,
        stop=stop,
    )


async def run_closed_loop(
    specs: Iterable[RequestSpec],
    endpoint: str,
    *,
    users: int,
    model: str,
    max_requests: int,
    max_duration_s: float,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
    on_progress: ProgressFn | None = None,
    replica_header: str = REPLICA_HEADER,
    session_header: str | None = None,
    extra_body: Mapping[str, Any] | None = None,
    think_time_s: float = 0.0,
    stop: asyncio.Event | None = None,
) -> RunResult:
    """``users`` workers, each sending its next spec when its last one ended (``arrival_s`` is ignored).

    A worker that takes a spec of a session still busy on another worker waits for that session's
    earlier request first, so sessions run in order. ``think_time_s`` is a pause after each request.
    Other arguments as :func:`run_open_loop`.
    """
    _check(max_requests, max_duration_s, timeout_s, users)
    options = _options(
        endpoint, model, timeout_s, headers, replica_header, session_header, extra_body, on_progress
    )
    pending = iter(specs)
    in_order = _SessionOrder()

    async def user(runner: _Runner) -> None:
        while runner.launched < max_requests:
            spec = next(pending, None)
            if spec is None:
                return
            runner.launched += 1
            if runner.launched >= max_requests:
                runner.stop_reason = "max_requests"
            await in_order.send(runner, spec)
            if think_time_s > 0:
                await asyncio.sleep(think_time_s)

    async def launch(runner: _Runner, group: asyncio.TaskGroup) -> None:
        for _ in range(users):
            group.create_task(user(runner))

    return await _drive(
        "closed", options, connections=users, max_duration_s=max_duration_s, launch=launch, stop=stop
    )
