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
with one line). Secrets stay out of the outputs: ``--header`` values and a password in the URL are
written as ``***`` in the report, the table and the messages (:func:`redact_argv`,
:func:`redact_url`), and ``--api-key-env VAR`` sends ``Authorization: Bearer`` with the key read from
the environment, so that it is not on the command line either. SIGINT or SIGTERM mid-run stops
launching, cancels what is in flight (recorded ``cancelled``), writes the partial report (status
``interrupted``) and exits :data:`EXIT_INTERRUPTED` + the signal's number (130, 143).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from loadtests.client_lag import LATENCY_SLO_PREFIXES, lag_bound_s, no_schedule, summary_line
from loadtests.driver import REPLICA_HEADER, RunResult, run_closed_loop, run_open_loop
from loadtests.runs import Progress
from loadtests.stats import SUMMARY_FIELDS, RequestRecord, Summary, implausible_cached

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

SECRET_MASK = "***"
"""What a header value or a URL's password is written as in the outputs."""

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
        f"no request succeeded, 2 for bad arguments, {EXIT_INTERRUPTED} + the signal (130, 143) after "
        "SIGINT or SIGTERM (the partial report is written)")  # fmt: skip


def parse_headers(pairs: Sequence[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header expects NAME:VALUE, got {redact_header(pair)!r}")
        headers[name.strip()] = value.strip()
    return headers


def redact_header(pair: str) -> str:
    """``NAME:VALUE`` as ``NAME:***`` (the whole text masked when it has no colon)."""
    name, sep, _ = pair.partition(":")
    return f"{name}:{SECRET_MASK}" if sep else SECRET_MASK


def redact_url(url: str) -> str:
    """``url`` with the password of its user info written as ``***`` (the rest unchanged)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:{SECRET_MASK}@{netloc}"))


def redact_argv(argv: Iterable[str]) -> list[str]:
    """The command line with ``--header`` values and URL passwords masked: fit for a report."""
    redacted: list[str] = []
    after_header = False
    for arg in argv:
        if after_header:
            redacted.append(redact_header(arg))
        elif arg.startswith("--header="):
            redacted.append("--header=" + redact_header(arg.removeprefix("--header=")))
        else:
            redacted.append(redact_url(arg))
        after_header = arg == "--header"
    return redacted


def check_target_url(url: str) -> None:
    """``ValueError`` unless ``url`` is ``http(s)://host[:port][/prefix]`` (no query or fragment)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"--target {redact_url(url)!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"--target expects http://HOST:PORT or https://HOST:PORT, with an optional path prefix "
            f"such as /v1; got {redact_url(url)!r}"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"--target {redact_url(url)!r}: no query or fragment (requests append a path)")
    if parts.path.rstrip("/").endswith(("/completions", "/models")):
        raise ValueError(
            f"--target {redact_url(url)!r} names an endpoint; give the base URL (http://HOST:PORT or "
            "http://HOST:PORT/prefix/v1): the workload appends /v1/chat/completions or /v1/completions"
        )
    del port


def target_headers(args: argparse.Namespace) -> dict[str, str]:
    """Every request's headers: ``--header`` and, with ``--api-key-env VAR``, the bearer key of
    ``$VAR``. ``ValueError`` for a malformed header, an unset or empty ``VAR``, or two sources of
    credentials (the URL's user info, ``--api-key-env``, an ``Authorization`` header)."""
    headers = parse_headers(args.header)
    sources = [name for name in headers if name.lower() == "authorization"]
    if getattr(args, "api_key_env", None):
        key = os.environ.get(args.api_key_env, "").strip()
        if not key:
            raise ValueError(f"--api-key-env {args.api_key_env}: the variable is not set or empty")
        sources.append(f"--api-key-env {args.api_key_env}")
        headers["Authorization"] = f"Bearer {key}"
    if args.target and urlsplit(args.target).username is not None:
        sources.append("the URL's user info")
    if len(sources) > 1:
        raise ValueError(f"credentials given twice ({', '.join(sources)}): keep one")
    return headers


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


async def first_model(session: aiohttp.ClientSession, base: str, headers: Mapping[str, str]) -> str:
    """The first model of ``GET /v1/models``; ``ValueError`` (saying to pass ``--model``) when the
    target does not answer that with a JSON list of models."""
    url = base.rstrip("/").removesuffix("/v1") + "/v1/models"
    shown = redact_url(url)
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as response:
            if response.status != 200:
                raise ValueError(f"GET {shown}: HTTP {response.status}; pass --model")
            data = json.loads(await response.content.read(MODELS_BODY_BYTES))
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ValueError(f"GET {shown}: {type(exc).__name__}: {exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"GET {shown}: the answer is not JSON; pass --model") from None
    listed = data.get("data") if isinstance(data, dict) else None
    models = [m.get("id") for m in listed if isinstance(m, dict)] if isinstance(listed, list) else []
    if not models or not isinstance(models[0], str):
        raise ValueError(f"GET {shown} lists no model; pass --model")
    return models[0]


MODELS_BODY_BYTES = 1 << 20
"""Of ``GET /v1/models``' answer, at most this many bytes are read."""


def error_kind(record: RequestRecord) -> str:
    """A failed request's kind: ``http_<status>``, ``timeout``, ``no_done`` (a stream without
    ``data: [DONE]``), ``error_event`` (the server's error in the stream), or the exception's type
    (``ClientPayloadError``: a stream cut; ``JSONDecodeError``: a body that is not JSON;
    ``ClientConnectorError``: no connection)."""
    if record.outcome == "http_error":
        return f"http_{record.status}"
    if record.outcome != "error":
        return record.outcome
    text = record.error or ""
    if text.startswith("stream ended without"):
        return "no_done"
    if text.startswith("server error"):
        return "error_event"
    name, sep, _ = text.partition(":")
    return name if sep and name.isidentifier() else "error"


def errors_by_kind(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Failed requests (``cancelled`` ones apart) counted by :func:`error_kind`, most frequent first."""
    counts = Counter(error_kind(r) for r in records if not r.ok and r.outcome != "cancelled")
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


async def target_campaign(args: argparse.Namespace, argv: Sequence[str], out: Path) -> int:
    """Drive ``args.workload`` at ``args.target`` and write the report to ``out`` (also after SIGINT
    or SIGTERM: the partial one, exit :data:`EXIT_INTERRUPTED` + the signal)."""
    from loadtests.command import build_specs, build_workload  # the shared workload options

    slos = [parse_slo(text) for text in args.slo]
    headers = target_headers(args)
    target = redact_url(args.target)
    load_average = [round(x, 2) for x in os.getloadavg()]
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    async with aiohttp.ClientSession() as session:
        model = args.model or await first_model(session, args.target, headers)
    workload = build_workload(args, args.kv_capacity_tokens, args.replicas)
    specs = build_specs(workload, args)
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
        "meta": {
            "command": "kvlb loadtest " + " ".join(shlex.quote(a) for a in redact_argv(argv)),
            "started": started_at,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_average": load_average,
            "target": target,
            "model": model,
            "workload": workload.name,
            "mode": args.mode,
            "rate_per_s": args.rate,
            "concurrency": args.concurrency,
            "requests": len(specs),
            "headers": sorted(headers),
            "stop_reason": result.stop_reason,
        },
        "status": "interrupted" if interrupted else "invalid" if invalid else "ok",
        "note": interrupted or invalid,
        "client": no_schedule() if client is None else client.to_dict(),
        "summary": summary.to_dict(),
        "errors_by_kind": errors_by_kind(result.records),
        "cached_tokens_implausible": implausible_cached(result.records),
        "slo": verdicts,
        "slo_met": slo_met,
        "errors": _error_sample(result),
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


def write_report(
    report: Mapping[str, Any], result: RunResult, summary: Summary, out: Path, *, plots: bool = True
) -> None:
    """``report.json``, ``requests.jsonl``, the plots (unless not ``plots``) and ``report.md`` in
    ``out``; the table on stderr."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    with (out / "requests.jsonl").open("w", encoding="utf-8") as sink:
        for record in result.records:
            sink.write(json.dumps(record.to_dict()) + "\n")
    drawn, note = write_target_plots(result, summary, out) if plots else ([], "Plots skipped (--no-plots).")
    (out / "report.md").write_text(markdown(report, drawn, note), encoding="utf-8")
    print(table(report), file=sys.stderr)


def _error_sample(result: RunResult, limit: int = 10) -> list[dict[str, Any]]:
    """The first ``limit`` failures (outcome, status, reason), so a report says why."""
    failed = [r for r in result.records if not r.ok]
    return [
        {"request_id": r.request_id, "outcome": r.outcome, "status": r.status, "error": r.error}
        for r in failed[:limit]
    ]


def _fmt(value: Any, name: str) -> str:
    if value is None:
        return "—"
    if name.endswith("_s") and not name.endswith("_per_s") and name != "duration_s":  # a time
        return f"{value * 1000:.0f} ms"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


_TABLE_FIELDS = (
    "requests", "ok", "errors", "error_rate", "req_per_s", "output_tok_per_s",
    "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s", "e2e_p50_s", "e2e_p90_s", "e2e_p99_s",
    "hit_rate", "imbalance",
)  # fmt: skip


def table(report: Mapping[str, Any]) -> str:
    """The figures and SLO verdicts as a plain-text table (what the command prints)."""
    summary = report["summary"]
    lines = [f"target {report['meta']['target']} ({report['meta']['model']}), {report['meta']['workload']}"]
    lines += [f"  {name:<18} {_fmt(summary[name], name)}" for name in _TABLE_FIELDS]
    for name, share in sorted(summary["replica_share"].items()):
        lines.append(f"  share {name:<12} {share:.3f}")
    lines += [f"  {line}" for line in _client_lines(report)]
    lines += [f"  {line}" for line in _extra_lines(report)]
    for verdict in report["slo"]:
        sign = "≥" if verdict["direction"] == "at_least" else "≤"
        state = "met" if verdict["met"] else "MISSED"
        value = _fmt(verdict["value"], verdict["name"])
        lines.append(
            f"  SLO {verdict['name']} {sign} {_fmt(verdict['bound'], verdict['name'])}: {value} {state}"
        )
    return "\n".join(lines)


def _client_lines(report: Mapping[str, Any]) -> list[str]:
    """The client against its schedule (nothing in the closed loop), and the invalid note."""
    client = report.get("client") or {}
    lines = [] if client.get("client_behind") is None else [summary_line(client)]  # none: no schedule
    if report.get("status") == "invalid" and report.get("note"):
        lines.append(f"INVALID: {report['note']}")
    return lines


def _extra_lines(report: Mapping[str, Any]) -> list[str]:
    """The failures by kind, implausible ``cached_tokens`` and an interruption, in words."""
    lines = []
    kinds = report.get("errors_by_kind") or {}
    if kinds:
        lines.append("errors by kind: " + ", ".join(f"{kind} {count}" for kind, count in kinds.items()))
    implausible = report.get("cached_tokens_implausible") or 0
    if implausible:
        lines.append(
            f"{implausible} answers reported more cached_tokens than prompt_tokens (or a negative "
            "count): left out of the hit rate"
        )
    if report.get("status") == "interrupted":
        lines.append(f"INTERRUPTED: {report['note']}")
    return lines


def markdown(report: Mapping[str, Any], plots: Sequence[str], note: str | None) -> str:
    meta, summary = report["meta"], report["summary"]
    lines = [
        f"# Load test of {meta['target']}",
        "",
        f"`{meta['command']}`",
        "",
        f"Model `{meta['model']}`, workload `{meta['workload']}`, {meta['mode']} loop, {meta['requests']} "
        f"requests; started {meta['started']}, load average {meta['load_average']}.",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    lines += [f"| {name} | {_fmt(summary[name], name)} |" for name in _TABLE_FIELDS]
    client = report.get("client") or {}
    if client.get("client_behind") is not None:
        lines += ["", f"The {summary_line(client)}."]
    if report.get("status") == "invalid":
        lines += ["", f"**Invalid at the offered rate**: {report['note']}."]
    if report.get("status") == "interrupted":
        lines += ["", f"**Interrupted**: {report['note']}."]
    kinds = report.get("errors_by_kind") or {}
    if kinds:
        lines += ["", "| error kind | requests |", "|---|---|"]
        lines += [f"| {kind} | {count} |" for kind, count in kinds.items()]
    for line in _extra_lines(report)[1 if kinds else 0 :]:
        if not line.startswith("INTERRUPTED"):
            lines += ["", f"{line}."]
    if summary["replica_share"]:
        lines += ["", "| replica | requests | share |", "|---|---|---|"]
        for name, share in sorted(summary["replica_share"].items()):
            lines.append(f"| {name} | {summary['replica_requests'].get(name, 0)} | {share:.3f} |")
    if report["slo"]:
        lines += ["", "| SLO | bound | value | verdict |", "|---|---|---|---|"]
        for v in report["slo"]:
            sign = "≥" if v["direction"] == "at_least" else "≤"
            verdict = "met" if v["met"] else "**missed**"
            bound, value = _fmt(v["bound"], v["name"]), _fmt(v["value"], v["name"])
            lines.append(f"| {v['name']} | {sign} {bound} | {value} | {verdict} |")
    if report["errors"]:
        lines += ["", "First failures:", ""]
        lines += [
            f"- `{e['request_id']}`: {e['outcome']} {e['status']} {_one_line(e['error'])}"
            for e in report["errors"]
        ]
    lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def _one_line(text: Any) -> str:
    """An error text as one markdown line: whitespace folded, ``<`` escaped (an HTML error page
    would otherwise render as markup, or as nothing)."""
    return " ".join(str(text).split()).replace("<", "&lt;")


def write_target_plots(result: RunResult, summary: Summary, out: Path) -> tuple[list[str], str | None]:
    """``ttft_cdf.png`` and ``replica_share.png`` (matplotlib, when installed)."""
    if importlib.util.find_spec("matplotlib") is None:
        return [], "Plots skipped: matplotlib is not installed (pip install 'kvlb[report]')."
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[str] = []
    ttfts = sorted(r.ttft_s for r in result.records if r.ok and r.ttft_s is not None)
    if ttfts:
        figure, axes = plt.subplots(figsize=(7, 4))
        axes.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post")
        axes.set_xscale("log")
        axes.set_xlabel("TTFT (s, log scale)")
        axes.set_ylabel("fraction of requests")
        axes.set_title("TTFT CDF")
        axes.grid(True, which="both", alpha=0.3)
        figure.tight_layout()
        figure.savefig(out / "ttft_cdf.png", dpi=100)
        plt.close(figure)
        paths.append(str(out / "ttft_cdf.png"))
    if summary.replica_share:
        names = sorted(summary.replica_share)
        figure, axes = plt.subplots(figsize=(7, 4))
        axes.bar(names, [summary.replica_share[n] for n in names])
        axes.set_ylabel("share of requests")
        axes.set_title("Requests per replica (x-kvlb-replica)")
        axes.tick_params(axis="x", rotation=45)
        figure.tight_layout()
        figure.savefig(out / "replica_share.png", dpi=100)
        plt.close(figure)
        paths.append(str(out / "replica_share.png"))
    return paths, None if paths else "Plots skipped: no request succeeded."
