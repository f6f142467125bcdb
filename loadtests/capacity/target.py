"""``kvlb capacity --target URL``: the capacity search run for real against a deployed endpoint (I/O).

The same bracket-then-bisect search as the simulator's (:func:`loadtests.capacity.search.search`), but each
offered rate is a real run of the stream's first ``--target-requests`` requests, their arrival times
rescaled to that rate, driven at the URL with ``kvlb loadtest --target``'s driver. Every point of the
report is measured (source ``target``); TTFTs are wall time. A point with more than
``--max-error-rate`` failures does not meet the SLO; a target where no request of the first point
succeeds stops the search (exit 1). A point whose client fell behind its schedule
(:mod:`loadtests.client_lag`, with its lag bounded by a tenth of the TTFT SLO) is ``invalid`` and
does not meet the SLO either: no pass at a rate the client never sent. The client's in-flight cap is
the point's request count at least (:func:`loadtests.capacity.confirm.open_loop_cap`), so it never
holds a launch back. With ``--slo-gate RATE`` the command exits
:data:`loadtests.target.EXIT_SLO_MISSED` when the capacity found is below ``RATE``, so a rollout can be
gated on "this deployment still serves N req/s within the SLO"; without it, a search that met the
SLO at no rate exits :data:`loadtests.target.EXIT_SLO_MISSED` all the same (2026-12-01, branch
h-capfollow). It exits :data:`loadtests.target.EXIT_CLIENT_BEHIND` instead when the lowest failing
rate's point was invalid by the client (the search's bracket was the client's, not the target's).
SIGINT or SIGTERM stops the search: the report holds the points measured before it (the one in
flight is lost), ``meta.interrupted`` says so, and the command exits
:data:`loadtests.target.EXIT_INTERRUPTED` + the signal's number (130, 143). SIGTERM takes SIGINT's
path (:func:`sigterm_as_sigint`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import aiohttp

from loadtests.capacity.confirm import open_loop_cap
from loadtests.capacity.search import RatePoint, Search, Slo, point_of, search
from loadtests.client_lag import lag_bound_s, no_schedule
from loadtests.driver import REPLICA_HEADER, run_open_loop
from loadtests.flag_checks import refuse_not_above
from loadtests.runs import Progress
from loadtests.target import EXIT_CLIENT_BEHIND, EXIT_SLO_MISSED
from loadtests.target_access import SECRET_MASK, check_target_url, first_model, target_headers

CAPACITY_ADVICE = (
    "the search counts the rate as failed; run the client on another machine (or nearer the "
    "target) to measure it"
)
"""What a ``kvlb capacity --target`` user can do about a point whose client fell behind."""

DEFAULT_OPEN_LOOP_CAP = 1024
"""The client's in-flight cap below a point's request count (``open_loop_cap`` raises it to that)."""


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--target", metavar="URL",
        help="search the capacity of this OpenAI-compatible endpoint for real (a deployed kvlb, a peer "
        "router, an engine) instead of the simulator; every point is a run at the URL")  # fmt: skip
    add("--model", help="--target: the model name (default: the first of GET /v1/models)")
    add("--header", action="append", default=[], metavar="NAME:VALUE",
        help=f"--target: a header on every request (repeatable; the values are written as {SECRET_MASK} "
        "in the report)")  # fmt: skip
    add("--api-key-env", metavar="VAR",
        help="--target: send 'Authorization: Bearer <key>' with the key read from the environment "
        "variable VAR (e.g. OPENAI_API_KEY), so that it is on no command line")  # fmt: skip
    add("--target-requests", type=int, default=200, help="--target: requests per offered rate (200)")
    add("--target-timeout-s", type=float, default=120.0, help="--target: per request (120)")
    add("--slo-gate", type=float, default=None, metavar="RATE",
        help=f"--target: exit {EXIT_SLO_MISSED} when the capacity found is below RATE req/s (without it: "
        "when no rate met the SLO)")  # fmt: skip


def measure_target(
    args: argparse.Namespace,
    specs_at: Callable[[float, int], list[Any]],
    model: str,
    log: Callable[[str], None],
    slo: Slo,
) -> Callable[[float], RatePoint]:
    """A point per offered rate: the first ``--target-requests`` requests at that rate, at the URL,
    ``invalid`` when the client fell behind its schedule (lag bounded by a tenth of ``slo``'s TTFT)."""
    headers = target_headers(args)
    bound_s = lag_bound_s(slo.latency_bounds_s())

    def measure(rate: float) -> RatePoint:
        specs = specs_at(rate, args.target_requests)
        progress = Progress(f"{rate:.3g} req/s", len(specs))
        try:
            result = asyncio.run(
                run_open_loop(
                    specs,
                    args.target,
                    model=model,
                    max_requests=len(specs),
                    max_duration_s=max(60.0, 4 * len(specs) / rate + args.target_timeout_s),
                    concurrency_cap=open_loop_cap(DEFAULT_OPEN_LOOP_CAP, len(specs)),
                    timeout_s=args.target_timeout_s,
                    headers=headers,
                    on_progress=progress.update,
                    replica_header=REPLICA_HEADER,
                )
            )
        finally:
            progress.close()
        summary = result.summary()
        client = result.client_check(bound_s)
        note = None if client is None else client.note(CAPACITY_ADVICE)
        figures = no_schedule() if client is None else client.to_dict()
        point = point_of(
            rate,
            summary,
            "target",
            invalid=note,
            req_per_s=summary.req_per_s,
            replica_share=summary.replica_share,
            **figures,
        )
        sent = figures["client_sent_rate_per_s"]
        log(
            f"target @ {rate:.3g}/s: TTFT p90 {point.ttft_p90_s}, errors {point.errors}/{point.requests}, "
            f"hit rate {point.hit_rate}, client sent {sent if sent is None else round(sent, 3)}/s"
            + (f"; INVALID: {note}" if note else "")
        )
        if summary.ok == 0:
            raise TargetDown(f"no request succeeded at {rate:.3g}/s: {result.records[0].error}", point)
        return point

    return measure


class TargetDown(RuntimeError):
    """The target answered no request of a point: the search stops. ``point`` is that point;
    :func:`search_target` raises it again with ``search``, the points measured, that one included."""

    def __init__(self, message: str, point: RatePoint | None = None, search: Search | None = None) -> None:
        super().__init__(message)
        self.point = point
        self.search = search if search is not None else Search((), None, None)


def model_of(args: argparse.Namespace) -> str:
    """``--model``, else the first model of the target's ``GET /v1/models`` (``ValueError`` saying
    to pass ``--model`` when it names none)."""
    if args.model:
        return str(args.model)

    async def ask() -> str:
        async with aiohttp.ClientSession() as session:
            return await first_model(session, args.target, target_headers(args))

    return asyncio.run(ask())


def search_target(
    args: argparse.Namespace,
    model: str,
    specs_at: Callable[[float, int], list[Any]],
    slo: Slo,
    start: float,
    log: Callable[[str], None],
) -> Search:
    """The search at the URL; on SIGINT (``KeyboardInterrupt``; SIGTERM too within
    :func:`sigterm_as_sigint`) :class:`SearchInterrupted` with the points measured so far (the point
    in flight is lost); :class:`TargetDown` with the points measured, the failed one included."""
    measure = measure_target(args, specs_at, model, log, slo)
    measured: list[RatePoint] = []

    def keep(rate: float) -> RatePoint:
        point = measure(rate)
        measured.append(point)
        return point

    try:
        return search(keep, slo, start, growth=args.growth, rel_tol=args.rel_tol, max_points=args.max_points)
    except KeyboardInterrupt:
        raise SearchInterrupted(partial_search(measured, slo)) from None
    except TargetDown as down:
        points = [*measured, *([] if down.point is None else [down.point])]
        raise TargetDown(str(down), down.point, partial_search(points, slo)) from None


class SearchInterrupted(Exception):
    """A signal stopped the search: ``search`` holds the points measured before it."""

    def __init__(self, search: Search) -> None:
        super().__init__(f"stopped after {len(search.points)} points")
        self.search = search


@contextlib.contextmanager
def sigterm_as_sigint() -> Iterator[list[signal.Signals]]:
    """Within the block SIGTERM does what SIGINT does: the SIGINT handler in force runs (outside
    ``asyncio.run``, Python's, which raises ``KeyboardInterrupt``; inside, asyncio's, which cancels
    the run's main task and then raises it), so one path stops the search and writes the report. The
    list yielded gets each SIGTERM received (empty: the interruption was SIGINT's). The SIGTERM
    handler before the block is put back after it."""
    received: list[signal.Signals] = []

    def on_sigterm(_signum: int, frame: FrameType | None) -> None:
        received.append(signal.SIGTERM)
        handler = signal.getsignal(signal.SIGINT)
        if not callable(handler):  # SIGINT ignored or left to the OS: stop all the same
            raise KeyboardInterrupt
        handler(signal.SIGINT, frame)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def stopped_by(received: Sequence[signal.Signals]) -> signal.Signals:
    """The signal that stopped a run within :func:`sigterm_as_sigint`: its first SIGTERM, else SIGINT."""
    return received[0] if received else signal.SIGINT


def partial_search(points: Sequence[RatePoint], slo: Slo) -> Search:
    """The bracket the ``points`` give: the lowest failing rate, and the highest passing one below it."""
    fails = [p.rate for p in points if not p.meets(slo)]
    first_fail = min(fails) if fails else None
    passes = [p.rate for p in points if p.meets(slo) and (first_fail is None or p.rate < first_fail)]
    return Search(tuple(sorted(points, key=lambda p: p.rate)), max(passes) if passes else None, first_fail)


def check_target_args(args: argparse.Namespace) -> None:
    """``ValueError`` for a bad ``--target`` argument, before a request goes out (exit 2)."""
    check_target_url(args.target)
    target_headers(args)
    refuse_not_above("--slo-gate", args.slo_gate, 0, "req/s")
    if not args.target_requests > 0:
        raise ValueError(f"--target-requests must be > 0, got {args.target_requests}")
    timeout_s = args.target_timeout_s
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"--target-timeout-s must be a finite number > 0, got {timeout_s}")


def gate(found: Search, args: argparse.Namespace, log: Callable[[str], None]) -> int:
    """The exit code: the SLO gate on the capacity found (module docstring); without ``--slo-gate``
    a search that met the SLO at no rate misses it all the same (exit 3, or 4 when the lowest failing
    rate's point was the client's), as ``kvlb capacity``'s simulator search does."""
    for point in found.points:
        if point.invalid is not None:
            log(f"target @ {point.rate:.3g}/s is no measurement: {point.invalid}")
    if args.slo_gate is None:
        if found.capacity is not None:
            return 0
        log(f"kvlb capacity: no rate tried met the SLO: exit {EXIT_SLO_MISSED} (the report is written)")
    else:
        ok = found.capacity is not None and found.capacity >= args.slo_gate
        log(f"capacity {found.capacity} req/s against the gate {args.slo_gate}: {'met' if ok else 'MISSED'}")
        if ok:
            return 0
    failing = found.point_at(found.first_fail)
    if failing is not None and failing.invalid is not None:
        log(
            f"kvlb capacity: the client could not send {failing.rate:.3g} req/s, the lowest failing "
            "rate: the gate's miss is the client's, not the target's"
        )
        return EXIT_CLIENT_BEHIND
    return EXIT_SLO_MISSED
