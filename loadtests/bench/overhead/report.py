"""Figures and the readable table of ``kvlb bench overhead`` (pure: no I/O, no clock).

* Latency percentiles interpolate linearly between closest ranks (numpy's default).
* The *added* latency of a proxy at a percentile is ``percentile(proxy) − percentile(direct)``, both
  taken over the same interleaved run, so slow phases of a shared machine hit every path alike.
* Route-decision quantiles come from the ``kvlb_route_decision_seconds`` histogram (difference of two
  scrapes), interpolated inside buckets as Prometheus' ``histogram_quantile`` does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from loadtests.stats import percentile

MODES: tuple[str, ...] = ("direct", "forward", "kvlb")
"""``direct``: client → fake upstream; ``forward``: through a plain aiohttp proxy; ``kvlb``. The peer
paths (``sglang_cache_aware``, ``sglang_round_robin``) follow when they ran."""
PROXIES: tuple[str, ...] = ("forward", "kvlb")
"""The paths always measured besides ``direct``."""
PEER_BASELINE = "sglang_cache_aware"
"""The peer whose CPU per request the issue's ratio divides by."""
RATIO_KINDS: tuple[str, ...] = ("chat_shared", "chat")
PHASES: tuple[str, ...] = ("sequential", "spaced", "concurrent")
"""Every kind's phases: one request at a time in blocks per path, one at a time after an idle gap,
and bursts of concurrent clients."""
LOCAL_MODE = "tokenizer"
"""``chat_cold``'s pseudo-path in the one-at-a-time phases: the bench process's tokenizer, its CPU only."""

TOKEN_KINDS: tuple[str, ...] = ("tokens", "tokens_shared", "grpc_tokens")
"""The token-id kinds, whose kvlb CPU per request is set against the forward proxy's (``grpc_tokens``:
kvlb's over gRPC against the proxy's over HTTP, for the same prompts)."""

HEADLINE_KIND = "chat_shared"
"""The kind the targets line reports (``chat`` when it was not run): chats that share system prompts."""

TARGETS: dict[str, float] = {
    "added_p50_ms": 0.5,
    "added_p99_ms": 2.0,
    "req_per_s_per_process": 2000.0,
    "workers2_new_prompt_req_per_s_ratio": 1.7,
}
"""The issue's targets for kvlb (8k-token chat prompts)."""


def latency_figures(latencies_s: Sequence[float]) -> dict[str, float | int | None]:
    """Count, mean, p50, p90 and p99 of latencies in seconds, reported in milliseconds."""

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 4)

    mean = sum(latencies_s) / len(latencies_s) if latencies_s else None
    return {
        "n": len(latencies_s),
        "mean_ms": ms(mean),
        "p50_ms": ms(percentile(latencies_s, 50)),
        "p90_ms": ms(percentile(latencies_s, 90)),
        "p99_ms": ms(percentile(latencies_s, 99)),
    }


def added(by_mode: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per proxy (every path but ``direct``): its p50/p90/p99 minus the direct path's (milliseconds)."""
    direct = by_mode["direct"]
    return {
        proxy: {
            f"{key}_ms": _diff(by_mode[proxy].get(f"{key}_ms"), direct.get(f"{key}_ms"))
            for key in ("p50", "p90", "p99")
        }
        for proxy in by_mode
        if proxy != "direct"
    }


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or float(b) <= 0:
        return None
    return round(float(a) / float(b), 3)


def own_ratios(runs: Mapping[str, Mapping[str, Any]], tokenizer_cpu_ms: float | None) -> dict[str, Any]:
    """The issue's two other CPU ratios, per phase: the token-id kinds (:data:`TOKEN_KINDS`), kvlb's
    CPU per request ÷ the plain forward proxy's; ``chat_cold``, kvlb's CPU per request ÷ the
    tokenizer's own CPU per new chat, measured in the bench process: in the phase's own turns when it
    took them (:data:`LOCAL_MODE`: the same bodies after the same idle time), else
    ``tokenizer_cpu_ms`` (back to back). A kind or phase that was not run is left out."""

    def kvlb_cpu(kind: str, phase: str, mode: str = "kvlb") -> Any:
        return runs[kind][phase]["cpu"][mode]["cpu_ms_per_request"]

    def tokenizer_ms(phase: str) -> Any:
        local = runs["chat_cold"][phase]["cpu"].get(LOCAL_MODE)
        return tokenizer_cpu_ms if local is None else local["cpu_ms_per_request"]

    out: dict[str, Any] = {}
    for kind in TOKEN_KINDS:
        if kind not in runs:
            continue
        out[kind] = {
            phase: {
                "kvlb_cpu_ms_per_request": kvlb_cpu(kind, phase),
                "forward_cpu_ms_per_request": kvlb_cpu(kind, phase, "forward"),
                "cpu_ratio": _ratio(kvlb_cpu(kind, phase), kvlb_cpu(kind, phase, "forward")),
            }
            for phase in PHASES
            if phase in runs[kind]
        }
    if "chat_cold" in runs:
        out["chat_cold"] = {
            phase: {
                "kvlb_cpu_ms_per_request": kvlb_cpu("chat_cold", phase),
                "tokenizer_cpu_ms": tokenizer_ms(phase),
                "cpu_ratio": _ratio(kvlb_cpu("chat_cold", phase), tokenizer_ms(phase)),
            }
            for phase in PHASES
            if phase in runs["chat_cold"]
        }
    return out


def peer_ratios(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind of :data:`RATIO_KINDS` run with :data:`PEER_BASELINE` measured: kvlb's CPU per request
    ÷ the peer's (each phase), and both paths' added p50 (ms). Empty when the peer did not run."""
    out: dict[str, dict[str, Any]] = {}
    for kind in RATIO_KINDS:
        run = runs.get(kind)
        if run is None or PEER_BASELINE not in run["concurrent"]["cpu"]:
            continue
        figures: dict[str, Any] = {}
        for phase in (phase for phase in PHASES if phase in run):
            cpu, add = run[phase]["cpu"], run[phase]["added"]
            kvlb_ms = cpu["kvlb"]["cpu_ms_per_request"]
            peer_ms = cpu[PEER_BASELINE]["cpu_ms_per_request"]
            figures[phase] = {
                "kvlb_cpu_ms_per_request": kvlb_ms,
                f"{PEER_BASELINE}_cpu_ms_per_request": peer_ms,
                "cpu_ratio": _ratio(kvlb_ms, peer_ms),
                "kvlb_added_p50_ms": add["kvlb"]["p50_ms"],
                f"{PEER_BASELINE}_added_p50_ms": add[PEER_BASELINE]["p50_ms"],
            }
        out[kind] = figures
    return out


def workers_ratios(
    runs: Mapping[str, Mapping[str, Any]], workers: Sequence[int]
) -> dict[str, dict[str, Any]]:
    """Per kind: each ``kvlb_w<n>`` path's concurrent req/s ÷ the ``kvlb`` path's (``--workers
    workers[0]``), with both rates. ``chat_cold`` is the new-prompt figure of the issue's target."""
    out: dict[str, dict[str, Any]] = {}
    for kind, run in runs.items():
        rates = run["concurrent"]["req_per_s"]
        base = rates.get("kvlb")
        figures: dict[str, Any] = {f"kvlb_w{workers[0]}_req_per_s": base}
        for count in workers[1:]:
            rate = rates.get(f"kvlb_w{count}")
            figures[f"kvlb_w{count}_req_per_s"] = rate
            figures[f"w{count}_over_w{workers[0]}"] = _ratio(rate, base)
        out[kind] = figures
    return out


def _diff(a: Any, b: Any) -> float | None:
    if a is None or b is None:
        return None
    return round(float(a) - float(b), 4)


def cpu_figures(requests: int, cpu_s: float, wall_s: float) -> dict[str, float | None]:
    """A process's CPU per request, the rate one fully busy core would route, and its mean load."""
    return {
        "requests": requests,
        "cpu_s": round(cpu_s, 3),
        "cpu_ms_per_request": round(cpu_s / requests * 1000, 4) if requests else None,
        "req_per_cpu_s": round(requests / cpu_s, 1) if cpu_s > 0 else None,
        "cpu_utilisation": round(cpu_s / wall_s, 3) if wall_s > 0 else None,
    }


# --------------------------------------------------------------------------- Prometheus histogram


def parse_histogram(text: str, name: str) -> dict[str, Any]:
    """``{"buckets": [(le, cumulative count)...], "sum": s, "count": n}`` of an unlabelled histogram
    (the samples of every label set are added up)."""
    buckets: dict[float, float] = {}
    total_sum = 0.0
    count = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "_"):
            continue
        head, _, value_text = line.rpartition(" ")
        value = float(value_text)
        if head.startswith(name + "_bucket"):
            le_text = head.split('le="', 1)[1].split('"', 1)[0]
            le = math.inf if le_text == "+Inf" else float(le_text)
            buckets[le] = buckets.get(le, 0.0) + value
        elif head.startswith(name + "_sum"):
            total_sum += value
        elif head.startswith(name + "_count"):
            count += value
    return {"buckets": sorted(buckets.items()), "sum": total_sum, "count": count}


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` in Prometheus text whose labels include ``labels`` (every
    label set without them; 0 when there is none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def histogram_delta(after: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, Any]:
    """``after − before``, bucket by bucket."""
    old = dict(before["buckets"])
    return {
        "buckets": [(le, n - old.get(le, 0.0)) for le, n in after["buckets"]],
        "sum": after["sum"] - before["sum"],
        "count": after["count"] - before["count"],
    }


def histogram_quantile(q: float, histogram: Mapping[str, Any]) -> float | None:
    """The ``q`` quantile (0..1), linear inside the bucket that holds it; ``None`` when empty."""
    buckets: list[tuple[float, float]] = list(histogram["buckets"])
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return lower_le
            if n == lower_n:
                return le
            return lower_le + (le - lower_le) * (rank - lower_n) / (n - lower_n)
        lower_le, lower_n = le, n
    return lower_le  # pragma: no cover - the last bucket is +Inf and holds everything


def decision_figures(histogram: Mapping[str, Any]) -> dict[str, float | None]:
    """Count, mean, p50 and p99 (microseconds) of route decisions in a histogram delta."""
    count = histogram["count"]

    def us(value: float | None) -> float | None:
        return None if value is None else round(value * 1e6, 2)

    return {
        "count": count,
        "mean_us": us(histogram["sum"] / count) if count else None,
        "p50_us": us(histogram_quantile(0.5, histogram)),
        "p99_us": us(histogram_quantile(0.99, histogram)),
    }


# --------------------------------------------------------------------------------------- table


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


def _kind_lines(kind: str, run: Mapping[str, Any]) -> list[str]:
    lines = [f"[{kind}] {run['description']}"]
    lines.append(
        f"  {'phase':<12}{'path':<20}{'p50 ms':>9}{'p99 ms':>9}{'added p50':>11}{'added p99':>11}{'req/s':>9}"
    )
    for phase in (phase for phase in PHASES if phase in run):
        data = run[phase]
        for mode in data["latency"]:
            lat = data["latency"][mode]
            add = data["added"].get(mode, {})
            rate = data.get("req_per_s", {}).get(mode)
            label = phase if mode == "direct" else ""
            lines.append(
                f"  {label:<12}{mode:<20}{_num(lat['p50_ms']):>9}{_num(lat['p99_ms']):>9}"
                f"{_num(add.get('p50_ms')):>11}{_num(add.get('p99_ms')):>11}{_num(rate, 0):>9}"
            )
    for proxy, cpu in run["concurrent"]["cpu"].items():
        lines.append(
            f"  {proxy} process CPU: {_num(cpu['cpu_ms_per_request'], 3)} ms/request → "
            f"{_num(cpu['req_per_cpu_s'], 0)} routed req/s per fully busy core "
            f"(it ran at {_num(cpu['cpu_utilisation'], 2)} cores)"
        )
    memo = run.get("token_id_memo")
    if memo is not None and any(memo.values()):
        lines.append(
            f"  kvlb token-id memo runs: {memo['hits']:,} found, {memo['misses']:,} decoded, "
            f"{memo['evictions']:,} evicted"
        )
    bodies = run.get("body_memo")
    if bodies is not None and any(bodies.values()):
        lines.append(
            f"  kvlb body memo: {bodies['hits']:,} bodies found, {bodies['misses']:,} not found, "
            f"{bodies['evictions']:,} evicted"
        )
    decision = run["route_decision"]
    lines.append(
        f"  kvlb route decision (kvlb_route_decision_seconds): mean {_num(decision['mean_us'], 1)} µs, "
        f"p50 {_num(decision['p50_us'], 1)} µs, p99 {_num(decision['p99_us'], 1)} µs"
    )
    return lines


def format_report(report: Mapping[str, Any]) -> str:
    """The readable table of a report built by :func:`loadtests.bench.overhead.run.run`."""
    shape, targets = report["shape"], report["targets"]
    measured_tokens = report["prompt_tokens"]["mean"]
    lines = [
        f"kvlb bench overhead: {shape['prompt_tokens']:,}-token prompts ({measured_tokens:,.0f} tokens "
        f"measured), {shape['prompts']} distinct, concurrency {shape['concurrency']}, "
        f"fake upstream answering at once; load average {report['machine']['loadavg']}",
    ]
    penalty = report["machine"].get("idle_penalty")
    if penalty is not None:
        idle_us, warm_us = penalty["after_idle_us_p50"], penalty["back_to_back_us_p50"]
        lines.append(
            f"this machine after {_num(penalty['gap_ms'], 0)} ms idle: a fixed Python workload took "
            f"{_num(idle_us, 0)} µs CPU against {_num(warm_us, 0)} µs back to back "
            f"({_num(penalty['factor'])}×): the spaced phase's requests carry it"
        )
    tok, shared = report["tokenize_ms"], report.get("tokenize_shared_inline_ms", {})
    lines.append(
        f"tokenizing one chat prompt (kvlb's tokenizer, in the bench process): from scratch p50 "
        f"{_num(tok['p50_ms'])} ms, p99 {_num(tok['p99_ms'])} ms; chat_shared on the request path "
        f"(encode_chat_if_cached, system prompt cached, new user message) p50 "
        f"{_num(shared.get('p50_ms'))} ms, p99 {_num(shared.get('p99_ms'))} ms, "
        f"{shared.get('refused', 'n/a')} of {shared.get('samples', 'n/a')} refused inline"
    )
    threads = report.get("tokenize_threads")
    if threads is not None:
        lines.append(
            f"{threads['threads']} threads tokenizing new chat prompts at once ({threads['rounds']} rounds): "
            f"{_num(threads['chats_per_s_p50'], 1)} prompts/s, the event loop stalled at most "
            f"{_num(threads['max_loop_lag_ms_p50'])} ms per round (p50), "
            f"{_num(threads['max_loop_lag_ms_max'])} ms worst"
        )
    runs = report["runs"]
    ordered = sorted(runs, key=lambda kind: kind != HEADLINE_KIND)
    for kind in ordered:
        lines.extend(_kind_lines(kind, runs[kind]))
    headline = next((kind for kind in (HEADLINE_KIND, "chat") if kind in runs), None)
    if headline is not None:
        chat = runs[headline]
        seq = chat["sequential"]["added"]["kvlb"]
        conc = chat["concurrent"]["added"]["kvlb"]
        rate = chat["concurrent"]["cpu"]["kvlb"]["req_per_cpu_s"]
        lines.append(
            f"targets ({headline}): added p50 ≤ {targets['added_p50_ms']} ms → sequential "
            f"{_num(seq['p50_ms'])}, concurrent {_num(conc['p50_ms'])}; added p99 ≤ "
            f"{targets['added_p99_ms']} ms → {_num(seq['p99_ms'])}, {_num(conc['p99_ms'])}; "
            f"≥ {targets['req_per_s_per_process']:,.0f} req/s per process → {_num(rate, 0)}"
        )
    peers = report.get("peers", {})
    for reason in peers.get("skipped", {}).values():
        lines.append(f"peer path skipped: {reason}")
    for kind, figures in report.get("peer_ratios", {}).items():
        seq, conc = figures["sequential"], figures["concurrent"]
        spaced = figures.get("spaced", {})
        lines.append(
            f"kvlb vs {PEER_BASELINE} ({kind}): CPU per request ratio (kvlb ÷ peer) concurrent "
            f"{_num(conc['cpu_ratio'], 2)} ({_num(conc['kvlb_cpu_ms_per_request'], 3)} ÷ "
            f"{_num(conc[f'{PEER_BASELINE}_cpu_ms_per_request'], 3)} ms), sequential "
            f"{_num(seq['cpu_ratio'], 2)}, spaced {_num(spaced.get('cpu_ratio'), 2)}; added p50 kvlb "
            f"{_num(seq['kvlb_added_p50_ms'])} / {_num(spaced.get('kvlb_added_p50_ms'))} / "
            f"{_num(conc['kvlb_added_p50_ms'])} ms, peer {_num(seq[f'{PEER_BASELINE}_added_p50_ms'])} / "
            f"{_num(spaced.get(f'{PEER_BASELINE}_added_p50_ms'))} / "
            f"{_num(conc[f'{PEER_BASELINE}_added_p50_ms'])} ms (sequential / spaced / concurrent)"
        )
    own = report.get("own_ratios", {})
    for kind in TOKEN_KINDS:
        if kind not in own:
            continue
        parts = [
            f"{phase} {_num(figures['cpu_ratio'], 2)} ({_num(figures['kvlb_cpu_ms_per_request'], 3)} ÷ "
            f"{_num(figures['forward_cpu_ms_per_request'], 3)} ms)"
            for phase, figures in own[kind].items()
        ]
        lines.append(f"kvlb vs forward ({kind}): CPU per request ratio {', '.join(parts)}")
    if "chat_cold" in own:
        parts = [
            f"{phase} {_num(figures['cpu_ratio'], 2)} ({_num(figures['kvlb_cpu_ms_per_request'], 3)} ÷ "
            f"{_num(figures['tokenizer_cpu_ms'], 3)} ms)"
            for phase, figures in own["chat_cold"].items()
        ]
        lines.append(f"kvlb vs the tokenizer's own CPU (chat_cold): ratio {', '.join(parts)}")
    for kind, figures in report.get("workers_ratios", {}).items():
        parts = [f"{name} {_num(value, 2 if '_over_' in name else 1)}" for name, value in figures.items()]
        target = (
            f" (target w2/w1 ≥ {targets.get('workers2_new_prompt_req_per_s_ratio')})"
            if kind == "chat_cold"
            else ""
        )
        lines.append(f"--workers sweep ({kind}, concurrent req/s): {', '.join(parts)}{target}")
    return "\n".join(lines)
