"""The report of ``kvlb capacity``: the searches as JSON, markdown and an SVG plot (pure).

:func:`build_report` turns the searches (:mod:`loadtests.capacity.search`) into the report: capacity
per router, its ratio to round robin and to the best peer, and the prefill tokens saved against the
oracle; :func:`markdown` and :func:`svg_plot` render it (an SVG of TTFT p90 against offered rate per
router, with the SLO line).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from loadtests.capacity.band import band_capacity, passing
from loadtests.capacity.search import RatePoint, Search, Slo


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


def build_report(
    meta: Mapping[str, Any],
    slo: Slo,
    searches: Mapping[str, Search],
    peers: Sequence[str],
    *,
    confirmed: Mapping[str, Sequence[RatePoint]] | None = None,
    oracle_bound: Mapping[str, Any] | None = None,
    oracle_saved: Mapping[str, int] | None = None,
    invalid: Mapping[str, str] | None = None,
    bands: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The report: per router its capacity, ratios, saved prefill against the oracle, and points.

    ``peers`` names the routers that count as peers (the best peer is the one of highest capacity).
    ``confirmed`` holds emulated-fleet points per router; ``oracle_bound`` the pooled MIN bound of
    ``loadtests/oracle.py``; ``oracle_saved`` the tokens the simulator's oracle plan
    (``loadtests/simulate/oracle.py``) serves from cache at each router's capacity rate; ``invalid``
    routers whose runs were invalid, with the reason; ``bands`` per router each confirmed rate's
    simulated spread and the fleet's verdict against it (:mod:`loadtests.capacity.band`), from which the row's
    ``band_capacity_sim`` and ``band_capacity_fleet`` (the highest confirmed rate passing below the
    lowest failing one, by pass share ≥ 0.5 of the draws and of the fleet's repeats).
    """
    confirmed = confirmed or {}
    invalid = invalid or {}
    capacities = {name: s.capacity for name, s in searches.items()}
    rr = capacities.get("round_robin")
    # a peer whose fleet runs were invalid (e.g. sglang-router given token ids: HTTP 422) is no
    # measured peer: its simulated search stays in its row, but it is not the best peer
    peer_caps = {p: capacities[p] for p in peers if capacities.get(p) is not None and p not in invalid}
    best_peer = max(peer_caps, key=lambda p: peer_caps[p] or 0.0) if peer_caps else None
    oracle_saved = oracle_saved or {}
    bands = bands or {}
    routers = []
    for name, found in searches.items():
        at = found.point_at(found.capacity)
        saved = at.cached_tokens if at is not None else None
        bound = oracle_saved.get(name)
        pooled = None
        if oracle_bound is not None and at is not None and oracle_bound.get("hit_rate") is not None:
            pooled = ratio(at.hit_rate, oracle_bound["hit_rate"])
        routers.append(
            {
                "name": name,
                "capacity_rate": found.capacity,
                "first_failing_rate": found.first_fail,
                "vs_round_robin": ratio(found.capacity, rr),
                "vs_best_peer": ratio(found.capacity, peer_caps.get(best_peer)) if best_peer else None,
                "ttft_p90_s_at_capacity": at.ttft_p90_s if at else None,
                "ttft_p99_s_at_capacity": at.ttft_p99_s if at else None,
                "hit_rate_at_capacity": at.hit_rate if at else None,
                "prefill_saved_tokens": saved,
                "oracle_saved_tokens": bound,
                "saved_vs_oracle": ratio(saved, bound),
                "hit_rate_vs_pooled_bound": pooled,
                "points": [p.to_dict(slo) for p in found.points],
                "confirmed": [p.to_dict(slo) for p in confirmed.get(name, ())],
                "invalid": invalid.get(name),
                "band": [dict(b) for b in bands.get(name, ())],
                "band_capacity_sim": band_capacity([(b["rate"], b["passes"]) for b in bands.get(name, ())]),
                "band_capacity_fleet": band_capacity(
                    [(b["rate"], b["fleet_passes"]) for b in bands.get(name, ()) if b["fleet_ttft_p90_s"]]
                ),
            }
        )
    for name, reason in invalid.items():
        if name not in searches:
            routers.append({"name": name, "capacity_rate": None, "invalid": reason, "points": []})
    return {
        "kind": "kvlb-capacity",
        "meta": dict(meta),
        "slo": slo.to_dict(),
        "best_peer": best_peer,
        "oracle_bound": dict(oracle_bound) if oracle_bound is not None else None,
        "routers": routers,
    }


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def markdown(report: Mapping[str, Any]) -> str:
    """The report as markdown tables: capacities, then every point."""
    slo = report["slo"]
    bound = f"TTFT p90 ≤ {slo['ttft_p90_s']:g} s"
    if slo.get("ttft_p99_s") is not None:
        bound += f", p99 ≤ {slo['ttft_p99_s']:g} s"
    lines = [
        f"# Capacity at the SLO ({bound}, errors ≤ {slo['max_error_rate']:.2%})",
        "",
        f"Best peer: {report.get('best_peer') or '-'}. Rates in requests/s offered (model time).",
        "",
        *_fleet_kvlb_lines(report.get("meta") or {}),
        *_fleet_error_lines(report.get("meta") or {}),
        "| router | capacity req/s | first failing | vs round robin | vs best peer | TTFT p90 s at capacity "
        "| hit rate | saved prefill / oracle's | measured on the fleet |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["routers"]:
        if r.get("invalid") and r.get("capacity_rate") is None:
            lines.append(f"| {r['name']} | invalid: {r['invalid']} | | | | | | | |")
            continue
        fleet = ", ".join(
            f"{(_replay_label(r, p) + ' ').lstrip()}{p['rate']:.3g} ({'pass' if p['meets_slo'] else 'fail'}, "
            f"p90 {_fmt(p['ttft_p90_s'])} s"
            + (f"; invalid: {_invalid_cell(p)}" if p.get("invalid") else "")
            + ")"
            for p in r.get("confirmed", ())
        )
        if r.get("invalid"):
            where = "at the target" if (report.get("meta") or {}).get("target") else "on the fleet"
            fleet = f"invalid {where}: {r['invalid']}" + (f" ({fleet})" if fleet else "")
        lines.append(
            f"| {r['name']} | {_fmt(r['capacity_rate'])} | {_fmt(r['first_failing_rate'])} "
            f"| {_fmt(r['vs_round_robin'])} | {_fmt(r['vs_best_peer'])} "
            f"| {_fmt(r['ttft_p90_s_at_capacity'])} | {_fmt(r['hit_rate_at_capacity'])} "
            f"| {_fmt(r['saved_vs_oracle'])} | {fleet or 'no'} |"
        )
    diagnosis = report.get("diagnosis")
    if diagnosis:
        lines += [
            "",
            f"At kvlb's capacity ({diagnosis['rate']:.3g} req/s) kvlb saves "
            f"{_fmt(diagnosis['kvlb_lru_vs_oracle'])} of the oracle's prefill on the engines' LRU caches, "
            f"{_fmt(diagnosis['kvlb_min_engines_vs_oracle'])} with the same policy on MIN engines "
            "(LRU to MIN: eviction; MIN to 1: placement).",
        ]
        if diagnosis.get("oracle_lru_engines_vs_oracle") is not None:
            lines.append(
                f"The oracle's own placement on the engines' LRU caches saves "
                f"{_fmt(diagnosis['oracle_lru_engines_vs_oracle'])} of its plan's prefill: "
                "what LRU engines leave reachable to any router."
            )
    lines += _band_lines(report)
    lines += _retimed_lines(report)
    lines += _invalid_point_lines(report)
    lines += [
        "",
        "## Every point",
        "",
        "| router | source | rate | TTFT p90 s | p99 s | errors | hit rate | SLO |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in report["routers"]:
        for p in [*r.get("points", ()), *r.get("confirmed", ())]:
            label = _replay_label(r, p)
            source = f"{p['source']} ({label})" if label else p["source"]
            lines.append(
                f"| {r['name']} | {source} | {p['rate']:.4g} | {_fmt(p['ttft_p90_s'])} "
                f"| {_fmt(p['ttft_p99_s'])} | {p['errors']} | {_fmt(p['hit_rate'])} "
                f"| {_verdict(p)} |"
            )
    return "\n".join(lines) + "\n"


def _invalid_cell(point: Mapping[str, Any]) -> str:
    """Why a fleet point is no measurement, in short (its note is in the list below the table)."""
    if not point.get("client_behind"):
        return "see below"
    sent, scheduled = point.get("client_sent_rate_per_s"), point.get("client_scheduled_rate_per_s")
    return f"client behind, sent {_fmt(sent)} of {_fmt(scheduled)}/s"


def _verdict(point: Mapping[str, Any]) -> str:
    if point["meets_slo"]:
        return "pass"
    return "fail (invalid: client behind)" if point.get("invalid") else "fail"


def _invalid_point_lines(report: Mapping[str, Any]) -> list[str]:
    """A warning per measured point that is no measurement at its rate (``RatePoint.invalid``): the
    ``--target`` search's points, then the fleet's (``--confirm``)."""
    lines = [
        f"- {r['name']} @ {p['rate']:.4g} req/s: {p['invalid']}"
        for r in report["routers"]
        for p in r.get("points", ())
        if p.get("invalid")
    ]
    lines += [
        f"- {r['name']} @ {p['rate']:.4g} req/s ({_fleet_label(r, p)}): {p['invalid']}"
        for r in report["routers"]
        for p in r.get("confirmed", ())
        if p.get("invalid")
    ]
    return (
        ["", "Points that are no measurement at their rate (counted as failing):", "", *lines]
        if lines
        else []
    )


def _fleet_error_lines(meta: Mapping[str, Any]) -> list[str]:
    """Why ``--confirm`` measured nothing on the fleet (``meta.fleet_error``: it did not start)."""
    error = meta.get("fleet_error")
    if not error:
        return []
    return [f"**Not confirmed on the fleet**: {error}. The searches below are the simulator's.", ""]


def _fleet_kvlb_lines(meta: Mapping[str, Any]) -> list[str]:
    """What the fleet's kvlb ran with (``--confirm``): its workers and which timers were put on model
    time (``kvlb_model_time_sets``) or set by the user (``kvlb_sets``)."""
    if not meta.get("confirmed_on_fleet"):
        return []
    workers = meta.get("kvlb_workers")
    scale = meta.get("time_scale", 1.0)
    text = f"The fleet's kvlb: {workers or 'its default'} worker(s) at time scale {scale:g}; "
    scaled = meta.get("kvlb_model_time_sets") or []
    if scaled:
        text += "its routing timers on model time (" + ", ".join(f"`{s}`" for s in scaled) + ", wall s)"
    else:
        text += "its timers on wall time" + ("" if scale == 1 else f" (a wall second is {scale:g} model s)")
    user = meta.get("kvlb_sets") or []
    if user:
        text += "; set by the user: " + ", ".join(f"`{s}`" for s in user)
    return [text + ".", ""]


def _band_lines(report: Mapping[str, Any]) -> list[str]:
    """The table of the fleet's repeats against the simulator's spread (``--confirm-sim-draws``)."""
    rows = [(r, b) for r in report["routers"] for b in r.get("band") or ()]
    if not rows:
        return []
    lines = [
        "",
        "## Against the simulator's spread",
        "",
        "Each confirmed rate simulated once per draw with every arrival moved by up to ± the jitter; "
        "a rate passes for the draws (the fleet) when at least half of them pass.",
        "",
        "| router | rate | draws | sim p90 median s | sim p90 range s | sim pass share | one sim p90 s "
        "| fleet p90 s per repeat | fleet median s | fleet / sim median | within 10% | inside range "
        "| fleet pass share | sim hit rate range |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, b in rows:
        fleet = ", ".join(_fmt(p) for p in b["fleet_ttft_p90_s"]) or "-"
        inside = sum(b["fleet_inside_sim_range"])
        hop = b.get("hop_jitter_ms") or 0  # absent in reports saved before the hop's spread
        spread = f"±{b['jitter_ms']:g} ms" + (f", hop ±{hop:g} ms" if hop else "")
        lines.append(
            f"| {r['name']} | {b['rate']:.4g} | {b['draws']} ({spread}) "
            f"| {_fmt(b['ttft_p90_median_s'])} | {_fmt(b['ttft_p90_min_s'])}–{_fmt(b['ttft_p90_max_s'])} "
            f"| {_fmt(b['pass_share'], 2)} | {_fmt(b['sim_single_ttft_p90_s'])} | {fleet} "
            f"| {_fmt(b['fleet_ttft_p90_median_s'])} | {_fmt(b['fleet_median_vs_sim_median'])} "
            f"| {'yes' if b['fleet_median_within_tol'] else 'no'} "
            f"| {inside} of {len(b['fleet_inside_sim_range'])} | {_fmt(b['fleet_pass_share'], 2)} "
            f"| {_fmt(b.get('hit_rate_min'))}–{_fmt(b.get('hit_rate_max'))} |"
        )
    lines.append("")
    for r in report["routers"]:
        if r.get("band"):
            lines.append(
                f"- {r['name']}: capacity among the confirmed rates {_fmt(r['band_capacity_sim'])} req/s "
                f"by the draws, {_fmt(r['band_capacity_fleet'])} by the fleet "
                f"(one simulation's search: {_fmt(r['capacity_rate'])})."
            )
    return lines


def _retimed_lines(report: Mapping[str, Any]) -> list[str]:
    """The table of each fleet run against the draws and its retimed simulations
    (``--confirm-retimed-hops-ms`` and ``--confirm-retimed-hop-ranges-ms``,
    :mod:`loadtests.capacity.retimed`)."""
    rows = [(r, p) for r in report["routers"] for p in r.get("confirmed", ()) if p.get("retimed")]
    if not rows:
        return []
    lines = [
        "",
        "## At the fleet's own times",
        "",
        "Each fleet run's requests simulated once per hop, each arriving when the run routed it "
        "(model time), and with each request's hop drawn in a range (several draws per range); like "
        "the draws, the fixed hops pass when at least half of them pass and so does each range, and "
        "the run is timing when its own pass or fail is that of the fixed hops or of any range.",
        "",
        "| router | rate | repeat | fleet p90 s | fleet | draws "
        "| times (offset from the schedule p10–p90 ms) | retimed p90 s per hop | retimed "
        "| spread hop: passing (p90 median s) | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, p in rows:
        t = p["retimed"]
        off = t.get("offset_ms") or {}
        per_hop = ", ".join(
            f"{h:g} ms: {_fmt(v)}" for h, v in zip(t["hops_ms"], t["ttft_p90_s"], strict=True)
        )
        draws = "-" if t.get("draws_pass") is None else ("pass" if t["draws_pass"] else "fail")
        lines.append(
            f"| {r['name']} | {p['rate']:.4g} | {_fmt(p.get('repeat'))} | {_fmt(p['ttft_p90_s'])} "
            f"| {'pass' if t['fleet_passes'] else 'fail'} | {draws} "
            f"| {t['times']} ({_fmt(off.get('p10'))}–{_fmt(off.get('p90'))}{_lag(t)}) | {per_hop} "
            f"| {'pass' if t['passes'] else 'fail'} ({_fmt(t['pass_share'], 2)}) | {_spread(t)} "
            f"| {t['verdict']} |"
        )
    return lines


def _spread(retimed: Mapping[str, Any]) -> str:
    """Each hop range's passing draws and TTFT p90 median, e.g. ``5–15 ms: 3 of 5 (1.71)``."""
    parts = [
        f"{lo:g}–{hi:g} ms: {passing(s)} of {s['draws']} ({_fmt(s['ttft_p90_median_s'])})"
        for s in retimed.get("spread", ())
        for lo, hi in [s["hop_ms"]]
    ]
    return "; ".join(parts) or "-"


def _lag(retimed: Mapping[str, Any]) -> str:
    """The decisions' routing lag after each send, p10–p90 model ms (with saved decisions only)."""
    lag = retimed.get("routing_lag_ms")
    return "" if not lag else f"; routing lag {_fmt(lag.get('p10'))}–{_fmt(lag.get('p90'))}"


def routed_points(row: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A router's fleet points that its router routed (not the replays of its simulated assignment)."""
    return [p for p in row.get("confirmed", ()) if p.get("fleet_router", row["name"]) == row["name"]]


def _fleet_label(row: Mapping[str, Any], point: Mapping[str, Any]) -> str:
    """``fleet``, with its replay's name and its repeat when there are any: which fleet run a point is."""
    parts = ["fleet", _replay_label(row, point)]
    if point.get("repeat") is not None:
        parts.append(f"repeat {point['repeat']}")
    return ", ".join(p for p in parts if p)


def _replay_label(row: Mapping[str, Any], point: Mapping[str, Any]) -> str:
    """``replay:<router>`` for a replay's point (``kvlb capacity --confirm-replay``), else ``""``."""
    routed = str(point.get("fleet_router", row["name"]))
    return "" if routed == row["name"] else routed


_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f")


def svg_plot(report: Mapping[str, Any], width: int = 720, height: int = 440) -> str:
    """TTFT p90 (log scale) against offered rate, one line per router (simulated points; fleet
    points as hollow circles), with the SLO as a dashed line."""
    series = []
    for r in report["routers"]:
        sim = [(p["rate"], p["ttft_p90_s"]) for p in r.get("points", ()) if p.get("ttft_p90_s")]
        fleet = [(p["rate"], p["ttft_p90_s"]) for p in routed_points(r) if p.get("ttft_p90_s")]
        if sim or fleet:
            series.append((r["name"], sim, fleet))
    slo = float(report["slo"]["ttft_p90_s"])
    values = [v for _, s, f in series for _, v in (*s, *f)] + [slo]
    rates = [x for _, s, f in series for x, _ in (*s, *f)] or [1.0]
    left, right, top, bottom = 70, width - 170, 30, height - 50
    x0, x1 = 0.0, max(rates) * 1.05
    y0, y1 = math.log10(max(min(values), 1e-3) / 1.5), math.log10(max(values) * 1.5)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0 or 1) * (right - left)

    def sy(y: float) -> float:
        return bottom - (math.log10(max(y, 1e-3)) - y0) / (y1 - y0 or 1) * (bottom - top)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="black"/>',
        f'<text x="{(left + right) / 2}" y="{height - 12}" text-anchor="middle">offered rate, req/s</text>',
        f'<text x="16" y="{(top + bottom) / 2}" transform="rotate(-90 16 {(top + bottom) / 2})" '
        f'text-anchor="middle">TTFT p90, s (log)</text>',
    ]
    for k in range(6):
        x = x0 + (x1 - x0) * k / 5
        out.append(f'<text x="{sx(x):.1f}" y="{bottom + 16}" text-anchor="middle">{x:.3g}</text>')
    for exponent in range(math.floor(y0), math.ceil(y1) + 1):
        for m in (1, 2, 5):
            y = m * 10.0**exponent
            if y0 <= math.log10(y) <= y1:
                out.append(f'<text x="{left - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
                out.append(
                    f'<line x1="{left}" y1="{sy(y):.1f}" x2="{right}" y2="{sy(y):.1f}" stroke="#eee"/>'
                )
    out.append(
        f'<line x1="{left}" y1="{sy(slo):.1f}" x2="{right}" y2="{sy(slo):.1f}" stroke="black" '
        f'stroke-dasharray="6 4"/><text x="{right - 4}" y="{sy(slo) - 4:.1f}" text-anchor="end">'
        f"SLO {slo:g} s</text>"
    )
    for i, (name, sim, fleet) in enumerate(series):
        colour = _COLOURS[i % len(_COLOURS)]
        if sim:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sim)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
            out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}"/>' for x, y in sim]
        ring = f'r="6" fill="none" stroke="{colour}" stroke-width="2"'
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" {ring}/>' for x, y in fleet]
        ly = top + 10 + 18 * i
        key = f'x1="{right + 12}" y1="{ly}" x2="{right + 32}" y2="{ly}"'
        out.append(f'<line {key} stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{right + 38}" y="{ly + 4}">{name}</text>')
    ly = top + 10 + 18 * len(series)
    out.append(f'<circle cx="{right + 22}" cy="{ly}" r="6" fill="none" stroke="black"/>')
    out.append(f'<text x="{right + 38}" y="{ly + 4}">emulated fleet</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
