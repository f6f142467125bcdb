"""``kvlb loadtest --target``'s outputs: ``report.json``, ``requests.jsonl``, ``report.md``, the table
and the plots, and the failures counted by kind (:func:`errors_by_kind`). The report itself is built
by :func:`loadtests.target.target_campaign`.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.atomic_files import save_figure_atomic, write_lines_atomic, write_text_atomic
from loadtests.client_lag import summary_line
from loadtests.driver import RunResult
from loadtests.stats import RequestRecord, Summary


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


def write_report(
    report: Mapping[str, Any], result: RunResult, summary: Summary, out: Path, *, plots: bool = True
) -> None:
    """``report.json``, ``requests.jsonl``, the plots (unless not ``plots``) and ``report.md`` in
    ``out``; the table on stderr."""
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "report.json", json.dumps(report, indent=1) + "\n")
    write_lines_atomic(out / "requests.jsonl", (json.dumps(r.to_dict()) + "\n" for r in result.records))
    drawn, note = write_target_plots(result, summary, out) if plots else ([], "Plots skipped (--no-plots).")
    write_text_atomic(out / "report.md", markdown(report, drawn, note))
    print(table(report), file=sys.stderr)


def error_sample(result: RunResult, limit: int = 10) -> list[dict[str, Any]]:
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
    meta = report["meta"]
    lines = [f"target {meta['target']} ({meta['model'] or 'no model'}), {meta['workload']}"]
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
        f"Model `{meta['model'] or 'none'}`, workload `{meta['workload']}`, {meta['mode']} loop, "
        f"{meta['requests']} requests; started {meta['started']}, load average {meta['load_average']}.",
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
        save_figure_atomic(figure, out / "ttft_cdf.png", dpi=100)
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
        save_figure_atomic(figure, out / "replica_share.png", dpi=100)
        plt.close(figure)
        paths.append(str(out / "replica_share.png"))
    return paths, None if paths else "Plots skipped: no request succeeded."
