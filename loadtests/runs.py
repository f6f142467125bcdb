"""One load-test campaign: the same request stream through each router in turn (I/O).

For each router: start the router, wait until it sees every replica, flush the fleet's caches
(after it is idle; a kvlb then until its index has taken every event the fleet published, the
flush's clear included: ``processes.wait_caught_up``), read the replicas' counters, drive the
stream (open or closed loop) while sampling every replica's load every ``sample_interval_s``, wait
until the fleet is idle, read the counters again, stop the router. The replica-side figures (hit
rate, requests per replica) are the counter differences, so they count what the replicas did
whatever the router passes back to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtests.client_lag import summary_line
from loadtests.driver import RouteFn, RunResult, run_closed_loop, run_open_loop
from loadtests.fleet.child_process import Child
from loadtests.fleet.processes import (
    EmulatorHandle,
    flush,
    replica_stats,
    start_router,
    wait_caught_up,
    wait_idle,
)
from loadtests.peers import RouterSpec, peer_available
from loadtests.stats import RequestRecord, Summary
from loadtests.workloads.base import RequestSpec

MAX_LOAD_SAMPLES = 20_000
"""Load samples kept per router run (per replica and time); later ones are dropped and counted."""

RunStatus = Literal["ok", "skipped", "failed"]


@dataclass(frozen=True, slots=True)
class DriveOptions:
    """How the stream is sent (same for every router)."""

    mode: Literal["open", "closed"] = "open"
    concurrency: int = 512
    """Open loop: cap on requests in flight. Closed loop: number of users."""
    max_duration_s: float = 600.0
    """Per router; requests still in flight then are cancelled."""
    timeout_s: float = 300.0
    """Per request."""
    sample_interval_s: float = 0.5
    seed: int = 0
    kvlb_sets: tuple[str, ...] = ()
    """``kvlb serve --set`` overrides for every kvlb router (e.g. ``limits.speculative_ttl_s=5``)."""
    kvlb_weight_time_scale: float = 1.0
    """The fleet's model seconds per wall second for each kvlb router's policy weights in seconds
    (:func:`loadtests.kvlb_timers.model_time_weights`; 1: as given)."""
    kvlb_workers: int | None = None
    """``kvlb serve --workers`` of every kvlb router (``None``: its default, the cores)."""
    catch_up: bool = True
    """Flush with the router running and wait for a kvlb's catch-up (``wait_caught_up``) before
    driving. ``False`` (a testing flag) restores the order before commit fd35bf6: the fleet is flushed
    before the router starts and the drive starts at once, so a kvlb started on a fleet that served an
    earlier run replays that history, flush included, while it routes (as a kvlb restarted in front
    of live engines does)."""


@dataclass
class RouterRun:
    """What one router did with the stream."""

    spec: RouterSpec
    status: RunStatus
    note: str = ""
    result: RunResult | None = None
    summary: Summary | None = None
    replica_delta: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per replica, counter differences over the run: requests, prompt and cached tokens."""
    load_series: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    """Per replica, ``(t_s, running, waiting)`` samples."""
    samples_dropped: int = 0
    prediction: dict[str, float] | None = None
    """kvlb routers: its receipts over the run (:func:`kvlb_receipts`); ``None`` for peers."""
    wall_s: float = 0.0
    process: tuple[int, int] | None = None
    """The router process this run started and stopped: (pid, exit code)."""
    after_drive: dict[str, Any] = field(default_factory=dict)
    """What the ``after_drive`` hook of :func:`run_router` returned (e.g. a what-if answer)."""


class Progress:
    """A one-line progress bar on ``stream`` (redrawn in place on a terminal, every 10% otherwise)."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = max(1, total)
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done = 0
        self.errors = 0
        self.cancelled = 0
        self.t0 = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        if record.outcome == "cancelled":  # cut by the time limit or a signal: no error of the target
            self.cancelled += 1
        elif record.outcome != "ok":
            self.errors += 1
        now = time.monotonic()
        decile = 10 * self.done // self.total
        if self.tty and (now - self._last_draw > 0.1 or self.done == self.total):
            self._last_draw = now
            self._draw("\r")
        elif not self.tty and decile != self._last_decile:
            self._last_decile = decile
            self._draw("")
            self.stream.write("\n")

    def _draw(self, prefix: str) -> None:
        width = 30
        filled = min(width, width * self.done // self.total)
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.monotonic() - self.t0
        cancelled = f" cancelled {self.cancelled}" if self.cancelled else ""
        self.stream.write(
            f"{prefix}{self.label:<20} [{bar}] {self.done}/{self.total} errors {self.errors}{cancelled} "
            f"{elapsed:6.1f} s"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


class LoadSampler:
    """Polls every replica's running and waiting requests until stopped (bounded sample count)."""

    def __init__(self, session: aiohttp.ClientSession, fleet: EmulatorHandle, interval_s: float) -> None:
        self.session = session
        self.fleet = fleet
        self.interval_s = interval_s
        self.series: dict[str, list[tuple[float, float, float]]] = {name: [] for name in fleet.names}
        self.kept = 0
        self.dropped = 0

    async def run(self) -> None:
        t0 = time.monotonic()
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError):
                stats = await replica_stats(self.session, self.fleet)
                t_s = time.monotonic() - t0
                for name, figures in stats.items():
                    if self.kept >= MAX_LOAD_SAMPLES:
                        self.dropped += 1
                        continue
                    self.kept += 1
                    sample = (t_s, figures["num_running_reqs"], figures["num_waiting_reqs"])
                    self.series.setdefault(name, []).append(sample)
            await asyncio.sleep(self.interval_s)


def _delta(
    before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]
) -> dict[str, dict[str, float]]:
    keys = (
        "requests_total",
        "prompt_tokens_total",
        "cached_tokens_total",
        "generation_tokens_total",
        "evicted_blocks_total",
        "steps_total",
        "step_late_model_s_total",
        "step_slips_total",
        "step_slip_model_s_total",
    )
    return {name: {key: after[name].get(key, 0) - before[name].get(key, 0) for key in keys} for name in after}


async def _drive(
    specs: Sequence[RequestSpec],
    url: str,
    model: str,
    router: RouterSpec,
    options: DriveOptions,
    route: RouteFn | None = None,
) -> RunResult:
    progress = Progress(router.name, len(specs))
    common: dict[str, Any] = {
        "model": model,
        "max_requests": len(specs),
        "max_duration_s": options.max_duration_s,
        "timeout_s": options.timeout_s,
        "on_progress": progress.update,
        "replica_header": router.replica_header,
    }
    try:
        if options.mode == "open":
            return await run_open_loop(specs, url, concurrency_cap=options.concurrency, route=route, **common)
        if route is not None:
            raise ValueError("a replay (pinned requests) runs in the open loop only")
        return await run_closed_loop(specs, url, users=options.concurrency, **common)
    finally:
        progress.close()


async def run_router(
    router: RouterSpec,
    fleet: EmulatorHandle,
    specs: Sequence[RequestSpec],
    options: DriveOptions,
    logs: Path,
    after_drive: Callable[[aiohttp.ClientSession, str], Awaitable[dict[str, Any]]] | None = None,
    assignment: Mapping[str, str] | None = None,
) -> RouterRun:
    """One router through the whole stream (module docstring); failures end as a ``failed`` run.
    ``after_drive(session, url)`` is called once the fleet is idle, before the router stops (it
    may ask the router's admin API); what it returns is kept in :attr:`RouterRun.after_drive`.

    A ``replay`` router (:func:`loadtests.peers.replay_router`) starts no process: each request goes
    straight to the replica ``assignment`` names for its ``request_id`` (every spec must have one)."""
    if router.is_peer and not peer_available(router):
        return RouterRun(router, "skipped", "not installed (pip install sglang-router / vllm-router)")
    route: RouteFn | None = None
    if router.kind == "replay":
        if assignment is None:
            return RouterRun(router, "failed", "a replay needs the assignment of every request")
        try:
            route = pinned_route(fleet, assignment, specs)
        except ValueError as exc:
            return RouterRun(router, "failed", str(exc))
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        if not options.catch_up:
            await flush(session, fleet)
        child: Child | None = None
        url = str(fleet.replicas[0]["url"])
        if route is None:
            try:
                child, url = await start_router(
                    router,
                    fleet,
                    logs,
                    seed=options.seed,
                    kvlb_sets=options.kvlb_sets,
                    kvlb_workers=options.kvlb_workers,
                    weight_time_scale=options.kvlb_weight_time_scale,
                )
            except (RuntimeError, OSError, ValueError) as exc:
                return RouterRun(router, "failed", f"could not start: {exc}")
        try:
            # Flushed with the router running: a kvlb replays the engines' history (an earlier
            # run's) before its drive, then takes the flush's clear live.
            if options.catch_up:
                await flush(session, fleet)
                if router.kind == "kvlb":
                    await wait_caught_up(session, url, fleet)
            before = await replica_stats(session, fleet)
            sampler = LoadSampler(session, fleet, options.sample_interval_s)
            sampling = asyncio.create_task(sampler.run())
            try:
                result = await _drive(specs, url, fleet.model, router, options, route)
            finally:
                sampling.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampling
            await wait_idle(session, fleet)
            after = await replica_stats(session, fleet)
            prediction = await kvlb_receipts(session, url) if router.kind == "kvlb" else None
            extra = {} if after_drive is None else await after_drive(session, url)
        except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
            traceback.print_exc(file=sys.stderr)
            return RouterRun(router, "failed", f"run failed: {type(exc).__name__}: {exc}")
        finally:
            code = 0 if child is None else await child.stop()
    run = RouterRun(
        router,
        "ok",
        note=f"router exit code {code}" if code not in (0, -15) else "",
        result=result,
        summary=result.summary(replicas=fleet.names),
        replica_delta=_delta(before, after),
        load_series=sampler.series,
        samples_dropped=sampler.dropped,
        prediction=prediction,
        after_drive=extra,
    )
    run.wall_s = time.monotonic() - started
    run.process = None if child is None else (child.pid, code)
    return run


def pinned_route(
    fleet: EmulatorHandle, assignment: Mapping[str, str], specs: Sequence[RequestSpec]
) -> RouteFn:
    """The driver's route of a replay: request id → its assigned replica's URL (``ValueError`` when a
    spec has no assignment or names a replica the fleet does not have)."""
    urls = {str(r["name"]): str(r["url"]) for r in fleet.replicas}
    for spec in specs:
        replica = assignment.get(spec.request_id)
        if replica is None:
            raise ValueError(f"replay: request {spec.request_id} has no assigned replica")
        if replica not in urls:
            raise ValueError(f"replay: request {spec.request_id} names replica {replica!r}, not in the fleet")

    def route(spec: RequestSpec) -> str:
        return urls[assignment[spec.request_id]]

    return route


RECEIPT_COUNTERS = {
    "receipts": "kvlb_route_receipts_total",
    "exact": "kvlb_route_receipts_exact_total",
    "within_one_block": "kvlb_route_receipts_within_block_total",
    "stale_blocks": "kvlb_route_receipt_stale_blocks_total",
    "dropped_blocks": "kvlb_index_receipt_drops_blocks_total",
    "learned_blocks": "kvlb_index_receipt_learned_blocks_total",
}
"""Fields of :attr:`RouterRun.prediction` and the kvlb counters they sum over replicas."""


def receipt_figures(metrics_text: str) -> dict[str, float]:
    """kvlb's receipt counters in a ``/metrics`` text, summed over replicas, plus the shares of exact
    predictions and of predictions within one block (``None`` without a receipt)."""
    wanted = {name: key for key, name in RECEIPT_COUNTERS.items()}
    sums = dict.fromkeys(RECEIPT_COUNTERS, 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None:
                sums[key] += sample.value
    figures: dict[str, Any] = dict(sums)
    count = sums["receipts"]
    figures["exact_share"] = sums["exact"] / count if count else None
    figures["within_one_block_share"] = sums["within_one_block"] / count if count else None
    return figures


async def kvlb_receipts(session: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """:func:`receipt_figures` of the kvlb at ``url`` (``None`` if its metrics cannot be read), once
    it has released every request (a request's receipt is recorded before its release; the client
    may have its last bytes a moment before that)."""
    try:
        async with asyncio.timeout(10.0):
            while True:
                async with session.get(url + "/admin/replicas") as response:
                    views = (await response.json())["replicas"] if response.status == 200 else []
                if all(view.get("inflight", 0) == 0 for view in views):
                    break
                await asyncio.sleep(0.05)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        pass  # read the counters anyway
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
            if response.status != 200:
                return None
            return receipt_figures(await response.text())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


MAX_SAVED_DECISIONS = 100_000
"""Most decisions :func:`kvlb_decisions` reads from one router (its ring holds
``console.decision_ring_size``, 10,000 by default)."""


async def kvlb_decisions(
    session: aiohttp.ClientSession, url: str, *, most: int = MAX_SAVED_DECISIONS
) -> dict[str, Any]:
    """Every decision still in the ring of the kvlb at ``url``, oldest first, each as
    ``GET /admin/decisions/{id}`` gives it (the per-replica cost terms, the reason, the overlap,
    speculative and held blocks and the load the policy read). Ids run from 1 in a fresh kvlb; an id
    the ring no longer holds (evicted by ``console.decision_ring_size`` or ``decision_ring_bytes``)
    is counted in ``missing``. At most ``most`` of the newest are read. With several workers
    only the answering worker's ring is read (``kvlb capacity --confirm`` runs one by default).
    Returns ``{"decisions": [...], "missing": n, "newest_id": id}`` (``decisions`` empty and
    ``error`` set when the ring cannot be read)."""
    try:
        async with session.get(url + "/admin/decisions", params={"limit": "1"}) as response:
            if response.status != 200:
                return {"decisions": [], "missing": 0, "newest_id": None, "error": f"HTTP {response.status}"}
            newest = (await response.json())["decisions"]
        newest_id = int(newest[0]["id"]) if newest else 0
        decisions: list[dict[str, Any]] = []
        missing = 0
        for record_id in range(max(1, newest_id - most + 1), newest_id + 1):
            async with session.get(f"{url}/admin/decisions/{record_id}") as response:
                if response.status == 404:
                    missing += 1
                    continue
                if response.status != 200:
                    raise RuntimeError(f"decision {record_id}: HTTP {response.status}")
                decisions.append(await response.json())
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, RuntimeError) as exc:
        return {"decisions": [], "missing": 0, "newest_id": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"decisions": decisions, "missing": missing, "newest_id": newest_id}


async def run_all(
    routers: Sequence[RouterSpec],
    fleet: EmulatorHandle,
    specs: Sequence[RequestSpec],
    options: DriveOptions,
    logs: Path,
    assignment: Mapping[str, str] | None = None,
) -> list[RouterRun]:
    """Every router in order; leaves the fleet flushed and idle. ``assignment``: the replay routers'
    (request id → replica name)."""
    runs = []
    for router in routers:
        run = await run_router(router, fleet, specs, options, logs, assignment=assignment)
        if run.status != "ok":
            print(f"{router.name}: {run.status}: {run.note}", file=sys.stderr)
        client = run.result.client_check() if run.result is not None else None
        if client is not None:
            behind = " BEHIND its schedule" if client.behind else ""
            print(f"{router.name}: {summary_line(client.to_dict())}{behind}", file=sys.stderr)
        runs.append(run)
    async with aiohttp.ClientSession() as session:
        await wait_idle(session, fleet)
    return runs
