"""The table and the one-line verdict of ``kvlb demo`` (pure: formats a report, no I/O).

Every figure comes from the two runs' :class:`loadtests.stats.Summary` dictionaries (TTFT measured by
the client, hit rate from the ``cached_tokens`` the replicas reported, shares from the
``x-kvlb-replica`` header); nothing here is a constant result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

RUNS: tuple[tuple[str, str], ...] = (("kvlb", "kvlb (cost policy)"), ("round_robin", "round robin"))
"""(run key, column title) in table order."""


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:,.0f} ms"


def _fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _share_of(replica: str) -> Callable[[Mapping[str, Any]], str]:
    def cell(summary: Mapping[str, Any]) -> str:
        share = (summary.get("replica_share") or {}).get(replica, 0.0)
        count = (summary.get("replica_requests") or {}).get(replica, 0)
        return f"{100 * share:.0f}% ({count})"

    return cell


def verdict(kvlb: Mapping[str, Any], round_robin: Mapping[str, Any]) -> str:
    """One line comparing the runs, computed from their figures."""
    p90_a, p90_b = kvlb.get("ttft_p90_s"), round_robin.get("ttft_p90_s")
    p50_a, p50_b = kvlb.get("ttft_p50_s"), round_robin.get("ttft_p50_s")
    parts = []
    if p90_a is not None and p90_b:
        parts.append(f"TTFT p90 = {p90_a / p90_b:.2f}× round robin ({_ms(p90_a)} vs {_ms(p90_b)})")
    if p50_a is not None and p50_b:
        parts.append(f"p50 = {p50_a / p50_b:.2f}×")
    hit_a, hit_b = kvlb.get("hit_rate"), round_robin.get("hit_rate")
    if hit_a is not None and hit_b is not None:
        parts.append(f"prefix-cache hit rate {hit_a:.2f} vs {hit_b:.2f}")
    if not parts:
        return "kvlb vs round robin: no comparable figures (see the errors above)"
    return "kvlb: " + ", ".join(parts)


def format_table(report: Mapping[str, Any]) -> str:
    """The demo's final table plus its verdict line."""
    replicas = [r["id"] for r in report["fleet"]]
    runs = report["runs"]
    width = 22
    head = f"{'':<26}" + "".join(f"{title:>{width}}" for _, title in RUNS)
    rows: list[tuple[str, Callable[[Mapping[str, Any]], str]]] = [
        ("requests ok / sent", lambda s: f"{s['ok']} / {s['requests']}"),
        ("errors", lambda s: str(s["errors"])),
        ("TTFT p50", lambda s: _ms(s["ttft_p50_s"])),
        ("TTFT p90", lambda s: _ms(s["ttft_p90_s"])),
        ("end-to-end p50", lambda s: _ms(s["e2e_p50_s"])),
        ("prefix-cache hit rate", lambda s: _fraction(s["hit_rate"])),
    ]
    rows += [(f"share of {r}", _share_of(r)) for r in replicas]
    lines = [head]
    for label, cell in rows:
        lines.append(f"{label:<26}" + "".join(f"{cell(runs[key]):>{width}}" for key, _ in RUNS))
    lines.append("")
    lines.append(report["verdict"])
    return "\n".join(lines)


def format_header(report: Mapping[str, Any]) -> str:
    """What ran: the fleet and the workload's sizing."""
    fleet = ", ".join(f"{r['id']} {r['engine']} (block {r['block_size']})" for r in report["fleet"])
    work = report["workload"]
    return (
        f"fleet: {fleet}; {work['profile']} timing at time scale {work['time_scale']:g}, "
        f"KV pool {work['replica_kv_tokens']:,} tokens per replica\n"
        f"workload: {work['tenants']} tenants × ({work['context_tokens']:,}-token shared context + "
        f"{work['users_per_tenant']} × {work['question_tokens']}-token questions) = "
        f"{work['prefix_demand_tokens']:,} tokens of prefix demand "
        f"({work['demand_over_replica_kv']:.1f}× one replica's KV); {work['requests']} chat requests "
        f"per run, Poisson {work['rate_per_s']:g} req/s, {work['max_tokens']} output tokens each"
    )
