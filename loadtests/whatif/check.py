"""``kvlb loadtest --whatif NAME=VALUE ...``: how well ``/admin/whatif`` predicts a real run (I/O).

The same request stream (``kvlb loadtest``'s workload options) runs twice on one emulated fleet,
caches flushed in between:

1. **baseline**: kvlb with its default policy (or ``--whatif-base``). Once the fleet is idle, and
   before kvlb stops, ``POST /admin/whatif`` replays every decision of the run with the proposed
   weights (``--whatif``) or policy (``--whatif-policy``): kvlb's prediction of the change.
2. **candidate**: kvlb started with those weights (``kvlb:<policy>+<weight>=<value>``), the run that
   the prediction is about. Its own ``/admin/whatif`` with no change gives kvlb's predicted hit rate
   of the candidate's real decisions, which separates the index's prediction error from the
   replay's counterfactual error.

Measured hit rates are the engines' own (``usage.prompt_tokens_details.cached_tokens`` over prompt
tokens, as ``kvlb loadtest`` reports them). The replay says nothing about latency directly; the
figure it gives that TTFT depends on is the prefill still to do (uncached blocks), reported next to
the measured TTFT change. Writes ``whatif_check.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtests.atomic_files import write_text_atomic
from loadtests.fleet.processes import emulator_options, read_capacity, start_emulator
from loadtests.peers import RouterSpec, parse_router
from loadtests.runs import RouterRun, run_router

WHATIF_TIMEOUT_S = 120.0


def add_whatif_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--whatif", action="append", default=None, metavar="WEIGHT=VALUE",
        help="check /admin/whatif's prediction of these weights against a real run with them "
        "(repeatable; replaces --routers: baseline kvlb, then kvlb:<policy>+<weight>=<value>)")  # fmt: skip
    add(
        "--whatif-policy",
        default=None,
        help="with --whatif: the policy to predict (default: --whatif-base's)",
    )
    add("--whatif-base", default="cost", help="with --whatif: the baseline kvlb policy (default cost)")


def _weights(pairs: list[str]) -> dict[str, float]:
    weights: dict[str, float] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--whatif expects WEIGHT=VALUE, got {pair!r}")
        value = yaml.safe_load(raw)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"--whatif {pair!r}: the value must be a number")
        weights[name.strip()] = float(value)
    return weights


def candidate_router(policy: str, weights: dict[str, float]) -> RouterSpec:
    """``kvlb:<policy>+<weight>=<value>+...``: the router the prediction is about."""
    return parse_router("kvlb:" + "+".join([policy, *(f"{k}={v:g}" for k, v in weights.items())]))


async def _whatif(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(
        url + "/admin/whatif", json=body, timeout=aiohttp.ClientTimeout(total=WHATIF_TIMEOUT_S)
    ) as response:
        answer: dict[str, Any] = await response.json()
        if response.status != 200:
            raise RuntimeError(f"/admin/whatif answered {response.status}: {answer}")
        return answer


def _measured(run: RouterRun) -> dict[str, Any]:
    summary = run.summary
    if run.status != "ok" or summary is None:
        raise RuntimeError(f"{run.spec.name}: {run.status}: {run.note}")
    return {
        "requests": summary.requests,
        "ok": summary.ok,
        "hit_rate": summary.hit_rate,
        "ttft_p50_s": summary.ttft_p50_s,
        "ttft_p90_s": summary.ttft_p90_s,
        "ttft_mean_s": summary.ttft_mean_s,
        "replica_share": summary.replica_share,
    }


def _difference(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def _ratio(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None or before == 0 else after / before


def compare(
    baseline: RouterRun, candidate: RouterRun, weights: dict[str, float], policy: str
) -> dict[str, Any]:
    """The check's figures from the two runs and the what-if answers they kept."""
    base, cand = _measured(baseline), _measured(candidate)
    predicted = baseline.after_drive["whatif"]
    cand_self = candidate.after_drive["whatif"]
    shares = {
        r["replica"]: {
            "predicted_after_share": r["after_share"],
            "measured_candidate_share": cand["replica_share"].get(r["replica"], 0.0),
            "baseline_share": base["replica_share"].get(r["replica"], 0.0),
        }
        for r in predicted["replicas"]
    }
    share_error = max(
        (abs(s["predicted_after_share"] - s["measured_candidate_share"]) for s in shares.values()),
        default=0.0,
    )
    return {
        "proposal": {"policy": policy, "weights": weights},
        "decisions_replayed": predicted["decisions"],
        "changed_share": predicted["changed_share"],
        "hit_rate": {
            "baseline_measured": base["hit_rate"],
            "baseline_predicted_by_kvlb": predicted["before"]["hit_rate"],
            "whatif_predicted_after": predicted["after"]["hit_rate"],
            "candidate_measured": cand["hit_rate"],
            "candidate_predicted_by_kvlb": cand_self["before"]["hit_rate"],
            "predicted_change": predicted["after"]["hit_rate"] - predicted["before"]["hit_rate"],
            "measured_change": _difference(cand["hit_rate"], base["hit_rate"]),
            "error_after": _difference(predicted["after"]["hit_rate"], cand["hit_rate"]),
        },
        "prefill": {
            "predicted_blocks_ratio": _ratio(
                predicted["after"]["prefill_blocks"], predicted["before"]["prefill_blocks"]
            ),
            "load_spread_before": predicted["before"]["load_spread"],
            "load_spread_after_predicted": predicted["after"]["load_spread"],
            "load_spread_candidate_kvlb": cand_self["before"]["load_spread"],
        },
        "ttft": {
            "baseline_p50_s": base["ttft_p50_s"],
            "candidate_p50_s": cand["ttft_p50_s"],
            "p50_ratio": _ratio(cand["ttft_p50_s"], base["ttft_p50_s"]),
            "baseline_p90_s": base["ttft_p90_s"],
            "candidate_p90_s": cand["ttft_p90_s"],
            "p90_ratio": _ratio(cand["ttft_p90_s"], base["ttft_p90_s"]),
            "note": "the replay predicts no latency; compare p50_ratio with prefill.predicted_blocks_ratio",
        },
        "replica_shares": shares,
        "max_share_error": share_error,
        "notes": predicted["notes"],
        "runs": {"baseline": base, "candidate": cand},
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def table(check: dict[str, Any]) -> str:
    hit, ttft, prefill = check["hit_rate"], check["ttft"], check["prefill"]
    rows = [
        ("decisions replayed", check["decisions_replayed"], ""),
        ("changed share (predicted)", check["changed_share"], ""),
        (
            "hit rate, baseline: kvlb predicted / measured",
            hit["baseline_predicted_by_kvlb"],
            hit["baseline_measured"],
        ),
        (
            "hit rate, after: whatif predicted / measured",
            hit["whatif_predicted_after"],
            hit["candidate_measured"],
        ),
        ("hit rate change: predicted / measured", hit["predicted_change"], hit["measured_change"]),
        ("candidate: kvlb's own predicted hit rate", hit["candidate_predicted_by_kvlb"], ""),
        ("prefill blocks after/before (predicted)", prefill["predicted_blocks_ratio"], ""),
        (
            "load spread: before / predicted after",
            prefill["load_spread_before"],
            prefill["load_spread_after_predicted"],
        ),
        ("TTFT p50 s: baseline / candidate", ttft["baseline_p50_s"], ttft["candidate_p50_s"]),
        ("TTFT p90 s: baseline / candidate", ttft["baseline_p90_s"], ttft["candidate_p90_s"]),
        ("max replica share error", check["max_share_error"], ""),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name.ljust(width)}  {_cell(a):>8}  {_cell(b):>8}" for name, a, b in rows)


def write_check(check: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(check, indent=2, allow_nan=False) + "\n")


async def whatif_campaign(args: argparse.Namespace, out: Path) -> int:
    """The two runs and the comparison (module docstring)."""
    from loadtests.command import build_specs, build_workload, drive_options

    weights = _weights(args.whatif)
    policy = args.whatif_policy or args.whatif_base
    baseline_spec = parse_router("kvlb" if args.whatif_base == "cost" else f"kvlb:{args.whatif_base}")
    candidate = candidate_router(policy, weights)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    options = emulator_options(args, event_flavor="sglang")
    print(f"starting {args.replicas} replicas ({args.profile}) ...", file=sys.stderr)
    fleet = await start_emulator(options, logs)
    ring = max(10_000, 2 * args.requests)
    ring_sets = (f"console.decision_ring_size={ring}", f"console.whatif_max_entries={ring}")
    # one worker: the decision ring is each worker's own, and the replay must see every decision
    drive = drive_options(args, kvlb_sets=(*args.kvlb_set, *ring_sets), kvlb_workers=1)
    proposal: dict[str, Any] = {"weights": weights, "sample": 5}
    if args.whatif_policy:
        proposal["policy"] = args.whatif_policy

    async def predict(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
        return {"whatif": await _whatif(session, url, proposal)}

    async def self_check(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
        return {"whatif": await _whatif(session, url, {"sample": 0})}

    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        async with aiohttp.ClientSession() as session:
            capacity = await read_capacity(session, fleet)
        specs = build_specs(build_workload(args, capacity, len(fleet.replicas)), args)
        base_run = await run_router(baseline_spec, fleet, specs, drive, logs, after_drive=predict)
        cand_run = await run_router(candidate, fleet, specs, drive, logs, after_drive=self_check)
    finally:
        await fleet.stop()
    check = compare(base_run, cand_run, weights, policy)
    check["meta"] = {
        "started": started,
        "workload": args.workload,
        "params": args.param,
        "requests": len(specs),
        "rate_per_s": args.rate,
        "replicas": args.replicas,
        "profile": args.profile,
        "time_scale": args.time_scale,
        "baseline": baseline_spec.name,
        "candidate": candidate.name,
        "seed": args.seed,
    }
    write_check(check, out / "whatif_check.json")
    print(json.dumps(check, allow_nan=False))
    print(table(check), file=sys.stderr)
    print(f"written: {out / 'whatif_check.json'}", file=sys.stderr)
    return 0
