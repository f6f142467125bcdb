"""The load-test report: JSON, markdown and the targets of the issue (pure but for the file writers).

Per router the report gives TTFT p50/p90/p99, ITL and e2e, output tok/s and req/s, the hit rate
from the replicas' own ``cached_tokens`` counters (and the one the client saw in ``usage``), the
per-replica request counts and two imbalances, errors; then ratios against ``round_robin`` and
against the best peer (the peer with the lowest TTFT p90), and the targets of the workload.

Definitions (the rest are :mod:`loadtests.stats`'):

- ``hit_rate``: Σ replica ``cached_tokens_total`` / Σ ``prompt_tokens_total`` over the run (counter
  differences); ``client_hit_rate``: the same from the streamed ``usage`` (``None`` if not passed).
- ``request_imbalance``: max / mean of requests per replica (replica counters); 1.0 is even.
- ``load_imbalance``: the time average, over load samples where the fleet is busy, of max / mean of
  ``running + waiting`` per replica.
- ``oracle_fraction``: ``hit_rate`` / the oracle's bound (:mod:`loadtests.oracle`).
- ``client_*``: the open-loop client against its schedule (:mod:`loadtests.client_lag`, wall time:
  sent against scheduled rate, lag p50/p90/max, slot waits, ``client_behind``); a router whose client
  fell behind is ``invalid`` at the offered rate, with the reason in ``note``. ``None`` in the closed
  loop.
- ``replicas_per_group``: the mean number of distinct replicas that served one prefix group (a
  ``tenant`` tag where the workload sets one, else a session); 1.0 is perfect affinity, a high value
  means copies of the same context on many replicas. ``None`` without groups or replica headers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.atomic_files import write_lines_atomic, write_text_atomic
from loadtests.client_lag import FIELDS as CLIENT_FIELDS
from loadtests.client_lag import no_schedule
from loadtests.runs import RouterRun
from loadtests.stats import RequestRecord, ratio

REPORT_VERSION = 1

ROUTER_FIELDS: tuple[str, ...] = (
    "name", "kind", "policy", "status", "note",
    "requests", "ok", "errors", "error_rate", "timeouts", "cancelled", "duration_s",
    "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s",
    "e2e_p50_s", "e2e_p90_s", "e2e_p99_s", "output_tok_per_s", "req_per_s",
    "hit_rate", "client_hit_rate", "oracle_fraction", "replica_requests",
    "request_imbalance", "load_imbalance", "replicas_per_group", "prediction", "vs_round_robin",
    "vs_best_peer", *CLIENT_FIELDS,
)  # fmt: skip
"""Keys of every router entry in the JSON report (values may be ``None`` for a router that did not run)."""

RATIO_FIELDS: tuple[str, ...] = (
    "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "e2e_p90_s", "output_tok_per_s", "req_per_s",
    "hit_rate",
)  # fmt: skip
"""Fields compared against round-robin and the best peer (this router / the other)."""

_SUMMARY_KEYS = (
    "requests", "ok", "errors", "error_rate", "timeouts", "cancelled", "duration_s",
    "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s",
    "e2e_p50_s", "e2e_p90_s", "e2e_p99_s", "output_tok_per_s", "req_per_s",
)  # fmt: skip


def _replica_figures(run: RouterRun) -> dict[str, Any]:
    delta = run.replica_delta
    prompt = sum(d["prompt_tokens_total"] for d in delta.values())
    cached = sum(d["cached_tokens_total"] for d in delta.values())
    requests = {name: int(d["requests_total"]) for name, d in sorted(delta.items())}
    mean = sum(requests.values()) / len(requests) if requests else 0
    return {
        "hit_rate": ratio(cached, prompt),
        "replica_requests": requests,
        "request_imbalance": ratio(max(requests.values()), mean) if requests and mean else None,
    }


def replicas_per_group(records: Sequence[RequestRecord]) -> float | None:
    """Mean distinct replicas per prefix group: the ``tenant`` tag, else the session id."""
    groups: dict[str, set[str]] = {}
    for record in records:
        group = record.tag("tenant") or record.session_id
        if group is not None and record.replica:
            groups.setdefault(group, set()).add(record.replica)
    return sum(len(replicas) for replicas in groups.values()) / len(groups) if groups else None


def load_imbalance(series: Mapping[str, Sequence[tuple[float, float, float]]]) -> float | None:
    """Time-averaged max/mean of ``running + waiting`` over samples where the fleet had work."""
    columns = [list(samples) for samples in series.values() if samples]
    if not columns:
        return None
    values = []
    for row in zip(*columns, strict=False):
        loads = [running + waiting for _, running, waiting in row]
        mean = sum(loads) / len(loads)
        if mean > 0:
            values.append(max(loads) / mean)
    return sum(values) / len(values) if values else None


def router_entry(run: RouterRun, oracle_hit_rate: float | None) -> dict[str, Any]:
    """One router's JSON entry (ratios are filled in by :func:`add_ratios`)."""
    entry: dict[str, Any] = {
        "name": run.spec.name,
        "kind": run.spec.kind,
        "policy": run.spec.policy,
        "status": run.status,
        "note": run.note,
    }
    summary = run.summary.to_dict() if run.summary is not None else {}
    entry.update({key: summary.get(key) for key in _SUMMARY_KEYS})
    client = run.result.client_check() if run.status == "ok" and run.result is not None else None
    entry.update(no_schedule() if client is None else client.to_dict())
    reasons = [r for r in (invalid_reason(run), client.note() if client else None) if r is not None]
    if reasons:
        entry["status"] = "invalid"
        entry["note"] = "; ".join(reasons)
    figures = _replica_figures(run) if run.replica_delta else {}
    entry["hit_rate"] = figures.get("hit_rate")
    entry["client_hit_rate"] = summary.get("hit_rate")
    entry["oracle_fraction"] = ratio(entry["hit_rate"], oracle_hit_rate)
    entry["replica_requests"] = figures.get("replica_requests")
    entry["request_imbalance"] = figures.get("request_imbalance")
    entry["load_imbalance"] = load_imbalance(run.load_series) if run.load_series else None
    records = run.result.records if run.result is not None else ()
    entry["replicas_per_group"] = replicas_per_group(records)
    entry["prediction"] = run.prediction
    entry["evicted_blocks"] = sum(d.get("evicted_blocks_total", 0) for d in run.replica_delta.values())
    entry["vs_round_robin"] = None
    entry["vs_best_peer"] = None
    entry["wall_s"] = run.wall_s
    entry["summary"] = summary
    entry["ttft_s"] = sorted(r.ttft_s for r in records if r.ok and r.ttft_s is not None)
    entry["load_series"] = {name: [list(s) for s in samples] for name, samples in run.load_series.items()}
    entry["load_samples_dropped"] = run.samples_dropped
    return entry


MAX_VALID_ERROR_RATE = 0.01
"""A router whose run failed more than this share of its requests is reported invalid, not compared:
a broken harness (a peer refusing the prompt format, say), not a result."""


def invalid_reason(run: RouterRun) -> str | None:
    """Why a finished run is invalid (more than :data:`MAX_VALID_ERROR_RATE` of its requests failed),
    with the commonest failures; ``None`` when it is valid or did not run."""
    if run.status != "ok" or run.summary is None or not run.summary.requests:
        return None
    failed = run.summary.requests - run.summary.ok
    if failed / run.summary.requests <= MAX_VALID_ERROR_RATE:
        return None
    kinds: dict[str, int] = {}
    records = run.result.records if run.result is not None else ()
    for record in records:
        if not record.ok:
            kind = f"HTTP {record.status}" if record.status else record.outcome
            kinds[kind] = kinds.get(kind, 0) + 1
    common = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:3])
    return (
        f"invalid run: {failed} of {run.summary.requests} requests failed "
        f"(> {MAX_VALID_ERROR_RATE:.0%}){': ' + common if common else ''}"
    )


def best_peer(entries: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The peer that ran with the lowest TTFT p90."""
    peers = [
        e for e in entries if e["kind"] != "kvlb" and e["status"] == "ok" and e["ttft_p90_s"] is not None
    ]
    return min(peers, key=lambda e: e["ttft_p90_s"]) if peers else None


def _ratios(entry: Mapping[str, Any], other: Mapping[str, Any] | None) -> dict[str, float | None] | None:
    if other is None or entry["status"] != "ok":
        return None
    return {key: ratio(entry[key], other[key]) for key in RATIO_FIELDS}


def add_ratios(entries: list[dict[str, Any]]) -> str | None:
    """Fill ``vs_round_robin`` and ``vs_best_peer``; returns the best peer's name."""
    base = next((e for e in entries if e["name"] == "round_robin" and e["status"] == "ok"), None)
    peer = best_peer(entries)
    for entry in entries:
        entry["vs_round_robin"] = _ratios(entry, base)
        entry["vs_best_peer"] = _ratios(entry, peer)
    return None if peer is None else str(peer["name"])


def _find(entries: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    return next((e for e in entries if e["name"] == name and e["status"] == "ok"), None)


def _target(name: str, value: float | None, threshold: float, at_most: bool, detail: str) -> dict[str, Any]:
    met = None if value is None else (value <= threshold if at_most else value >= threshold)
    return {
        "name": name,
        "value": value,
        "threshold": threshold,
        "at_most": at_most,
        "met": met,
        "detail": detail,
    }


def targets(
    workload: str, entries: Sequence[Mapping[str, Any]], oracle_hit_rate: float | None
) -> list[dict[str, Any]]:
    """The issue's targets for ``workload`` (``met`` is ``None`` when a figure is missing)."""
    kvlb, rr = _find(entries, "kvlb"), _find(entries, "round_robin")

    def get(entry: Mapping[str, Any] | None, key: str) -> float | None:
        return None if entry is None else entry.get(key)

    peers = [e for e in entries if e["kind"] != "kvlb" and e["status"] == "ok"]
    peer_ttft = min((e["ttft_p90_s"] for e in peers if e["ttft_p90_s"] is not None), default=None)
    peer_tput = max((e["output_tok_per_s"] for e in peers if e["output_tok_per_s"] is not None), default=None)
    result = []
    if workload == "tenants":
        result.append(
            _target(
                "ttft_p90 kvlb / round_robin",
                ratio(get(kvlb, "ttft_p90_s"), get(rr, "ttft_p90_s")),
                0.1,
                True,
                "TTFT p90",
            )
        )
        result.append(
            _target(
                "ttft_p90 kvlb / better peer",
                ratio(get(kvlb, "ttft_p90_s"), peer_ttft),
                0.5,
                True,
                "peer with the lower TTFT p90",
            )
        )
        result.append(
            _target(
                "output tok/s kvlb / better peer",
                ratio(get(kvlb, "output_tok_per_s"), peer_tput),
                1.2,
                False,
                "peer with the higher output tok/s",
            )
        )
        result.append(
            _target(
                "hit rate kvlb / oracle",
                ratio(get(kvlb, "hit_rate"), oracle_hit_rate),
                0.9,
                False,
                "replica-side hit rate over the oracle bound",
            )
        )
    elif workload == "unique":
        ll = _find(entries, "least_load")
        result.append(
            _target(
                "ttft_p90 kvlb / least_load",
                ratio(get(kvlb, "ttft_p90_s"), get(ll, "ttft_p90_s")),
                1.05,
                True,
                "within 5% (or better)",
            )
        )
    elif workload == "mooncake":
        result.append(
            _target(
                "ttft_p90 kvlb / round_robin",
                ratio(get(kvlb, "ttft_p90_s"), get(rr, "ttft_p90_s")),
                0.2,
                True,
                "TTFT p90",
            )
        )
    prediction = kvlb.get("prediction") if kvlb is not None else None
    if prediction:
        result.append(
            _target(
                "kvlb predictions within one block",
                prediction.get("within_one_block_share"),
                0.98,
                False,
                "share of responses whose cached_tokens were within one block of the prediction",
            )
        )
    return result  # fmt: skip


def build_report(
    meta: Mapping[str, Any], oracle: Mapping[str, Any] | None, runs: Sequence[RouterRun]
) -> dict[str, Any]:
    """The whole JSON report."""
    oracle_rate = None if oracle is None else oracle.get("hit_rate")
    entries = [router_entry(run, oracle_rate) for run in runs]
    peer = add_ratios(entries)
    return {
        "kvlb_loadtest": REPORT_VERSION,
        "meta": dict(meta),
        "oracle": None if oracle is None else dict(oracle),
        "best_peer": peer,
        "routers": entries,
        "targets": targets(str(meta.get("workload", {}).get("name", "")), entries, oracle_rate),
    }  # fmt: skip


def write_json(report: Mapping[str, Any], path: Path) -> None:
    write_text_atomic(path, json.dumps(report, indent=1, sort_keys=False) + "\n")


def write_records(runs: Sequence[RouterRun], out: Path) -> list[Path]:
    """Every request's record, one JSON line each, in ``requests-<router>.jsonl`` (for later analysis)."""
    paths = []
    for run in runs:
        if run.result is None:
            continue
        safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in run.spec.name)
        path = out / f"requests-{safe}.jsonl"
        write_lines_atomic(path, (json.dumps(record.to_dict()) + "\n" for record in run.result.records))
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------ markdown


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f}" if value >= 0.1 else f"{value * 1000:.1f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _client_cell(e: Mapping[str, Any]) -> str:
    """The client's sent / scheduled rate, bold when it fell behind."""
    if e.get("client_behind") is None:  # no schedule
        return "–"
    sent, scheduled = e.get("client_sent_rate_per_s"), e.get("client_scheduled_rate_per_s")
    cell = f"{_num(sent)} / {_num(scheduled)}"
    return f"**{cell} behind**" if e.get("client_behind") else cell


def _router_rows(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = [
        "| router | ok / sent | errors | TTFT p50 / p90 / p99 ms | ITL p50 / p90 ms | e2e p50 / p90 ms "
        "| out tok/s | req/s | hit rate (replicas) | hit rate (usage) | of oracle | req imbalance "
        "| load imbalance | replicas per group | client sent / scheduled req/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        if e["status"] != "ok" and not e.get("client_behind"):
            rows.append(f"| {e['name']} | {e['status']}: {e['note']} |" + " |" * 13)
            continue
        name = e["name"] if e["status"] == "ok" else f"{e['name']} (**{e['status']}**)"
        rows.append(
            f"| {name} | {e['ok']} / {e['requests']} | {e['errors']} "
            f"| {_ms(e['ttft_p50_s'])} / {_ms(e['ttft_p90_s'])} / {_ms(e['ttft_p99_s'])} "
            f"| {_ms(e['itl_p50_s'])} / {_ms(e['itl_p90_s'])} "
            f"| {_ms(e['e2e_p50_s'])} / {_ms(e['e2e_p90_s'])} "
            f"| {_num(e['output_tok_per_s'], 0)} | {_num(e['req_per_s'])} | {_pct(e['hit_rate'])} "
            f"| {_pct(e['client_hit_rate'])} | {_pct(e['oracle_fraction'])} | {_num(e['request_imbalance'])} "
            f"| {_num(e['load_imbalance'])} | {_num(e.get('replicas_per_group'))} | {_client_cell(e)} |"
        )
    return rows


def client_warnings(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per router whose client fell behind its schedule (its figures are no measurement
    at the offered rate)."""
    return [
        f"- **{e['name']}**: {e['note']}; lag p50 / p90 / max {_ms(e['client_lag_p50_s'])} / "
        f"{_ms(e['client_lag_p90_s'])} / {_ms(e['client_lag_max_s'])} ms"
        for e in entries
        if e.get("client_behind")
    ]


def _prediction_rows(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """kvlb's receipts: each response's cached_tokens against the route's prediction."""
    rows = [
        "| router | receipts | exact | within one block | stale blocks | dropped | learned "
        "| blocks the replicas evicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        p = e.get("prediction")
        if p:
            rows.append(
                f"| {e['name']} | {p['receipts']:.0f} | {_num(p['exact_share'], 4)} "
                f"| {_num(p['within_one_block_share'], 4)} | {p['stale_blocks']:.0f} "
                f"| {p['dropped_blocks']:.0f} | {p['learned_blocks']:.0f} "
                f"| {e.get('evicted_blocks', 0):.0f} |"
            )
    return rows if len(rows) > 2 else []


def _ratio_rows(entries: Sequence[Mapping[str, Any]], key: str) -> list[str]:
    rows = [
        "| router | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | e2e p90 | out tok/s | req/s | hit rate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        ratios = e.get(key)
        if ratios:
            rows.append(f"| {e['name']} | " + " | ".join(_num(ratios[k]) for k in RATIO_FIELDS) + " |")
    return rows


def _target_rows(rows_in: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = ["| target | measured | needed | met |", "|---|---|---|---|"]
    for t in rows_in:
        needed = ("≤ " if t["at_most"] else "≥ ") + f"{t['threshold']:g}"
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
        rows.append(f"| {t['name']} ({t['detail']}) | {_num(t['value'], 3)} | {needed} | {met} |")
    return rows


def markdown(report: Mapping[str, Any], plots: Sequence[str], plots_note: str | None) -> str:
    """The human report: set-up, per-router table, ratio tables, targets, plots."""
    meta, oracle, entries = report["meta"], report["oracle"], report["routers"]
    lines = ["# kvlb load test", "", f"`{meta.get('command', '')}`", ""]
    lines += [
        f"- started: {meta.get('started')}, finished: {meta.get('finished', '?')}; "
        f"load average before: {meta.get('load_average')}"
    ]
    lines += [f"- fleet: {json.dumps(meta.get('fleet'))}", f"- workload: {json.dumps(meta.get('workload'))}"]
    lines += [f"- drive: {json.dumps(meta.get('drive'))}"]
    if oracle:
        lines += [
            f"- oracle: hit rate ≤ {_pct(oracle.get('hit_rate'))} with the fleet's KV capacity "
            f"({oracle.get('capacity_blocks')} blocks pooled); infinite cache "
            f"{_pct(oracle.get('unbounded_hit_rate'))}; "
            f"prefix demand {oracle.get('distinct_blocks')} blocks. "
            f"Method: {oracle.get('method')}."
        ]
    lines += ["", "## Routers", "", *_router_rows(entries), ""]
    warnings = client_warnings(entries)
    if warnings:
        section = "The client's schedule in every report"
        lines += [f'The client fell behind its schedule (docs/loadtest.md, "{section}"):', "", *warnings, ""]
    prediction = _prediction_rows(entries)
    if prediction:
        lines += ["## Prediction (kvlb's receipts: cached_tokens against the route's prediction)", ""]
        lines += [*prediction, ""]
    lines += ["## Ratios against round_robin", "", *_ratio_rows(entries, "vs_round_robin"), ""]
    if report.get("best_peer"):
        lines += [f"## Ratios against the best peer ({report['best_peer']})", ""]
        lines += [*_ratio_rows(entries, "vs_best_peer"), ""]
    if report.get("targets"):
        lines += ["## Targets", "", *_target_rows(report["targets"]), ""]
    lines += ["## Plots", ""]
    lines += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    if plots_note:
        lines.append(plots_note)
    return "\n".join(lines) + "\n"


def write_markdown(
    report: Mapping[str, Any], path: Path, plots: Sequence[str], plots_note: str | None
) -> None:
    write_text_atomic(path, markdown(report, plots, plots_note))
