"""``kvlb loadtest --target URL``: the workloads and traces driven at any deployed endpoint (I/O).

A load-test job's user runs kvlb in front of real GPUs, and needs the same workloads and traces that
``kvlb loadtest`` sends to an emulated fleet sent to their own endpoint: a deployed kvlb, a peer
router or a bare engine, anything that speaks OpenAI's ``/v1/chat/completions`` and
``/v1/completions`` with streaming. Nothing is started or flushed: the target is measured as it is.

The report (``report.json``, ``report.md``, ``ttft_cdf.png``, ``replica_share.png``,
``requests.jsonl``) gives TTFT, inter-token and end-to-end percentiles, throughput, errors, the hit
rate from ``usage.prompt_tokens_details.cached_tokens`` (``None`` when the target does not report
it), and, behind kvlb, each replica's share from ``x-kvlb-replica``. ``--slo NAME=VALUE`` checks a
figure (``ttft_p90_s=2``, ``error_rate=0.001``, ``hit_rate=0.5``; units ``ms``/``s`` accepted):
the command exits with :data:`EXIT_SLO_MISSED` when one is missed, so a CI pipeline can gate a
rollout on it. An open-loop run whose client fell behind its schedule (:mod:`loadtests.client_lag`)
is no measurement at the offered rate: the report marks it ``invalid`` and, with ``--slo``, the
command exits :data:`EXIT_CLIENT_BEHIND` unless an SLO was missed anyway (missed under less load than
offered is missed). The figures and the SLO verdicts are pure functions of the records
(:func:`check_slos`, :func:`exit_code`), tested apart from the I/O.

Every argument is checked before a request goes out (:func:`check_target_args`: a bad one is exit 2
with one line). The URL and the credentials are :mod:`loadtests.target_access`'s (``--header`` values
and a password in the URL written as ``***`` in every output; ``--api-key-env VAR`` for a bearer key
on no command line); the files and the table are :mod:`loadtests.target_report`'s. SIGINT or
SIGTERM mid-run stops launching, cancels what is in flight (recorded ``cancelled``), writes the
partial report (status ``interrupted``) and exits :data:`EXIT_INTERRUPTED` + the signal's number
(130, 143). A target whose ``GET /v1/models`` names no model (``--model`` skips that request) gets
no request, but a report all the same: status ``invalid``, the reason in ``note``, exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.client_lag import LATENCY_SLO_PREFIXES, lag_bound_s, no_schedule
from loadtests.driver import REPLICA_HEADER, RunResult, run_closed_loop, run_open_loop
from loadtests.runs import Progress
from loadtests.stats import SUMMARY_FIELDS, Summary, implausible_cached
from loadtests.target_access import (
    SECRET_MASK,
    check_target_url,
    first_model,
    redact_argv,
    redact_url,
    target_headers,
)
from loadtests.target_report import error_sample, errors_by_kind, write_report

EXIT_SLO_MISSED = 3
"""Exit code when the run completed but missed an SLO (1: the run failed, 2: bad arguments)."""

EXIT_CLIENT_BEHIND = 4
"""Exit code when every SLO was met but the client fell behind its schedule: no pass at a rate the
client never sent."""

EXIT_CUT_SHORT = 5
"""Exit code when every SLO was met but ``--max-duration-s`` cut requests in flight: the slowest
requests are missing from every figure, so the pass is no pass."""

EXIT_INTERRUPTED = 128
"""A run stopped by a signal exits this + the signal's number (SIGINT 130, SIGTERM 143), after
writing the partial report."""

AT_LEAST: frozenset[str] = frozenset({"hit_rate", "req_per_s", "output_tok_per_s", "ok"})
"""Summary figures an SLO bounds from below; every other one is bounded from above."""

SLO_FIELDS: tuple[str, ...] = tuple(
    name for name in SUMMARY_FIELDS if name not in ("replica_requests", "replica_share", "duration_s")
)


@dataclass(frozen=True, slots=True)
class Slo:
    """One objective: ``name`` (a :class:`~loadtests.stats.Summary` field) at most / at least ``bound``."""

    name: str
    bound: float

    @property
    def at_least(self) -> bool:
        return self.name in AT_LEAST

    def check(self, summary: Summary) -> dict[str, Any]:
        """The verdict: ``value``, ``met`` (``False`` when the figure is missing: no data is no pass)."""
        value = getattr(summary, self.name)
        met = value is not None and (value >= self.bound if self.at_least else value <= self.bound)
        return {
            "name": self.name,
            "bound": self.bound,
            "direction": "at_least" if self.at_least else "at_most",
            "value": value,
            "met": bool(met),
        }


def parse_slo(text: str) -> Slo:
    """``NAME=VALUE`` (``VALUE`` may end in ``ms`` or ``s`` for the ``_s`` figures); ``ValueError``."""
    name, sep, raw = text.partition("=")
    name, raw = name.strip(), raw.strip().lower()
    if not sep or name not in SLO_FIELDS:
        names = ", ".join(SLO_FIELDS)
        raise ValueError(f"--slo expects NAME=VALUE with NAME one of {names}; got {text!r}")
    scale = 1.0
    if raw.endswith("ms"):
        raw, scale = raw[:-2], 0.001
    elif raw.endswith("s"):
        raw = raw[:-1]
    if scale != 1.0 and not name.endswith("_s"):
        raise ValueError(f"--slo {name}: a time unit on a figure that is not a time")
    try:
        bound = float(raw) * scale
    except ValueError:
        raise ValueError(f"--slo {name}: {raw!r} is not a number") from None
    if bound != bound or bound in (float("inf"), float("-inf")) or bound < 0:
        raise ValueError(f"--slo {name}: the bound must be a finite number ≥ 0")
    return Slo(name, bound)


def check_slos(summary: Summary, slos: Sequence[Slo]) -> list[dict[str, Any]]:
    return [slo.check(summary) for slo in slos]


def slo_lag_bound_s(slos: Sequence[Slo]) -> float | None:
    """The client's lag bound from the latency objectives (TTFT, e2e) among ``slos``."""
    return lag_bound_s(slo.bound for slo in slos if slo.name.startswith(LATENCY_SLO_PREFIXES))


def exit_code(
    ok_requests: int, slo_met: bool, client_behind: bool, gated: bool, cut_short: bool = False
) -> int:
    """1 when no request succeeded; :data:`EXIT_SLO_MISSED` when an SLO was missed (also with the
    client behind: missed under less load than offered is missed); when the SLOs (``gated``: there
    are some) were met, :data:`EXIT_CUT_SHORT` if the time limit cancelled requests in flight (the
    slowest left out) and :data:`EXIT_CLIENT_BEHIND` if the client fell behind its schedule; else 0."""
    if ok_requests == 0:
        return 1
    if not slo_met:
        return EXIT_SLO_MISSED
    if gated and cut_short:
        return EXIT_CUT_SHORT
    return EXIT_CLIENT_BEHIND if gated and client_behind else 0


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--target", metavar="URL",
        help="drive this OpenAI-compatible endpoint (a deployed kvlb, a peer router, a bare engine) "
        "instead of an emulated fleet: nothing is started or flushed")  # fmt: skip
    add("--model", help="--target: the model name to send (default: the first of GET /v1/models)")
    add("--header", action="append", default=[], metavar="NAME:VALUE",
        help="--target: a header on every request, e.g. 'x-tenant: ci' (repeatable; the values are "
        f"written as {SECRET_MASK} in the report)")  # fmt: skip
    add("--api-key-env", metavar="VAR",
        help="--target: send 'Authorization: Bearer <key>' with the key read from the environment "
        "variable VAR (e.g. OPENAI_API_KEY), so that it is on no command line")  # fmt: skip
    add("--replica-header", default=REPLICA_HEADER,
        help=f"--target: the response header naming the replica (default {REPLICA_HEADER})")  # fmt: skip
    add("--slo", action="append", default=[], metavar="NAME=VALUE",
        help="--target: an objective, e.g. ttft_p90_s=2s, error_rate=0.001, hit_rate=0.5 (repeatable); "
        f"exit 0 when all are met, {EXIT_SLO_MISSED} when one is missed, {EXIT_CLIENT_BEHIND} when "
        "they are met but the client fell behind its schedule (no pass at a rate it never sent), "
        f"{EXIT_CUT_SHORT} when they are met but --max-duration-s cancelled requests in flight, 1 when "
        "no request succeeded (also when GET /v1/models names no model: no request is sent, the report "
        f"is invalid and says why; pass --model), 2 for bad arguments, {EXIT_INTERRUPTED} + the signal "
        "(130, 143) after "
        "SIGINT or SIGTERM (the partial report is written)")  # fmt: skip


def check_target_args(args: argparse.Namespace) -> None:
    """``ValueError`` for any bad ``--target`` argument, before a request goes out (exit 2)."""
    check_target_url(args.target)
    target_headers(args)
    for text in args.slo:
        parse_slo(text)
    for name, value in (
        ("--requests", args.requests),
        ("--rate", args.rate),
        ("--concurrency", args.concurrency),
        ("--timeout-s", args.timeout_s),
        ("--max-duration-s", args.max_duration_s),
    ):
        if not value > 0 or value != value or value == float("inf"):
            raise ValueError(f"{name} must be a finite number > 0, got {value}")


async def target_campaign(args: argparse.Namespace, argv: Sequence[str], out: Path) -> int:
    """Drive ``args.workload`` at ``args.target`` and write the report to ``out`` (also after SIGINT
    or SIGTERM: the partial one, exit :data:`EXIT_INTERRUPTED` + the signal)."""
    from loadtests.command import build_specs, build_workload  # the shared workload options

    slos = [parse_slo(text) for text in args.slo]
    headers = target_headers(args)
    target = redact_url(args.target)
    load_average = [round(x, 2) for x in os.getloadavg()]
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    workload = build_workload(args, args.kv_capacity_tokens, args.replicas)
    specs = build_specs(workload, args)
    try:
        async with aiohttp.ClientSession() as session:
            model = args.model or await first_model(session, args.target, headers)
    except ValueError as exc:  # no model to send: no run, but the report says why
        return _no_run(args, argv, out, str(exc), workload.name, len(specs), slos, started_at, load_average)
    progress = Progress(f"{args.workload} → target", len(specs))
    stop = asyncio.Event()
    received: list[signal.Signals] = []

    def on_signal(signum: signal.Signals) -> None:
        received.append(signum)
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    common: dict[str, Any] = {
        "model": model,
        "max_requests": len(specs),
        "max_duration_s": args.max_duration_s,
        "timeout_s": args.timeout_s,
        "headers": headers,
        "on_progress": progress.update,
        "replica_header": args.replica_header,
        "stop": stop,
    }
    try:
        if args.mode == "open":
            result = await run_open_loop(specs, args.target, concurrency_cap=args.concurrency, **common)
        else:
            result = await run_closed_loop(specs, args.target, users=args.concurrency, **common)
    finally:
        progress.close()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    summary = result.summary()
    verdicts = check_slos(summary, slos)
    client = result.client_check(slo_lag_bound_s(slos))
    note = None if client is None else client.note()
    ended = summary.requests - summary.cancelled
    interrupted = (
        f"stopped by {received[0].name}: {ended} of {len(specs)} requests ended, {summary.cancelled} "
        f"in flight cancelled, {len(specs) - summary.requests} never sent: partial results"
        if received
        else None
    )
    slo_met = all(v["met"] for v in verdicts)
    cut = summary.cancelled if result.stop_reason == "max_duration" else 0
    cut_note = (
        f"--max-duration-s {args.max_duration_s:g} cut the run: {cut} requests in flight cancelled (the "
        f"slowest, missing from every figure), {len(specs) - summary.requests} never sent"
        if cut
        else None
    )
    invalid = "; ".join(text for text in (cut_note, note) if text) or None
    report = {
        "kvlb_loadtest_target": 1,
        "meta": _meta(args, argv, started_at, load_average, workload.name, len(specs))
        | {"target": target, "model": model, "headers": sorted(headers), "stop_reason": result.stop_reason},
        "status": "interrupted" if interrupted else "invalid" if invalid else "ok",
        "note": interrupted or invalid,
        "client": no_schedule() if client is None else client.to_dict(),
        "summary": summary.to_dict(),
        "errors_by_kind": errors_by_kind(result.records),
        "cached_tokens_implausible": implausible_cached(result.records),
        "slo": verdicts,
        "slo_met": slo_met,
        "errors": error_sample(result),
    }
    write_report(report, result, summary, out, plots=not args.no_plots)
    print(f"report: {out / 'report.md'} and {out / 'report.json'}", file=sys.stderr)
    if received:
        print(f"kvlb loadtest: {interrupted}", file=sys.stderr)
        return EXIT_INTERRUPTED + received[0].value
    code = exit_code(summary.ok, slo_met, note is not None, bool(slos), cut_short=cut_note is not None)
    if summary.ok == 0:
        print("kvlb loadtest: no request succeeded", file=sys.stderr)
    elif code == EXIT_CUT_SHORT:
        print(f"kvlb loadtest: the SLOs were met, but not over every request: {cut_note}", file=sys.stderr)
    elif code == EXIT_CLIENT_BEHIND:
        print(
            f"kvlb loadtest: the SLOs were met, but the client could not send the offered rate: {note}",
            file=sys.stderr,
        )
    elif invalid:
        print(f"kvlb loadtest: {invalid}", file=sys.stderr)
    return code


def _meta(
    args: argparse.Namespace,
    argv: Sequence[str],
    started_at: str,
    load_average: list[float],
    workload: str,
    requests: int,
) -> dict[str, Any]:
    """The part of a report's ``meta`` every run has (the caller adds the target, model, headers and
    stop reason); the command line with its secrets masked."""
    return {
        "command": "kvlb loadtest " + " ".join(shlex.quote(a) for a in redact_argv(argv)),
        "started": started_at,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average": load_average,
        "workload": workload,
        "mode": args.mode,
        "rate_per_s": args.rate,
        "concurrency": args.concurrency,
        "requests": requests,
    }


def _no_run(
    args: argparse.Namespace,
    argv: Sequence[str],
    out: Path,
    reason: str,
    workload: str,
    requests: int,
    slos: Sequence[Slo],
    started_at: str,
    load_average: list[float],
) -> int:
    """The report of a run that could not start (``GET /v1/models`` named no model): status
    ``invalid``, ``note`` the reason, no request, every SLO missed (no data is no pass); exit 1."""
    result = RunResult(args.mode, (), 0.0, "specs")
    summary = result.summary()
    verdicts = check_slos(summary, slos)
    report = {
        "kvlb_loadtest_target": 1,
        "meta": _meta(args, argv, started_at, load_average, workload, requests)
        | {"target": redact_url(args.target), "model": None, "headers": sorted(target_headers(args))}
        | {"stop_reason": "no_model"},
        "status": "invalid",
        "note": f"no request sent: {reason}",
        "client": no_schedule(),
        "summary": summary.to_dict(),
        "errors_by_kind": {},
        "cached_tokens_implausible": 0,
        "slo": verdicts,
        "slo_met": all(v["met"] for v in verdicts),
        "errors": [],
    }
    write_report(report, result, summary, out, plots=False)
    print(f"report: {out / 'report.md'} and {out / 'report.json'}", file=sys.stderr)
    print(f"kvlb loadtest: {reason}", file=sys.stderr)
    return 1
