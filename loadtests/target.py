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
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.client_lag import LATENCY_SLO_PREFIXES, lag_bound_s, no_schedule, summary_line
from loadtests.driver import REPLICA_HEADER, RunResult, run_closed_loop, run_open_loop
from loadtests.runs import Progress
from loadtests.stats import SUMMARY_FIELDS, Summary

EXIT_SLO_MISSED = 3
"""Exit code when the run completed but missed an SLO (1: the run failed, 2: bad arguments)."""

EXIT_CLIENT_BEHIND = 4
"""Exit code when every SLO was met but the client fell behind its schedule: no pass at a rate the
client never sent."""

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


def exit_code(ok_requests: int, slo_met: bool, client_behind: bool, gated: bool) -> int:
    """1 when no request succeeded; :data:`EXIT_SLO_MISSED` when an SLO was missed (also with the
    client behind: missed under less load than offered is missed); :data:`EXIT_CLIENT_BEHIND` when
    the SLOs (``gated``: there are some) were met by a client behind its schedule; else 0."""
    if ok_requests == 0:
        return 1
    if not slo_met:
        return EXIT_SLO_MISSED
    return EXIT_CLIENT_BEHIND if gated and client_behind else 0


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--target", metavar="URL",
        help="drive this OpenAI-compatible endpoint (a deployed kvlb, a peer router, a bare engine) "
        "instead of an emulated fleet: nothing is started or flushed")  # fmt: skip
    add("--model", help="--target: the model name to send (default: the first of GET /v1/models)")
    add("--header", action="append", default=[], metavar="NAME:VALUE",
        help="--target: a header on every request, e.g. 'authorization: Bearer $TOKEN' "
        "(repeatable)")  # fmt: skip
    add("--replica-header", default=REPLICA_HEADER,
        help=f"--target: the response header naming the replica (default {REPLICA_HEADER})")  # fmt: skip
    add("--slo", action="append", default=[], metavar="NAME=VALUE",
        help="--target: an objective, e.g. ttft_p90_s=2s, error_rate=0.001, hit_rate=0.5 (repeatable); "
        f"a missed one makes the command exit {EXIT_SLO_MISSED}, and met ones exit "
        f"{EXIT_CLIENT_BEHIND} when the client fell behind its schedule (no pass at a rate it never "
        "sent)")  # fmt: skip


def parse_headers(pairs: Sequence[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header expects NAME:VALUE, got {pair!r}")
        headers[name.strip()] = value.strip()
    return headers


async def first_model(session: aiohttp.ClientSession, base: str, headers: Mapping[str, str]) -> str:
    url = base.rstrip("/").removesuffix("/v1") + "/v1/models"
    async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as response:
        if response.status != 200:
            raise ValueError(f"GET {url}: HTTP {response.status}; pass --model")
        data = await response.json()
    models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
    if not models or not isinstance(models[0], str):
        raise ValueError(f"GET {url} lists no model; pass --model")
    return models[0]


async def target_campaign(args: argparse.Namespace, argv: Sequence[str], out: Path) -> int:
    """Drive ``args.workload`` at ``args.target`` and write the report to ``out``."""
    from loadtests.command import build_specs, build_workload  # the shared workload options

    slos = [parse_slo(text) for text in args.slo]
    headers = parse_headers(args.header)
    load_average = [round(x, 2) for x in os.getloadavg()]
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    async with aiohttp.ClientSession() as session:
        model = args.model or await first_model(session, args.target, headers)
    workload = build_workload(args, args.kv_capacity_tokens, args.replicas)
    specs = build_specs(workload, args)
    progress = Progress(f"{args.workload} → target", len(specs))
    common: dict[str, Any] = {
        "model": model,
        "max_requests": len(specs),
        "max_duration_s": args.max_duration_s,
        "timeout_s": args.timeout_s,
        "headers": headers,
        "on_progress": progress.update,
        "replica_header": args.replica_header,
    }
    try:
        if args.mode == "open":
            result = await run_open_loop(specs, args.target, concurrency_cap=args.concurrency, **common)
        else:
            result = await run_closed_loop(specs, args.target, users=args.concurrency, **common)
    finally:
        progress.close()
    summary = result.summary()
    verdicts = check_slos(summary, slos)
    client = result.client_check(slo_lag_bound_s(slos))
    note = None if client is None else client.note()
    slo_met = all(v["met"] for v in verdicts)
    report = {
        "kvlb_loadtest_target": 1,
        "meta": {
            "command": "kvlb loadtest " + " ".join(shlex.quote(a) for a in argv),
            "started": started_at,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_average": load_average,
            "target": args.target,
            "model": model,
            "workload": workload.name,
            "mode": args.mode,
            "rate_per_s": args.rate,
            "concurrency": args.concurrency,
            "requests": len(specs),
            "stop_reason": result.stop_reason,
        },
        "status": "invalid" if note else "ok",
        "note": note,
        "client": no_schedule() if client is None else client.to_dict(),
        "summary": summary.to_dict(),
        "slo": verdicts,
        "slo_met": slo_met,
        "errors": _error_sample(result),
    }
    write_report(report, result, summary, out)
    print(f"report: {out / 'report.md'} and {out / 'report.json'}", file=sys.stderr)
    code = exit_code(summary.ok, slo_met, note is not None, bool(slos))
    if summary.ok == 0:
        print("kvlb loadtest: no request succeeded", file=sys.stderr)
    elif code == EXIT_CLIENT_BEHIND:
        print(
            f"kvlb loadtest: the SLOs were met, but the client could not send the offered rate: {note}",
            file=sys.stderr,
        )
    elif note:
        print(f"kvlb loadtest: {note}", file=sys.stderr)
    return code


def write_report(report: Mapping[str, Any], result: RunResult, summary: Summary, out: Path) -> None:
    """``report.json``, ``requests.jsonl``, the plots and ``report.md`` in ``out``; the table on stderr."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    with (out / "requests.jsonl").open("w", encoding="utf-8") as sink:
        for record in result.records:
            sink.write(json.dumps(record.to_dict()) + "\n")
    plots, note = write_target_plots(result, summary, out)
    (out / "report.md").write_text(markdown(report, plots, note), encoding="utf-8")
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
    if client.get("client_behind") is None:  # no schedule
        return []
    lines = [summary_line(client)]
    if report.get("note"):
        lines.append(f"INVALID: {report['note']}")
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
    client = _client_lines(report)
    if client:
        lines += ["", f"The {client[0]}."]
    if len(client) > 1:
        lines += ["", f"**Invalid at the offered rate**: {report['note']}."]
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
            f"- `{e['request_id']}`: {e['outcome']} {e['status']} {e['error']}" for e in report["errors"]
        ]
    lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


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
